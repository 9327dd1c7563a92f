"""``python -m raytrain_mnist.evaluate RUN_DIR_OR_CHECKPOINT``: score a checkpoint on the test set.

The command over :func:`raytrain_mnist.driver.evaluation.evaluate_checkpoint`: it parses the
flags into :class:`EvaluateOptions`, runs the evaluation and prints the report (accuracy per
class, where the files went). What the target may be, which test set is used and what is
written (``evaluation.json``, ``confusion_matrix.png``, ``misclassified.png``) is said in
:mod:`raytrain_mnist.driver.targets` and :mod:`raytrain_mnist.driver.evaluation`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from raytrain_mnist._cli import (
    ArgumentParser,
    Command,
    add_dataclass_args,
    add_json_arg,
    add_target_argument,
    dataclass_from_args,
    emit_result,
    exit_now,
    printable,
    setup_logging,
)
from raytrain_mnist.config import DATASET_CHOICES, RunSettings
from raytrain_mnist.display import ACCURACY, COUNT
from raytrain_mnist.driver.evaluation import WORKER_SETTINGS, Evaluation, evaluate_checkpoint


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist evaluate",
        description="Score a checkpoint on the MNIST test set: accuracy per class, a confusion "
        "matrix and the most confidently wrong digits.",
    )
    add_target_argument(parser)
    parser.add_argument(
        "--data-dir",
        help="MNIST in torchvision's layout; default: the directory the run trained with",
    )
    parser.add_argument(
        "--dataset",
        choices=DATASET_CHOICES,
        help="default: the data set the run trained on (must match when the "
        "run is known), else auto",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="where to write evaluation.json and the "
        "PNGs (default: evaluation_<checkpoint>/ beside the checkpoint)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an evaluation already in --out (default: refuse)",
    )
    add_dataclass_args(
        parser,
        RunSettings,
        "scoring on Ray Train workers (when --num-workers > 1 or --address is given)",
        only=WORKER_SETTINGS,
        defaults={"num_workers": 1},
        helps=WORKER_HELP,
    )
    add_json_arg(parser)
    return parser


#: evaluate's own words for the worker flags it shares with fit.
WORKER_HELP = {
    "num_workers": "score on this many Ray Train workers, each an exact shard of the test "
    "set; 1 scores in this process, without Ray",
    "use_gpu": "score on a GPU: this process's with one worker, one per worker otherwise",
    "gpus_per_worker": "GPUs per scoring worker with --use-gpu: a fraction such as 0.5 "
    "shares one GPU between workers",
    "cpus_per_worker": "CPUs (and torch threads) per scoring worker; default: this machine's "
    "cores / workers on a local Ray, 1 on a cluster",
    "backend": "process-group backend of the scoring workers: auto = NCCL with a GPU per "
    "worker, else Gloo",
    "init_method": "process-group initialisation of the scoring workers: env:// or tcp://host:port",
    "address": "Ray cluster to score on (host:port or auto); default with --num-workers > 1: "
    "$RAY_ADDRESS, else a local Ray",
    "placement_strategy": "how the scoring workers are placed on nodes (PACK, SPREAD, "
    "STRICT_SPREAD)",
    "socket_ifname": "network interface for the scoring workers' Gloo/NCCL traffic",
}


@dataclass(frozen=True)
class EvaluateOptions:
    """``evaluate``'s flags, parsed and checked: the arguments of ``evaluate_checkpoint``."""

    target: str
    data_dir: str | None
    dataset: str | None
    out: str | None
    overwrite: bool
    workers: RunSettings


def parse_options(argv: Sequence[str]) -> EvaluateOptions:
    args = build_parser().parse_args(argv)
    if args.address is None and args.num_workers > 1:
        args.address = os.environ.get("RAY_ADDRESS") or None
    workers = dataclass_from_args(RunSettings, args, only=WORKER_SETTINGS)
    return EvaluateOptions(
        args.target, args.data_dir, args.dataset, args.out, args.overwrite, workers
    )


def format_report(evaluation: Evaluation) -> str:
    """The evaluation as ``evaluate`` prints it: the checkpoint, the test set, the accuracy
    (beside what fit reported for that epoch), accuracy per digit, the files written."""
    e = evaluation  # the checkpoint's epoch and history, the data's name: from storage
    lines = [
        f"checkpoint: {printable(e.checkpoint, lines=False)} (epoch {COUNT(e.epoch)})",
        f"test set:   {e.test_size} images, {printable(e.data_source, lines=False)}",
        f"accuracy {100 * e.accuracy:.2f}% ({e.correct}/{e.test_size}), loss {e.loss:.4f}"
        + (
            ""
            if e.reported_val_accuracy is None
            else f"; fit reported {ACCURACY(e.reported_val_accuracy)} for this epoch"
        ),
        "",
        f"{'digit':>5} {'accuracy':>9} {'images':>7}",
    ]
    for digit, accuracy in e.per_class_accuracy.items():
        shown = "-" if accuracy is None else f"{100 * accuracy:.2f}%"
        lines.append(f"{digit:>5} {shown:>9} {e.per_class_size[digit]:>7}")
    lines += [
        "",
        f"wrote {', '.join(f.name for f in e.files)} into {printable(e.out, lines=False)}",
    ]
    return "\n".join(lines)


def run(options: EvaluateOptions) -> int:
    setup_logging()
    evaluation = evaluate_checkpoint(
        options.target,
        data_dir=options.data_dir,
        dataset=options.dataset,
        out=options.out,
        overwrite=options.overwrite,
        workers=options.workers,
    )
    emit_result(evaluation.to_dict())  # --json: evaluation.json's fields
    print(format_report(evaluation))
    return 0


COMMAND = Command("evaluate", build_parser, parse_options, run, json=True)
cli = COMMAND.main


if __name__ == "__main__":
    exit_now(COMMAND.main())
