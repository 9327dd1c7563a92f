"""A ``/predict`` body made into MNIST images: JSON parsing, base64, PNG decoding.

Pure (numpy, PIL): no Ray, no torch. Everything a client can get wrong is a
:class:`BadRequest` carrying the HTTP status and one line saying what to send instead.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from typing import Any

import numpy as np

#: Images in one request; more is a 413 (split them over several requests).
MAX_IMAGES = 1024
#: Request body limit: 1024 images as JSON integers take ~3.2 MB; PNGs leave room to spare.
MAX_BODY_BYTES = 8 * 1024 * 1024
#: Largest PNG accepted, in pixels (PIL's own bomb guard allows ~179 M before refusing).
MAX_PNG_PIXELS = 4096 * 4096
SIDE = 28


class BadRequest(Exception):
    """A request the server refuses: HTTP ``status`` and a one-line reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_images(body: bytes, max_images: int = MAX_IMAGES) -> np.ndarray:
    """The images of a ``/predict`` body as uint8 ``(N, 28, 28)``; :class:`BadRequest` else."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest(400, 'the body is not JSON; send {"images": [...]}') from None
    images = payload.get("images") if isinstance(payload, dict) else None
    if not isinstance(images, list) or not images:
        raise BadRequest(
            422,
            'expected {"images": [...]}: a non-empty list of 28x28 '
            "integer arrays (0-255) or base64 PNGs",
        )
    if len(images) > max_images:
        raise BadRequest(
            413,
            f"{len(images)} images in one request; the limit is "
            f"{max_images}: split them over several requests",
        )
    batch = np.empty((len(images), SIDE, SIDE), dtype=np.uint8)
    for i, image in enumerate(images):
        batch[i] = (
            png_to_mnist(_b64decode(image, i), i) if isinstance(image, str) else _pixels(image, i)
        )
    return batch


def _pixels(image: Any, i: int) -> np.ndarray:
    try:
        array = np.asarray(image)
    except (ValueError, TypeError, OverflowError):  # ragged nesting, odd types
        array = None
    if array is None or array.shape != (SIDE, SIDE):
        shape = "x".join(map(str, array.shape)) if array is not None else "ragged"
        raise BadRequest(
            422,
            f"image {i} has shape {shape or 'scalar'}; each image must be "
            "28x28 integers 0-255 or a base64 PNG",
        )
    if array.dtype.kind not in "iu":
        raise BadRequest(422, f"image {i}: pixels must be integers 0-255, got {_kind(array.dtype)}")
    if array.min() < 0 or array.max() > 255:
        raise BadRequest(
            422, f"image {i}: pixel values must be in 0-255, got {array.min()}..{array.max()}"
        )
    return array


def _kind(dtype: np.dtype) -> str:
    return {"f": "floats", "b": "booleans", "U": "strings", "O": "mixed or huge values"}.get(
        dtype.kind, str(dtype)
    )


def _b64decode(text: str, i: int) -> bytes:
    if text.startswith("data:"):  # a data URL, as a canvas's toDataURL() makes
        text = text.partition(",")[2]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(
            422, f"image {i} is a string but not base64 (a PNG, or a data: URL of one)"
        ) from None


def png_to_mnist(data: bytes, i: int = 0) -> np.ndarray:
    """A PNG of any size made MNIST-like: uint8 28x28, white digit on black, the digit
    scaled into a 20x20 box and centred by its centre of mass, as MNIST's digits were."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as img:
            if img.width * img.height > MAX_PNG_PIXELS:
                raise BadRequest(
                    413,
                    f"image {i} is {img.width}x{img.height} pixels; the "
                    f"limit is {MAX_PNG_PIXELS} pixels",
                )
            rgba = img.convert("RGBA")
    except BadRequest:
        raise
    except (
        UnidentifiedImageError,
        OSError,
        SyntaxError,
        ValueError,
        Image.DecompressionBombError,
    ) as exc:
        raise BadRequest(
            422, f"image {i} is not a readable PNG ({exc.__class__.__name__})"
        ) from None
    # Transparent pixels count as paper: a digit drawn on a transparent sheet shows on white.
    paper = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    gray = np.asarray(Image.alpha_composite(paper, rgba).convert("L"), dtype=np.float32)
    return _mnist_like(gray)


def _mnist_like(gray: np.ndarray) -> np.ndarray:
    from PIL import Image

    border = np.concatenate([gray[0], gray[-1], gray[:, 0], gray[:, -1]])
    if np.median(border) > 127:  # dark ink on light paper: MNIST's digits are white on black
        gray, border = 255 - gray, 255 - border
    ink = np.clip(gray - np.median(border), 0, None)
    if ink.max() < 16:  # a blank sheet stays blank
        return np.zeros((SIDE, SIDE), dtype=np.uint8)
    ink *= 255.0 / ink.max()
    rows, cols = np.nonzero(ink > 25)
    ink = ink[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
    scale = 20.0 / max(ink.shape)
    size = (max(1, round(ink.shape[1] * scale)), max(1, round(ink.shape[0] * scale)))
    box = np.asarray(
        Image.fromarray(ink.astype(np.uint8)).resize(size, Image.Resampling.LANCZOS),
        dtype=np.float32,
    )
    # Place the box so that its centre of mass lands on pixel (14, 14), where MNIST's are.
    total = box.sum() or 1.0
    com_y = (box.sum(1) * np.arange(box.shape[0])).sum() / total
    com_x = (box.sum(0) * np.arange(box.shape[1])).sum() / total
    top = int(np.clip(round(SIDE / 2 - com_y), 0, SIDE - box.shape[0]))
    left = int(np.clip(round(SIDE / 2 - com_x), 0, SIDE - box.shape[1]))
    out = np.zeros((SIDE, SIDE), dtype=np.float32)
    out[top : top + box.shape[0], left : left + box.shape[1]] = box
    return np.clip(out, 0, 255).round().astype(np.uint8)
