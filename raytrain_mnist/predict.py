"""``raytrain-mnist predict RUN_OR_CHECKPOINT FILE_OR_DIR...``: classify image files.

The command over :func:`raytrain_mnist.driver.predicting.predict_files`: in this process,
without Ray. PNG and JPEG files of any size are made MNIST-like exactly as ``serve`` makes
its PNGs; IDX image files are read as they are. A line per image (its most likely labels),
a line per file that could not be read (not a regular file, not an image, past what one call
may read: :mod:`raytrain_mnist.driver.predicting`) or image the model gives no finite
probabilities for; the exit status is 1 when there is any such line, 0 otherwise. Names are
escaped for the terminal; ``--json`` is strict JSON (never ``NaN``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from raytrain_mnist._cli import (
    ArgumentParser,
    Command,
    add_json_arg,
    add_target_argument,
    emit_result,
    exit_now,
    printable,
)
from raytrain_mnist.errors import EXIT_FAILURE


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist predict",
        description="Classify digit images with a checkpoint, in this process (no Ray): PNG "
        "or JPEG files of any size, grayscale or colour, dark on light or light on dark "
        "(prepared as serve prepares its images), and MNIST's IDX image files.",
    )
    add_target_argument(parser)
    parser.add_argument(
        "files",
        nargs="+",
        metavar="FILE_OR_DIR",
        help="image files, or directories of them (every file inside, sorted)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=3,
        metavar="K",
        help="how many of the most likely labels to show per image, 1-10 (default: 3)",
    )
    add_json_arg(parser)
    return parser


@dataclass(frozen=True)
class PredictOptions:
    target: str
    files: tuple[str, ...]
    top_k: int


def parse_options(argv: Sequence[str]) -> PredictOptions:
    args = build_parser().parse_args(argv)
    if not 1 <= args.top_k <= 10:
        build_parser().error(f"--top-k must be from 1 to 10, got {args.top_k}")
    return PredictOptions(args.target, tuple(args.files), args.top_k)


def run(options: PredictOptions) -> int:
    from raytrain_mnist.driver.predicting import predict_files

    outcome = predict_files(options.target, list(options.files), options.top_k)
    emit_result(outcome.to_dict())
    for p in outcome.predictions:
        likely = "  ".join(f"{t['label']} {100 * t['probability']:5.1f}%" for t in p.top_k)
        print(f"{printable(p.source, lines=False)}: {p.label}   ({likely})")
    for e in outcome.errors:
        print(
            f"raytrain-mnist: error: {printable(e.source, lines=False)}: "
            f"{printable(e.error, lines=False)}",
            file=sys.stderr,
        )
    if outcome.errors:
        print(
            f"{len(outcome.predictions)} image(s) classified, {len(outcome.errors)} file(s) "
            "or image(s) could not be",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    return 0


COMMAND = Command("predict", build_parser, parse_options, run, json=True)
cli = COMMAND.main


if __name__ == "__main__":
    exit_now(COMMAND.main())
