"""``raytrain-mnist export RUN_OR_CHECKPOINT --format pt2|onnx --output FILE``.

The command over :func:`raytrain_mnist.driver.exporting.export_checkpoint`: the checkpoint's
model as a ``torch.export`` program (``torch.export.load`` reads it) or an ONNX model
(onnxruntime runs it; the ``export`` extra), both taking float32 ``N x 1 x 28 x 28`` images
prepared as the training data is, with that preparation in ``FILE.json`` beside it.
"""

from __future__ import annotations

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
    setup_logging,
)
from raytrain_mnist.display import COUNT

FORMATS = ("pt2", "onnx")  # raytrain_mnist.nn.export.FORMATS, without importing torch


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist export",
        description="Export a checkpoint's model for another runtime: a torch.export "
        "program (pt2, saved with torch.export.save) or an ONNX model (dynamic batch, "
        "opset 18); input float32 N x 1 x 28 x 28, prepared as the training data is "
        "(written beside it as FILE.json).",
    )
    add_target_argument(parser)
    parser.add_argument("--format", required=True, choices=FORMATS, help="pt2 or onnx")
    parser.add_argument("--output", required=True, metavar="FILE", help="the file to write")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace FILE if it exists (default: refuse)"
    )
    add_json_arg(parser)
    return parser


@dataclass(frozen=True)
class ExportOptions:
    target: str
    format: str
    output: str
    overwrite: bool


def parse_options(argv: Sequence[str]) -> ExportOptions:
    args = build_parser().parse_args(argv)
    return ExportOptions(args.target, args.format, args.output, args.overwrite)


def run(options: ExportOptions) -> int:
    from raytrain_mnist.driver.exporting import export_checkpoint

    setup_logging()
    done = export_checkpoint(options.target, options.format, options.output, options.overwrite)
    emit_result(done.to_dict())
    # The checkpoint's epoch is as it stored it: shown through the renderer of stored values.
    print(f"checkpoint: {printable(done.checkpoint, lines=False)} (epoch {COUNT(done.epoch)})")
    print(
        f"wrote {done.output} ({done.format}; its logits within "
        f"{done.max_logit_difference:.1e} of the checkpoint's) and {done.preparation} "
        "(how inputs are prepared)"
    )
    return 0


COMMAND = Command("export", build_parser, parse_options, run, json=True)
cli = COMMAND.main


if __name__ == "__main__":
    exit_now(COMMAND.main())
