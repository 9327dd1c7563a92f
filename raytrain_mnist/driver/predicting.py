"""Classify image files with a checkpoint, in this process: no Ray. Library code: it never
prints.

:func:`predict_files` takes RUN_DIR_OR_CHECKPOINT (:func:`~.targets.resolve_target`) and
files or directories of PNG and JPEG images (any size, grayscale or colour, dark on light or
light on dark: made MNIST-like by the very function ``serve`` uses on its PNGs,
:func:`raytrain_mnist.serving.images.png_to_mnist`) and IDX image files (MNIST's
``*-images-idx3-ubyte[.gz]``, 28x28 pixels taken as they are). The model runs on batches of
images as ``serve``'s replicas run it (the checkpoint's autocast, softmax of the logits). A
file that cannot be read is one :class:`Unreadable` line; the others are still classified.

Only regular files are read (a FIFO, a socket or a device named on the command line is an
:class:`Unreadable` line, never opened for a read that could block or never end), and what
one call may cost is bounded before it is spent: the files it reads
(:data:`MAX_IMAGES`), the bytes of each (:data:`MAX_FILE_BYTES`) and of all together
(:data:`MAX_CALL_BYTES`), the images it classifies (:data:`MAX_IMAGES`, an IDX file's count
read from its header) and the pixels its PNGs and JPEGs declare (:data:`MAX_CALL_PIXELS`).
A file past a budget is an :class:`Unreadable` line saying which; the files before it are
classified. The ``source`` of a result is the file's name made valid text (bytes that are
not UTF-8 written ``\\xff``), so a record is always strict JSON and printable.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from raytrain_mnist.driver.targets import resolve_target
from raytrain_mnist.errors import EXIT_USAGE, UserError, first_line
from raytrain_mnist.serving.images import (
    MAX_PNG_PIXELS,
    SIDE,
    BadRequest,
    lean_png,
    png_size,
    png_to_mnist,
)

#: Images per forward pass.
BATCH_SIZE = 256
#: The largest file read: an IDX file of MNIST's 60,000 training images is 47 MB.
MAX_FILE_BYTES = 64 * 2**20
#: The images one call classifies (and so the files it reads): MNIST's 70,000, its training
#: and test files together. Each is held as 28x28 bytes and a line of output until the end.
MAX_IMAGES = 70_000
#: The bytes one call reads, all files together: MNIST's four image files several times over.
MAX_CALL_BYTES = 4 * MAX_FILE_BYTES
#: The pixels one call's PNGs and JPEGs declare, all together: each is decoded in full, so
#: this bounds the time a call spends decoding (16 of the largest PNG serve takes, a few
#: seconds on one core).
MAX_CALL_PIXELS = 16 * MAX_PNG_PIXELS
#: The formats of the image files read (PIL's names), besides IDX.
IMAGE_FORMATS = ("PNG", "JPEG")
_IDX_IMAGES = 0x0803
_IDX_LABELS = 0x0801
_IDX_HEADER = 16
#: What a file that is not a regular file is, as an error says it.
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


@dataclass(frozen=True, slots=True)
class Prediction:
    """One image: where it came from (a file, or ``FILE[i]`` in an IDX file), the label
    predicted, the ten probabilities and the ``top_k`` most likely labels."""

    source: str
    label: int
    probabilities: list[float]
    top_k: list[dict]  # {"label", "probability"}, most likely first

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "label": self.label,
            "probabilities": self.probabilities,
            "top_k": self.top_k,
        }


@dataclass(frozen=True, slots=True)
class Unreadable:
    source: str
    error: str  # one line

    def to_dict(self) -> dict:
        return {"source": self.source, "error": self.error}


@dataclass(frozen=True)
class PredictResult:
    checkpoint: str
    predictions: list[Prediction]
    errors: list[Unreadable] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "checkpoint": self.checkpoint,
            "predictions": [p.to_dict() for p in self.predictions],
            "errors": [e.to_dict() for e in self.errors],
        }


def shown(path: str | os.PathLike) -> str:
    """A file name as valid text: bytes that are not UTF-8 (a name Python holds with
    surrogate escapes) written ``\\xff``. Control characters stay: JSON escapes them, and
    the command escapes them for the terminal."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def predict_files(target: str, paths: list[str], top_k: int = 3) -> PredictResult:
    """Classify the images in ``paths`` (files, or directories: every regular file in them,
    sorted, recursively, hidden ones left out) with the checkpoint ``target`` names.
    :class:`UserError` when the checkpoint is unusable (its weights not finite included),
    a path names nothing or more files than one call reads."""
    if not 1 <= top_k <= 10:
        raise UserError(f"--top-k must be from 1 to 10, got {top_k}", EXIT_USAGE)
    files = _expand(paths)
    resolved = resolve_target(target)
    # serve's loading: a checkpoint whose weights are NaN or inf is refused in one line, as
    # every answer of its model would be NaN.
    from raytrain_mnist.driver.deployment import load_servable

    state, model = load_servable(resolved.checkpoint)
    images, sources, errors = read_images(files)
    amp = (state.get("config") or {}).get("amp", "off")
    probabilities = classify(model, images, amp)
    predictions = []
    for source, p in zip(sources, probabilities, strict=True):
        if not np.isfinite(p).all():  # finite weights can still overflow to inf
            errors.append(
                Unreadable(source, "the model's output for it is not finite (NaN or inf)")
            )
            continue
        order = np.argsort(-p, kind="stable")[:top_k]
        predictions.append(
            Prediction(
                source,
                int(order[0]),
                [round(float(x), 6) for x in p],
                [{"label": int(k), "probability": round(float(p[k]), 6)} for k in order],
            )
        )
    return PredictResult(shown(resolved.checkpoint), predictions, errors)


