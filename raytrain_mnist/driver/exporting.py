"""Export a checkpoint's model (:mod:`raytrain_mnist.nn.export`): :func:`export_checkpoint`
writes a ``torch.export`` program (``pt2``) or an ONNX model (``onnx``) and, beside it,
``FILE.json``: how an input is prepared (:data:`~raytrain_mnist.nn.export.PREPARATION`).
Before anything is kept, the exported model is run on a batch of test-like inputs and its
logits compared with the checkpoint's model (:data:`TOLERANCE`). Library code: it never
prints.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from raytrain_mnist.driver.evaluation import load_checkpoint
from raytrain_mnist.driver.runs.storage import atomic_write
from raytrain_mnist.driver.targets import resolve_target
from raytrain_mnist.errors import EXIT_USAGE, UserError, first_line

logger = logging.getLogger(__name__)

#: The largest difference in any logit between the exported model and the checkpoint's.
TOLERANCE = 1e-4
#: Why the export extra is needed, as the error says it.
_EXTRA = "pip install 'raytrain-mnist[export]' (or: pip install -e '.[export]')"


@dataclass(frozen=True)
class Export:
    format: str
    output: str
    preparation: str  # the JSON file beside it
    checkpoint: str
    epoch: int | None
    max_logit_difference: float  # on the check batch

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def preparation_path(output: str | os.PathLike) -> Path:
    return Path(f"{output}.json")


def export_checkpoint(target: str, fmt: str, output: str, overwrite: bool = False) -> Export:
    """Export the model of the checkpoint ``target`` names (RUN_DIR_OR_CHECKPOINT) to the
    local file ``output``; :class:`UserError` in one line for a bad target, an output that
    exists (without ``overwrite``) or a missing exporter."""
    from raytrain_mnist.nn import export

    if fmt not in export.FORMATS:
        raise UserError(f"--format must be one of {', '.join(export.FORMATS)}", EXIT_USAGE)
    out = Path(output).expanduser()
    beside = preparation_path(out)
    if not overwrite and (out.exists() or beside.exists()):
        existing = out if out.exists() else beside
        raise UserError(f"{existing} exists; pass --overwrite to replace it", EXIT_USAGE)
    if out.is_dir() or not out.parent.is_dir():
        raise UserError(f"--output {out}: not a file in an existing directory", EXIT_USAGE)
    if fmt == "onnx":
        _need("onnxscript", "onnx")
    resolved = resolve_target(target)
    state, model = load_checkpoint(resolved.checkpoint)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        (export.save_program if fmt == "pt2" else export.save_onnx)(model, tmp)
        difference = check_export(model, fmt, tmp)
        if difference > TOLERANCE:
            raise UserError(
                f"the exported model's logits differ from the checkpoint's by {difference:.2e} "
                f"(more than {TOLERANCE}); nothing was written"
            )
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    record = {**export.PREPARATION, "format": fmt, "model": out.name}
    if fmt == "onnx":
        record["opset"] = export.ONNX_OPSET
    atomic_write(beside, (json.dumps(record, indent=2) + "\n").encode())
    return Export(fmt, str(out), str(beside), resolved.checkpoint, state.get("epoch"), difference)


def _need(*modules: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"--format onnx needs {', '.join(missing)}: {_EXTRA}")


def check_batch(n: int = 64):
    """Inputs as training prepares them: normalised random pixels (a fixed seed)."""
    import torch

    from raytrain_mnist.nn.model import normalize

    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=generator)
    return normalize(pixels)


def run_export(fmt: str, path: str | os.PathLike, images):
    """The logits of the exported model at ``path`` for float ``images`` (N, 1, 28, 28), as
    numpy: the loaded ``torch.export`` program, or onnxruntime on CPU."""
    if fmt == "pt2":
        import torch

        program = torch.export.load(str(path)).module()
        with torch.no_grad():
            return program(images).numpy()
    try:
        import onnxruntime
    except ImportError as exc:
        raise UserError(f"checking the ONNX model needs onnxruntime: {_EXTRA}") from exc
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"images": images.numpy()})[0]


def check_export(model, fmt: str, path: str | os.PathLike) -> float:
    """The largest logit difference between the exported model and ``model``."""
    import numpy as np
    import torch

    images = check_batch()
    with torch.no_grad():
        expected = model.eval()(images).numpy()
    try:
        got = run_export(fmt, path, images)
    except UserError:
        raise
    except Exception as exc:  # a file the runtime cannot load: the exporter's fault, one line
        raise UserError(f"the exported {fmt} model does not run: {first_line(exc)}") from exc
    return float(np.abs(got - expected).max())
