"""A ``/predict`` body made into MNIST images: JSON parsing, base64, PNG decoding.

Pure (numpy, PIL): no Ray, no torch. Everything a client can get wrong is a
:class:`BadRequest` carrying the HTTP status and one line saying what to send instead.

What a body may cost is bounded before it is spent: the body's bytes (:data:`MAX_BODY_BYTES`,
checked by the app as it reads), its images (:data:`MAX_IMAGES`), each PNG's pixels
(:data:`MAX_PNG_PIXELS`) and the pixels of all a request's PNGs together
(:data:`MAX_REQUEST_PIXELS`). A PNG's pixels are what its header declares, read before
anything is decoded: a few hundred bytes of PNG can declare a gigapixel of blank paper.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import struct
import zlib
from typing import Any

import numpy as np

#: Images in one request; more is a 413 (split them over several requests).
MAX_IMAGES = 1024
#: Request body limit: 1024 images as JSON integers take ~3.2 MB; PNGs leave room to spare.
MAX_BODY_BYTES = 8 * 1024 * 1024
#: Largest PNG accepted, in pixels: a photo of a digit, with room to spare (PIL's own bomb
#: guard would open ~179 M pixels, gigabytes decoded).
MAX_PNG_PIXELS = 4096 * 4096
#: All a request's PNGs together, in declared pixels: two of the largest, or 428 of the
#: page's 280x280 drawings. Bounds a request's decoding time (a second or so on one core).
MAX_REQUEST_PIXELS = 2 * MAX_PNG_PIXELS
#: Chunks of one PNG, and of all a request's PNGs together: a PNG writer's image data comes
#: in chunks of 8 KiB or more, so 4096 chunks carry any PNG that fits the body. Each chunk
#: costs a few microseconds to walk, whatever its size.
MAX_PNG_CHUNKS = 4096
MAX_REQUEST_CHUNKS = 2 * MAX_PNG_CHUNKS
#: The chunks a PNG is decoded from (its header, palette, transparency and image data); the
#: rest (text, zTXt and iTXt that inflate, ICC profiles, EXIF, animation) is dropped unread.
_KEPT_CHUNKS = (b"IHDR", b"PLTE", b"tRNS")
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: PNGs are shrunk (by whole factors, averaging) to at most this side before any float
#: copy is made: plenty for a 20x20 digit, and a decoded image's float arrays stay small.
WORK_SIDE = 1024
SIDE = 28


class BadRequest(Exception):
    """A request the server refuses: HTTP ``status``, a one-line reason and any headers
    the answer needs (``WWW-Authenticate`` for a 401)."""

    def __init__(self, status: int, message: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


def parse_images(
    body: bytes, max_images: int = MAX_IMAGES, max_pixels: int = MAX_REQUEST_PIXELS
) -> np.ndarray:
    """The images of a ``/predict`` body as uint8 ``(N, 28, 28)``; :class:`BadRequest` else.
    Every PNG's declared size is checked, and their sum against ``max_pixels``, before any
    of them is decoded."""
    try:
        payload = json.loads(body)
    except RecursionError:  # [[[[...]]]] deeper than the parser recurses: no 500
        raise BadRequest(
            400, 'the body nests too deeply to be a /predict body; send {"images": [...]}'
        ) from None
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
    pngs, chunks = {}, 0
    for i, image in enumerate(images):
        if isinstance(image, str):
            pngs[i] = lean_png(_b64decode(image, i), i)
            chunks += getattr(pngs[i], "chunks", 0)
            if chunks > MAX_REQUEST_CHUNKS:
                raise BadRequest(
                    413,
                    f"the PNGs up to image {i} have {chunks} chunks; a request's limit is "
                    f"{MAX_REQUEST_CHUNKS}: send fewer PNGs per request",
                )
    total = 0
    for i, data in pngs.items():
        width, height = png_size(data, i)
        total += width * height
        if total > max_pixels:
            raise BadRequest(
                413,
                f"the PNGs up to image {i} declare {total} pixels; a request's limit is "
                f"{max_pixels} pixels: send fewer or smaller PNGs per request",
            )
    batch = np.empty((len(images), SIDE, SIDE), dtype=np.uint8)
    for i, image in enumerate(images):
        batch[i] = png_to_mnist(pngs[i], i) if i in pngs else _pixels(image, i)
    return batch


def _pixels(image: Any, i: int) -> np.ndarray:
    try:
        array = np.asarray(image)
    except (ValueError, TypeError, OverflowError, RecursionError):  # ragged, odd, deep
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


class LeanPng(bytes):
    """A PNG reduced to the chunks it is decoded from (:func:`lean_png`); ``chunks``: how
    many the original had."""

    chunks = 0


def lean_png(data: bytes, i: int = 0) -> bytes:
    """``data`` with only the chunks a PNG is decoded from (header, palette, transparency,
    and its image data joined into one chunk), the rest dropped before PIL reads anything:
    an ancillary chunk costs nothing, however it would inflate. Refused past
    :data:`MAX_PNG_CHUNKS` (413) or with a damaged chunk kept (422). Bytes that are not a PNG
    come back as they are (PIL refuses them, or reads another format)."""
    if isinstance(data, LeanPng) or not data.startswith(_PNG_SIGNATURE):
        return data
    view = memoryview(data)
    kept, idat, count, at = [], [], 0, len(_PNG_SIGNATURE)
    while at + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, at)
        end = at + 12 + length
        count += 1
        if count > MAX_PNG_CHUNKS:
            raise BadRequest(
                413, f"image {i} has over {MAX_PNG_CHUNKS} chunks; a PNG writer makes far fewer"
            )
        if end > len(data):
            break  # truncated: PIL says so
        if kind in _KEPT_CHUNKS or kind == b"IDAT":
            payload = view[at + 8 : end - 4]
            if zlib.crc32(payload, zlib.crc32(kind)) != struct.unpack_from(">I", data, end - 4)[0]:
                raise BadRequest(422, f"image {i} is not a readable PNG (a damaged chunk)")
            if kind == b"IDAT":
                idat.append(payload)
            elif not idat:  # what comes after the image data is not read from
                kept.append(view[at:end])
        elif kind == b"IEND":
            break
        at = end
    joined = b"".join(idat)
    lean = LeanPng(
        _PNG_SIGNATURE
        + b"".join(kept)
        + (_chunk(b"IDAT", joined) if idat else b"")
        + _chunk(b"IEND", b"")
    )
    lean.chunks = count
    return lean


def _chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(payload, zlib.crc32(kind))
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def png_size(data: bytes, i: int = 0, formats: tuple[str, ...] = ("PNG",)) -> tuple[int, int]:
    """A PNG's width and height as its header declares them, refused past
    :data:`MAX_PNG_PIXELS` (413); nothing is decoded (PIL's open reads the header only).
    ``formats``: as :func:`png_to_mnist`'s."""
    with _open_png(data, i, formats) as img:
        return img.size


def png_to_mnist(data: bytes, i: int = 0, formats: tuple[str, ...] = ("PNG",)) -> np.ndarray:
    """A PNG of any size made MNIST-like: uint8 28x28, white digit on black, the digit
    scaled into a 20x20 box and centred by its centre of mass, as MNIST's digits were.
    ``formats``: the PIL formats accepted (``predict`` reads JPEGs too, the same way).

    Decoded once, in its own mode, then made one byte per pixel (gray on white paper) and
    shrunk to :data:`WORK_SIDE` before any float copy: a few bytes per declared pixel at
    the peak, never a float array of the full image."""
    with _open_png(data, i, formats) as img:
        try:
            gray = _on_white(img)
        except (OSError, SyntaxError, ValueError, EOFError) as exc:  # truncated, corrupt
            raise BadRequest(
                422, f"image {i} is not a readable PNG ({exc.__class__.__name__})"
            ) from None
    factor = -(-max(gray.size) // WORK_SIDE)  # ceil: the shrunk side is at most WORK_SIDE
    if factor > 1:
        gray = gray.reduce(factor)  # box average: no detail of a 20x20 digit is lost
    return _mnist_like(np.asarray(gray, dtype=np.float32))


def _open_png(data: bytes, i: int, formats: tuple[str, ...] = ("PNG",)):
    """The PNG opened lazily (its header read, no pixel decoded), its size checked; only
    the chunks it is decoded from are read (:func:`lean_png`)."""
    from PIL import Image, UnidentifiedImageError

    data = lean_png(data, i)
    try:
        img = Image.open(io.BytesIO(data), formats=list(formats))
    except Image.DecompressionBombError:  # past twice PIL's own guard: our cap is far lower
        raise BadRequest(
            413, f"image {i} declares over {MAX_PNG_PIXELS} pixels, the limit per PNG"
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as exc:
        raise BadRequest(
            422, f"image {i} is not a readable PNG ({exc.__class__.__name__})"
        ) from None
    width, height = img.size
    if width * height > MAX_PNG_PIXELS:
        img.close()
        raise BadRequest(
            413, f"image {i} is {width}x{height} pixels; the limit is {MAX_PNG_PIXELS} pixels"
        )
    return img


def _on_white(img):
    """One byte per pixel: the image's gray, transparent pixels counting as white paper (a
    digit drawn on a transparent sheet shows on white)."""
    from PIL import Image

    if img.mode not in ("RGBA", "LA", "PA", "RGBa", "La") and "transparency" not in img.info:
        return img.convert("L")
    gray_alpha = img.convert("LA")
    img.close()  # the decoded original: its memory goes before the next copies are made
    ink, alpha = gray_alpha.split()
    del gray_alpha
    return Image.composite(ink, Image.new("L", ink.size, 255), alpha)


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