def _expand(paths: list[str]) -> list[Path]:
    """The files ``paths`` name, directories walked (without following their links to
    directories): at most :data:`MAX_IMAGES`, counted as they are found."""
    files: list[Path] = []
    for text in paths:
        path = Path(text).expanduser()
        if path.is_dir():
            found = _walk(path, MAX_IMAGES - len(files))
            if not found:
                raise UserError(f"{shown(path)} holds no files", EXIT_USAGE)
            files += found
        elif os.path.lexists(path):  # a dangling or looping link is read, and says why
            files.append(path)
        else:
            raise UserError(f"{shown(path)} does not exist", EXIT_USAGE)
        if len(files) > MAX_IMAGES:
            raise UserError(
                f"more than {MAX_IMAGES} files given; one call classifies at most "
                f"{MAX_IMAGES} images: split them over several calls",
                EXIT_USAGE,
            )
    return files


def _walk(directory: Path, room: int) -> list[Path]:
    """The regular files under ``directory``, sorted; hidden files and directories left
    out; the walk stops once it has found more than ``room``."""
    found: list[Path] = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            path = Path(root, name)
            if not name.startswith(".") and path.is_file():
                found.append(path)
                if len(found) > room:
                    return found
    return sorted(found)


class _Budget:
    """What one call may still read and decode; a file past it is refused before it is."""

    def __init__(self) -> None:
        self.images, self.bytes, self.pixels = MAX_IMAGES, MAX_CALL_BYTES, MAX_CALL_PIXELS

    def read(self, size: int) -> None:
        if size > MAX_FILE_BYTES:
            raise ValueError(
                f"is {size} bytes, more than the {MAX_FILE_BYTES} an image file may be"
            )
        self.bytes = _spend(self.bytes, size, MAX_CALL_BYTES, "is {} bytes", "bytes read")

    def classify(self, count: int) -> None:
        self.images = _spend(self.images, count, MAX_IMAGES, "holds {} images", "images")

    def decode(self, pixels: int) -> None:
        self.pixels = _spend(self.pixels, pixels, MAX_CALL_PIXELS, "declares {} pixels", "pixels")


def _spend(left: int, cost: int, whole: int, what: str, unit: str) -> int:
    if cost > whole:
        raise ValueError(f"{what.format(cost)}, more than one call's budget of {whole} {unit}")
    if cost > left:
        raise ValueError(
            f"{what.format(cost)}, past what is left of this call's budget of {whole} {unit} "
            f"({left}): classify it in another call"
        )
    return left - cost


