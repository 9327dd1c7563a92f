"""``python -m raytrain_mnist.fit``: data parallel MNIST on Ray Train, from the command line.

The command parses its flags into a :class:`~raytrain_mnist.config.FitConfig`, hands it to
the library (:func:`raytrain_mnist.driver.fitting.fit`) with a
:class:`~raytrain_mnist.console.Renderer` for the run's events (phase lines, a bar or lines
within each epoch, one line per epoch), then prints the summary and chooses the exit
status: 0 finished, 1 failed, 130 stopped with Ctrl-C, 143 stopped with SIGTERM (the same
stop: the summary, the resume command). The run directory is ``<storage-path>/<name>``;
``summary.json`` and ``training_curves.png`` are written there.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from raytrain_mnist._cli import (
    ArgumentParser,
    Command,
    add_dataclass_args,
    add_json_arg,
    add_recipe_arg,
    dataclass_from_args,
    emit_result,
    exit_now,
    interrupted,
    invocation,
    parse_with_recipe,
    printable,
    setup_logging,
)
from raytrain_mnist.config import (
    RECIPES,
    FitConfig,
    RunSettings,
    TrainConfig,
    parse_workers,
)
from raytrain_mnist.console import Renderer
from raytrain_mnist.display import ACCURACY, COUNT, TEXT
from raytrain_mnist.driver import fitting
from raytrain_mnist.driver.fitting import FitResult
from raytrain_mnist.driver.runs import SUMMARY_FILE
from raytrain_mnist.errors import EXIT_FAILURE, UserError


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist fit",
        description="Train the MNIST ConvNet data-parallel on a Ray cluster (or a local Ray).",
        epilog="To resume a stopped or failed run, run the same command again: it continues "
        "from the last committed checkpoint (the stop line and 'raytrain-mnist runs show "
        "NAME' print that command). --fresh trains a finished run again.",
    )
    add_json_arg(parser)
    add_recipe_arg(parser)
    add_dataclass_args(parser, TrainConfig, "training")
    add_dataclass_args(parser, RunSettings, "run", types={"num_workers": parse_workers})
    return parser


def parse_config(argv: Sequence[str] | None = None) -> FitConfig:
    # argparse keeps a value already in the namespace: None marks "--epochs not given".
    given = argparse.Namespace(epochs=None, num_workers=None)
    args = parse_with_recipe(build_parser(), argv, given)
    auto_epochs, auto_workers = args.epochs is None, args.num_workers is None
    if auto_epochs:
        args.epochs = RECIPES[args.recipe]["epochs"]
    if auto_workers:
        args.num_workers = RunSettings().scaling.num_workers
    return FitConfig(
        train=dataclass_from_args(TrainConfig, args),
        run=dataclass_from_args(RunSettings, args),
        auto_epochs=auto_epochs,
        recipe=args.recipe,
        auto_workers=auto_workers,
    )


def resume_command(cfg: FitConfig, name: str) -> str:
    """The command that continues this run, as this process was started (never --fresh)."""
    return fitting.resume_command(cfg, name, invocation("fit"))


def fit_and_show(cfg: FitConfig) -> FitResult:
    """The library's fit, shown on stdout as the command shows it: the run's events as they
    come, then the summary (or the line of a run that had finished before)."""
    renderer = Renderer(cfg.run.output.progress)
    try:
        result = fitting.fit(
            cfg,
            renderer,
            invocation=invocation("fit"),
            poll_s=renderer.poll_s,
            started_at=fitting.process_started_at(),
        )
    finally:
        renderer.close()
    if result.already_finished:
        s = result.summary  # as the run's summary.json holds it: shown, never trusted
        print(
            f"run '{TEXT(s.get('name'))}' already finished: val_accuracy "
            f"{ACCURACY(s.get('val_accuracy'))} after {COUNT(s.get('epochs_completed'))} "
            f"epoch(s); see {printable(result.run_dir, lines=False)}/{SUMMARY_FILE}. "
            "Add --fresh to train it again."
        )
    else:
        print_summary(result.summary)
    return result


def print_summary(s: dict) -> None:
    if s["history"]:
        print(
            f"\n{'epoch':>5} {'train_loss':>10} {'val_loss':>9} {'val_acc':>8} "
            f"{'img/s':>8} {'time_s':>7}"
        )
        for h in s["history"]:
            print(
                f"{h['epoch']:>5} {h['train_loss']:>10.4f} {h['val_loss']:>9.4f} "
                f"{100 * h['val_accuracy']:>7.2f}% {h['images_per_s']:>8.0f} "
                f"{h['epoch_time_s']:>7.1f}"
            )
    if s["val_accuracy"] is not None:
        print(
            f"\nval_accuracy {100 * s['val_accuracy']:.2f}% on {s['val_total']} test images "
            f"({s['dataset']}), best {100 * s['best_val_accuracy']:.2f}%, "
            f"{s['wall_time_s']:.0f} s wall"
        )
    print(f"best checkpoint: {s['best_checkpoint']}")
    print(f"run directory:   {s['run_dir']}")


def run(cfg: FitConfig) -> int:
    setup_logging()
    result = fit_and_show(cfg)
    emit_result(result.summary)  # --json: summary.json's fields
    if result.status == "failed":
        logs = f" (worker logs: {result.worker_logs})" if result.worker_logs else ""
        raise UserError(
            f"training failed: {result.error}; resume with: {result.resume_command}{logs}",
            EXIT_FAILURE,
        )
    if result.status == "interrupted":
        print(
            f"interrupted after {result.summary['epochs_completed']} epoch(s); resume with: "
            f"{result.resume_command}",
            file=sys.stderr,
        )
        return interrupted()  # 130 after Ctrl-C, 143 after SIGTERM
    return 0


COMMAND = Command("fit", build_parser, parse_config, run, json=True)
cli = COMMAND.main


if __name__ == "__main__":
    exit_now(COMMAND.main())
