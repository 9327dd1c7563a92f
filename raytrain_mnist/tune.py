"""``python -m raytrain_mnist.tune``: a Ray Tune search over fit's trainer, from the command line.

The command over :func:`raytrain_mnist.driver.searching.search`: it parses the flags into a
:class:`TuneCommand` (the search space, how the search runs, the training and run settings),
renders the search's events as it runs (:class:`raytrain_mnist.console.TrialsTable`: a
table redrawn in place on a terminal, else a line when a trial starts and one when it ends),
then prints the trials ranked, the best one and the command that trains it again. How the
trials run and what the experiment directory holds: docs/design.md, "A search".
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from raytrain_mnist._cli import (
    ArgumentParser,
    Command,
    add_dataclass_args,
    add_json_arg,
    add_recipe_arg,
    command_line,
    dataclass_from_args,
    emit_result,
    exit_now,
    interrupted,
    invocation,
    parse_with_recipe,
    setup_logging,
)
from raytrain_mnist.config import RunSettings, TrainConfig, recipe_config
from raytrain_mnist.console import TrialsTable
from raytrain_mnist.driver.events import format_value
from raytrain_mnist.driver.runs import BEST_FILE
from raytrain_mnist.driver.searching import (
    INTERRUPTED,
    PLOT_FILE,
    RESULTS_FILE,
    SearchResult,
    search,
)
from raytrain_mnist.driver.searching.space import (
    SEARCH_SPACES,
    SearchSpace,
    TuneSettings,
    check_search,
    searchable,
)
from raytrain_mnist.errors import UserError

_UNSET = object()


@dataclass(frozen=True)
class TuneCommand:
    """Everything one search needs, parsed and checked: the arguments of ``search``."""

    space: SearchSpace
    settings: TuneSettings
    train: TrainConfig  # the values of every field that is not searched; epochs per trial
    run: RunSettings
    argv: tuple[str, ...] = ()  # as given, for the resume command
    auto_workers: bool = False  # --num-workers not given: a search on --service takes its count


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist tune",
        description="Search hyperparameters with Ray Tune; every trial is a data-parallel "
        "TorchTrainer run of fit's loop, or with --service a request to that warm service. "
        "Unsearched flags mean what they mean in fit.",
    )
    search = parser.add_argument_group("search space")
    search.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="fix a parameter for every trial, e.g. --set lr=0.05 (the same as --lr 0.05)",
    )
    search.add_argument(
        "--range",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="search a parameter over LOW:HIGH (floats; log-uniform for lr and weight_decay, "
        "uniform otherwise) or a list A,B,C, e.g. --range lr=1e-3:0.3 "
        "--range batch_size=64,128 --range schedule=onecycle,constant. Default space, by "
        "--recipe: "
        + " | ".join(
            f"{recipe}: " + "; ".join(f"{n} {p.describe()}" for n, p in space.items())
            for recipe, space in SEARCH_SPACES.items()
        ),
    )
    add_dataclass_args(parser, TuneSettings, "search")
    parser.add_argument_group("per trial").add_argument(
        "--max-epochs",
        dest="epochs",
        type=int,
        default=argparse.SUPPRESS,
        metavar="EPOCHS",
        help="epochs of every trial that is not stopped early (the same as --epochs)",
    )
    add_recipe_arg(parser)
    add_dataclass_args(parser, TrainConfig, "training (every trial, unless searched)")
    add_dataclass_args(parser, RunSettings, "run (as in fit; --name names the search)")
    add_json_arg(parser)
    return parser


def parse_command(argv: Sequence[str] | None = None) -> TuneCommand:
    # A searchable training flag given on the command line fixes that parameter; argparse
    # keeps a value already in the namespace, so the sentinel marks "not given".
    namespace = argparse.Namespace(**{name: _UNSET for name in searchable()}, num_workers=None)
    args = parse_with_recipe(build_parser(), argv, namespace)
    auto_workers = args.num_workers is None
    if auto_workers:
        args.num_workers = RunSettings().scaling.num_workers
    defaults = recipe_config(args.recipe)
    given = {n: getattr(args, n) for n in searchable() if getattr(args, n) is not _UNSET}
    for name in searchable():
        if getattr(args, name) is _UNSET:
            setattr(args, name, getattr(defaults, name))
    settings = dataclass_from_args(TuneSettings, args)
    train = dataclass_from_args(TrainConfig, args)
    run = dataclass_from_args(RunSettings, args)
    space = SearchSpace.from_cli(args.set, args.range, given, recipe=args.recipe)
    check_search(space, settings, train, run)
    given_argv = tuple(sys.argv[1:] if argv is None else argv)
    return TuneCommand(space, settings, train, run, given_argv, auto_workers)


def resume_command(cmd: TuneCommand, name: str) -> str:
    """The command that continues this search, as this process was started."""
    args = [a for a in cmd.argv if a != "--fresh"]
    if not cmd.run.storage.name:
        args += ["--name", name]
    return command_line([*invocation("tune"), *args])


def print_report(result: SearchResult, searched: Sequence[str]) -> None:
    """The trials ranked (a column per ``searched`` parameter), the best one, and what the
    experiment directory holds."""
    metric = result.metric
    header = (
        f"\n{'rank':>4}  {'trial':<11}"
        + "".join(f" {n:>12}" for n in searched)
        + f" {'best_acc':>9}"
        + (f" {'best_' + metric:>16}" if metric != "val_accuracy" else "")
        + f" {'epochs':>6}  status"
    )
    print(header)
    for t in result.trials:
        acc = t["best_val_accuracy"]
        line = (
            f"{t['rank']:>4}  {t['trial_id']:<11}"
            + "".join(f" {format_value(t['config'].get(n)):>12}" for n in searched)
            + (f" {100 * acc:>8.2f}%" if acc is not None else f" {'-':>9}")
        )
        if metric != "val_accuracy":
            value = t[f"best_{metric}"]
            line += f" {value:>16.4f}" if value is not None else f" {'-':>16}"
        print(f"{line} {t['epochs_run']:>6}  {t['status']}")
    if result.best_trial is None:
        print("\nno trial reported a result")
    else:
        print(
            f"\nbest trial {result.best_trial}: {metric} {result.best_metric:.4f} "
            f"at epoch {result.best_epoch}; {result.num_trials} trial(s), "
            f"{result.num_stopped_early} stopped early, {result.wall_time_s:.0f} s wall"
        )
        print(
            "best config:     "
            + ", ".join(f"{k}={format_value(v)}" for k, v in result.best_config.items())
        )
        print(f"best checkpoint: {result.best_checkpoint}")
        print(f"reproduce with:  {result.fit_command}")
    print(f"experiment:      {result.experiment_dir}  ({RESULTS_FILE}, {PLOT_FILE}, {BEST_FILE})")


def run(cmd: TuneCommand) -> int:
    setup_logging()
    table = TrialsTable(
        cmd.run.output.progress, cmd.space.searched, cmd.train.epochs, cmd.settings.metric
    )
    try:
        result = search(
            cmd.space,
            cmd.settings,
            cmd.train,
            cmd.run,
            on_event=table,
            fit_invocation=invocation("fit"),
            auto_workers=cmd.auto_workers,
        )
    finally:
        table.close()
    print_report(result, cmd.space.searched)
    emit_result({"status": result.status, **result.to_dict()})  # --json: best.json's fields
    if result.status == INTERRUPTED:
        print(
            f"search interrupted with {result.num_unfinished} trial(s) unfinished; "
            f"resume with: {resume_command(cmd, result.name)}",
            file=sys.stderr,
        )
        return interrupted()  # 130 after Ctrl-C, 143 after SIGTERM
    if result.num_errors:
        raise UserError(
            f"{result.num_errors} trial(s) failed (see the table); rerun the "
            f"same command to retry them: {resume_command(cmd, result.name)}"
        )
    return 0


COMMAND = Command("tune", build_parser, parse_command, run, json=True)
cli = COMMAND.main


if __name__ == "__main__":
    exit_now(COMMAND.main())