def read_images(files: list[Path]) -> tuple[np.ndarray, list[str], list[Unreadable]]:
    """The images of ``files`` as uint8 ``(N, 28, 28)`` MNIST-like digits, where each came
    from, and the files that could not be read (one line each)."""
    batches, sources, errors = [], [], []
    budget = _Budget()
    for path in files:
        try:
            images = _read_file(path, budget)
        except (BadRequest, ValueError, OSError, EOFError, zlib.error) as exc:
            errors.append(Unreadable(shown(path), _reason(exc)))
            continue
        batches.append(images)
        name = shown(path)
        sources += [name] if images.ndim == 2 else [f"{name}[{i}]" for i in range(len(images))]
    if not batches:
        return np.empty((0, SIDE, SIDE), dtype=np.uint8), sources, errors
    return np.concatenate([b.reshape(-1, SIDE, SIDE) for b in batches]), sources, errors


def _reason(exc: Exception) -> str:
    text = first_line(exc)
    if isinstance(exc, BadRequest):
        text = text.removeprefix("image 0 ").replace("readable PNG", "readable PNG or JPEG")
    elif isinstance(exc, EOFError | zlib.error):
        text = f"is a truncated or damaged gzip file ({text})"
    elif isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
    return text


def _open_regular(path: Path) -> io.BufferedReader:
    """``path`` opened for reading if it is a regular file (through links), else ValueError.
    Checked before the open, so that no device or FIFO is opened at all, and again on what
    was opened (it may have been swapped since), opened without blocking: a FIFO's open
    would wait for a writer."""
    _check_regular(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        _check_regular(os.fstat(fd).st_mode)
        return open(fd, "rb")  # noqa: SIM115 - the caller closes it
    except BaseException:
        os.close(fd)
        raise


def _check_regular(mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "a special file")
        raise ValueError(f"is {kind}, not a regular file")


def _read_file(path: Path, budget: _Budget) -> np.ndarray:
    """One file's images: ``(28, 28)`` for a PNG or JPEG, ``(N, 28, 28)`` for an IDX file."""
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        budget.read(size)
        head = f.read(min(_IDX_HEADER, size))  # a kernel's file says 0 bytes: read none here
        if head[:2] == b"\x1f\x8b":  # a gzipped IDX file, as MNIST ships them
            raw = head + _read_at_most(f, size - len(head))
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as unpacked:
                return _idx_images(unpacked, unpacked.read(_IDX_HEADER), None, budget)
        if head[:2] == b"\x00\x00" and len(head) >= 4:
            return _idx_images(f, head, size, budget)
        data = lean_png(head + _read_at_most(f, size - len(head)))
        budget.classify(1)
        width, height = png_size(data, 0, IMAGE_FORMATS)
        budget.decode(width * height)
        return png_to_mnist(data, 0, IMAGE_FORMATS)


def _read_at_most(f, size: int) -> bytes:
    """The next ``size`` bytes of a file, all that ``fstat`` said it holds from here; one
    that holds more (it grew since, or is a kernel's file that says 0 bytes) is refused
    rather than read on."""
    data = f.read(size + 1)
    if len(data) > size:
        raise ValueError("holds more than its size says (it grew, or is not a plain file)")
    return data


def _idx_images(f, head: bytes, size: int | None, budget: _Budget) -> np.ndarray:
    """MNIST's image files: magic 0x00000803, a count, 28 rows, 28 columns, the pixels,
    read straight into the array (``size``: the file's, None when it is unpacked as read).
    The count is checked against the budget before a pixel is read."""
    if len(head) < _IDX_HEADER:
        raise ValueError("is not a PNG, JPEG or IDX image file (too short)")
    magic, count, rows, cols = struct.unpack(">IIII", head)
    if magic == _IDX_LABELS:
        raise ValueError("is an IDX file of labels, not of images")
    if magic != _IDX_IMAGES:
        raise ValueError("is not a PNG, JPEG or IDX image file")
    if (rows, cols) != (SIDE, SIDE):
        raise ValueError(f"holds {rows}x{cols} images; IDX images must be {SIDE}x{SIDE}")
    expected = _IDX_HEADER + count * rows * cols
    if size is not None and size != expected:
        raise ValueError(f"is truncated or too long for its {count} images")
    if expected > MAX_FILE_BYTES:
        raise ValueError(f"unpacks to {expected} bytes, more than {MAX_FILE_BYTES}")
    budget.classify(count)
    images = np.empty((count, rows, cols), dtype=np.uint8)
    if _fill(f, memoryview(images).cast("B")) != images.size or f.read(1):
        raise ValueError(f"is truncated or too long for its {count} images")
    return images


def _fill(f, view: memoryview) -> int:
    """Read into ``view`` until it is full or the file ends; how many bytes were read."""
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            break
        done += got
    return done


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
