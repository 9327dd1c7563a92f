"""Export a checkpoint's model (:mod:`raytrain_mnist.nn.export`): :func:`export_checkpoint`
writes a ``torch.export`` program (``pt2``) or an ONNX model (``onnx``) and, beside it,
``FILE.json``: how an input is prepared (:data:`~raytrain_mnist.nn.export.PREPARATION`).
Before anything is kept, the exported model is run on a batch of test-like inputs and its
logits compared with the checkpoint's model (:data:`TOLERANCE`; logits that are not finite
fail it). Library code: it never prints.

Nothing is ever clobbered: both files are written to temporary files beside their names
and then published by a hard link, which fails on any name that exists (a file created
while the export ran, a dangling symlink); only ``overwrite`` publishes by a rename over
what is there. When ``FILE.json`` cannot be published, the model just published is taken
back, so the two are published together or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from raytrain_mnist.driver.deployment import load_servable
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
    if not overwrite:
        _refuse_existing(out, beside)
    if out.is_dir() or beside.is_dir() or not out.parent.is_dir():
        raise UserError(f"--output {out}: not a file in an existing directory", EXIT_USAGE)
    if fmt == "onnx":
        _need("onnxscript", "onnx")
    resolved = resolve_target(target)
    # serve's loading: weights that are NaN or inf are refused in one line, as the model
    # they make cannot be checked against the exported one.
    state, model = load_servable(resolved.checkpoint)
    record = {**export.PREPARATION, "format": fmt, "model": out.name}
    if fmt == "onnx":
        record["opset"] = export.ONNX_OPSET
    try:
        # The exporters' loaders go by the extension: the temporary file keeps the format's.
        with _temporary(out, f".{fmt}") as tmp, _temporary(beside) as tmp_beside:
            (export.save_program if fmt == "pt2" else export.save_onnx)(model, tmp)
            difference = verify_export(model, fmt, tmp)
            tmp_beside.write_bytes((json.dumps(record, indent=2) + "\n").encode())
            _sync(tmp, tmp_beside)
            publish(tmp, out, overwrite)
            try:
                publish(tmp_beside, beside, overwrite)
            except BaseException:
                _take_back(out, tmp)
                raise
    except OSError as exc:  # a full disk, a directory we may not write in: one line
        raise UserError(f"cannot write {out}: {exc.strerror or first_line(exc)}") from exc
    return Export(fmt, str(out), str(beside), resolved.checkpoint, state.get("epoch"), difference)


def _refuse_existing(*paths: Path) -> None:
    for path in paths:
        if os.path.lexists(path):  # a dangling symlink is there too
            raise UserError(f"{path} exists; pass --overwrite to replace it", EXIT_USAGE)


@contextlib.contextmanager
def _temporary(path: Path, suffix: str = ""):
    """A new empty file beside ``path`` (same directory, so a link or rename of it is one
    step), removed on the way out whatever happened."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{suffix}")
    os.close(fd)
    try:
        yield Path(tmp)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _sync(*paths: Path) -> None:
    """The files' bytes on disk before their names are: a crash never leaves a name on an
    empty file."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


#: What ``link`` says on a file system without hard links.
_NO_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK})


def publish(tmp: str | os.PathLike, target: Path, overwrite: bool = False) -> None:
    """Give the finished file ``tmp`` the name ``target`` in one step: with ``overwrite`` by
    a rename over whatever is there (a link is replaced, never written through); without it
    by a hard link, which fails if ``target`` exists in any form (UserError), so a file that
    appeared since it was checked is kept. Where the file system has no hard links, by a
    copy into a file created exclusively. ``tmp`` is left for its owner to remove."""
    if overwrite:
        os.replace(tmp, target)
        return
    try:
        try:
            os.link(tmp, target)
        except OSError as exc:
            if isinstance(exc, FileExistsError) or exc.errno not in _NO_LINKS:
                raise
            _copy_exclusive(tmp, target)
    except FileExistsError:
        raise UserError(
            f"{target} exists (it appeared while exporting); pass --overwrite to replace it",
            EXIT_USAGE,
        ) from None


def _copy_exclusive(tmp: str | os.PathLike, target: Path) -> None:
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with open(fd, "wb") as dst, open(tmp, "rb") as src:
            shutil.copyfileobj(src, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(target)
        raise


def _take_back(published: Path, tmp: Path) -> None:
    """Remove ``published`` if it is still the file published from ``tmp`` (whoever has
    replaced it since keeps theirs)."""
    with contextlib.suppress(OSError):
        if os.path.samestat(os.lstat(published), os.stat(tmp)):
            os.unlink(published)


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
    """The largest logit difference between the exported model and ``model``: NaN when
    either gives a logit that is not finite (so that no comparison with a tolerance passes)."""
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
    if np.shape(got) != expected.shape:
        raise UserError(
            f"the exported {fmt} model gives logits of shape {np.shape(got)}, not {expected.shape}"
        )
    if not (np.isfinite(got).all() and np.isfinite(expected).all()):
        return math.nan
    return float(np.abs(got - expected).max())


def verify_export(model, fmt: str, path: str | os.PathLike) -> float:
    """:func:`check_export`'s difference, or UserError when it is not finite or more than
    :data:`TOLERANCE` (a NaN compares false with anything: it is tested for first)."""
    difference = check_export(model, fmt, path)
    if not math.isfinite(difference):
        raise UserError(
            "the exported model's logits or the checkpoint's are not finite (NaN or inf), so "
            "they cannot be compared; nothing was written"
        )
    if difference > TOLERANCE:
        raise UserError(
            f"the exported model's logits differ from the checkpoint's by {difference:.2e} "
            f"(more than {TOLERANCE}); nothing was written"
        )
    return difference
