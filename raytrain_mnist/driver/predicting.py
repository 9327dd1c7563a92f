"""Classify image files with a checkpoint, in this process: no Ray. Library code: it never
prints.

:func:`predict_files` takes RUN_DIR_OR_CHECKPOINT (:func:`~.targets.resolve_target`) and
files or directories of PNG and JPEG images (any size, grayscale or colour, dark on light or
light on dark: made MNIST-like by the very function ``serve`` uses on its PNGs,
:func:`raytrain_mnist.serving.images.png_to_mnist`) and IDX image files (MNIST's
``*-images-idx3-ubyte[.gz]``, 28x28 pixels taken as they are). The model runs on batches of
images as ``serve``'s replicas run it (the checkpoint's autocast, softmax of the logits). A
file that cannot be read is one :class:`Unreadable` line; the others are still classified.
"""

from __future__ import annotations

import gzip
import io
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from raytrain_mnist.driver.targets import resolve_target
from raytrain_mnist.errors import EXIT_USAGE, UserError, first_line
from raytrain_mnist.serving.images import SIDE, BadRequest, png_to_mnist

#: Images per forward pass.
BATCH_SIZE = 256
#: The largest file read: an IDX file of MNIST's 60,000 training images is 47 MB.
MAX_FILE_BYTES = 64 * 2**20
#: The formats of the image files read (PIL's names), besides IDX.
IMAGE_FORMATS = ("PNG", "JPEG")
_IDX_IMAGES = 0x0803
_IDX_LABELS = 0x0801


@dataclass(frozen=True)
class Prediction:
    """One image: where it came from (a file, or ``FILE[i]`` in an IDX file), the label
    predicted, the ten probabilities and the ``top_k`` most likely labels."""

    source: str
    label: int
    probabilities: list[float]
    top_k: list[dict]  # {"label", "probability"}, most likely first


@dataclass(frozen=True)
class Unreadable:
    source: str
    error: str  # one line


@dataclass(frozen=True)
class PredictResult:
    checkpoint: str
    predictions: list[Prediction]
    errors: list[Unreadable] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "checkpoint": self.checkpoint,
            "predictions": [p.__dict__ for p in self.predictions],
            "errors": [e.__dict__ for e in self.errors],
        }


def predict_files(target: str, paths: list[str], top_k: int = 3) -> PredictResult:
    """Classify the images in ``paths`` (files, or directories: every file in them, sorted,
    recursively) with the checkpoint ``target`` names. :class:`UserError` when the
    checkpoint is unusable or no path names a file."""
    if not 1 <= top_k <= 10:
        raise UserError(f"--top-k must be from 1 to 10, got {top_k}", EXIT_USAGE)
    files = list(_expand(paths))
    resolved = resolve_target(target)
    from raytrain_mnist.driver.evaluation import load_checkpoint

    state, model = load_checkpoint(resolved.checkpoint)
    images, sources, errors = read_images(files)
    amp = (state.get("config") or {}).get("amp", "off")
    probabilities = classify(model, images, amp)
    predictions = []
    for source, p in zip(sources, probabilities, strict=True):
        order = np.argsort(-p, kind="stable")[:top_k]
        predictions.append(
            Prediction(
                source,
                int(order[0]),
                [round(float(x), 6) for x in p],
                [{"label": int(k), "probability": round(float(p[k]), 6)} for k in order],
            )
        )
    return PredictResult(resolved.checkpoint, predictions, errors)


def _expand(paths: list[str]):
    for text in paths:
        path = Path(text).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
            if not found:
                raise UserError(f"{path} holds no files", EXIT_USAGE)
            yield from found
        elif path.exists():
            yield path
        else:
            raise UserError(f"{path} does not exist", EXIT_USAGE)


def read_images(files: list[Path]) -> tuple[np.ndarray, list[str], list[Unreadable]]:
    """The images of ``files`` as uint8 ``(N, 28, 28)`` MNIST-like digits, where each came
    from, and the files that could not be read (one line each)."""
    batches, sources, errors = [], [], []
    for path in files:
        try:
            images, names = _read_file(path)
        except (BadRequest, ValueError, OSError) as exc:
            errors.append(Unreadable(str(path), _reason(exc)))
            continue
        batches.append(images)
        sources += names
    if not batches:
        return np.empty((0, SIDE, SIDE), dtype=np.uint8), sources, errors
    return np.concatenate(batches), sources, errors


def _reason(exc: Exception) -> str:
    text = first_line(exc)
    if isinstance(exc, BadRequest):
        text = text.removeprefix("image 0 ").replace("readable PNG", "readable PNG or JPEG")
    elif isinstance(exc, OSError):
        text = exc.strerror or text
    return text


def _read_file(path: Path) -> tuple[np.ndarray, list[str]]:
    size = os.path.getsize(path)
    if size > MAX_FILE_BYTES:
        raise ValueError(f"is {size} bytes, more than the {MAX_FILE_BYTES} an image file may be")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # a gzipped IDX file, as MNIST ships them
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            raise ValueError(f"unpacks to more than {MAX_FILE_BYTES} bytes")
        return _idx_images(raw, path)
    if raw[:2] == b"\x00\x00" and len(raw) >= 4:
        return _idx_images(raw, path)
    return png_to_mnist(raw, 0, IMAGE_FORMATS)[None], [str(path)]


def _idx_images(raw: bytes, path: Path) -> tuple[np.ndarray, list[str]]:
    """MNIST's image files: magic 0x00000803, a count, 28 rows, 28 columns, the pixels."""
    if len(raw) < 16:
        raise ValueError("is not a PNG, JPEG or IDX image file (too short)")
    magic, count, rows, cols = struct.unpack(">IIII", raw[:16])
    if magic == _IDX_LABELS:
        raise ValueError("is an IDX file of labels, not of images")
    if magic != _IDX_IMAGES:
        raise ValueError("is not a PNG, JPEG or IDX image file")
    if (rows, cols) != (SIDE, SIDE):
        raise ValueError(f"holds {rows}x{cols} images; IDX images must be {SIDE}x{SIDE}")
    if len(raw) != 16 + count * rows * cols:
        raise ValueError(f"is truncated or too long for its {count} images")
    images = np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(count, rows, cols)
    return images, [f"{path}[{i}]" for i in range(count)]


def classify(model, images: np.ndarray, amp: str = "off") -> np.ndarray:
    """The probabilities ``(N, 10)`` of uint8 images ``(N, 28, 28)``, on this process's CPU,
    in batches of :data:`BATCH_SIZE`: the forward pass of ``serve``'s replicas (the
    checkpoint's autocast, fp16 being a GPU feature; the softmax of float32 logits)."""
    import torch

    from raytrain_mnist.nn.model import normalize
    from raytrain_mnist.nn.optim import amp_context

    model.eval()
    device = torch.device("cpu")
    autocast = amp_context("off" if amp == "fp16" else amp, device)
    out = []
    with torch.inference_mode():
        for start in range(0, len(images), BATCH_SIZE):
            chunk = torch.from_numpy(np.ascontiguousarray(images[start : start + BATCH_SIZE]))
            with autocast:
                logits = model(normalize(chunk)).float()
            out.append(logits.softmax(1).numpy())
    return np.concatenate(out) if out else np.empty((0, 10), dtype=np.float32)
