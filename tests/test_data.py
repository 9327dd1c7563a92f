"""Data sources resolve in order, and broken files are clear errors on the driver."""

import struct
import subprocess
import sys

import numpy as np
import pytest

from raytrain_mnist.data import DataError, load_mnist
from tests.conftest import write_tiny_mnist


def test_raw_files_in_torchvision_layout(tmp_path, sample_digits):
    write_tiny_mnist(tmp_path, sample_digits, n_train=64, n_test=9)
    data = load_mnist(tmp_path, "mnist")
    assert data.kind == "mnist" and (data.train_size, data.test_size) == (64, 9)
    assert (data.train_images.dtype, data.train_labels.dtype) == (np.uint8, np.int64)
    assert tuple(data.train_images.shape[1:]) == (28, 28)
    np.testing.assert_array_equal(data.train_labels, sample_digits[1][:64])
    assert "not the published files" in data.source


def test_gzipped_files_load_the_same(tmp_path, sample_digits):
    write_tiny_mnist(tmp_path / "raw", sample_digits, 64, 9)
    write_tiny_mnist(tmp_path / "gz", sample_digits, 64, 9, compress=True)
    raw, gz = load_mnist(tmp_path / "raw", "mnist"), load_mnist(tmp_path / "gz", "mnist")
    assert (raw.train_images == gz.train_images).all() and (raw.test_labels == gz.test_labels).all()


def test_data_dir_comes_before_the_cache(tmp_path, sample_digits, monkeypatch):
    write_tiny_mnist(tmp_path / "cache", sample_digits, 32, 8)
    write_tiny_mnist(tmp_path / "mine", sample_digits, 64, 9)
    monkeypatch.setenv("RAYTRAIN_MNIST_CACHE", str(tmp_path / "cache"))
    assert load_mnist(tmp_path / "mine", "mnist").train_size == 64
    assert load_mnist(None, "mnist").train_size == 32  # then the cache


def test_offline_fallback_to_the_sample_is_loud(tmp_path, caplog):
    data = load_mnist(None, "auto", cache_dir=tmp_path, download=False)
    assert data.kind == "sample" and (data.train_size, data.test_size) == (4000, 1000)
    assert np.bincount(data.test_labels).tolist() == [100] * 10
    assert "SAMPLE" in caplog.text and "Full MNIST not found" in caplog.text


def test_the_mirror_probed_is_torchvisions_first():
    from torchvision.datasets import MNIST

    from raytrain_mnist.data import MIRROR_HOST

    assert MNIST.mirrors[0].split("/")[2] == MIRROR_HOST


def test_an_unreachable_mirror_falls_back_without_importing_torchvision(tmp_path):
    """Offline, a default run pays for no torchvision import (its models and ops)."""
    probe = (
        "import sys; from raytrain_mnist import data; data.MIRROR_HOST = '127.0.0.1'\n"
        f"d = data.load_mnist(None, 'auto', cache_dir={str(tmp_path)!r}, download=True)\n"
        "print(d.kind, 'torchvision' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.split() == ["sample", "False"], result.stdout + result.stderr
    assert "download from 127.0.0.1 (unreachable" in result.stderr, result.stderr


def test_strict_mnist_never_falls_back(tmp_path):
    with pytest.raises(DataError, match="full MNIST not found; tried .*no MNIST/raw"):
        load_mnist(None, "mnist", cache_dir=tmp_path, download=False)


@pytest.mark.parametrize("dataset", ["auto", "mnist"])
def test_a_data_dir_without_mnist_is_an_error_naming_what_was_looked_for(
    tmp_path, sample_digits, monkeypatch, caplog, dataset
):
    """Asked for means asked for: neither the sample nor the cache stands in for it."""
    write_tiny_mnist(tmp_path / "cache", sample_digits, 32, 8)
    monkeypatch.setenv("RAYTRAIN_MNIST_CACHE", str(tmp_path / "cache"))
    (tmp_path / "empty" / "MNIST").mkdir(parents=True)
    with pytest.raises(DataError) as info:
        load_mnist(tmp_path / "empty", dataset, download=False)
    message = str(info.value)
    assert info.value.exit_code == 2 and "\n" not in message
    assert message.startswith(f"--data-dir {tmp_path / 'empty'} holds no MNIST: looked in ")
    for folder in ("empty/MNIST/raw", "empty/raw"):
        assert str(tmp_path / folder) in message, message
    assert "train-images-idx3-ubyte[.gz]" in message and "t10k-labels-idx1-ubyte[.gz]" in message
    assert "SAMPLE" not in caplog.text
    assert load_mnist(None, dataset, download=False).train_size == 32  # nothing asked: the cache


def test_missing_data_dir_is_a_usage_error(tmp_path):
    with pytest.raises(DataError, match="is not a directory") as info:
        load_mnist(tmp_path / "nope", "auto")
    assert info.value.exit_code == 2


def _corrupt(tmp_path, sample_digits, name, mutate):
    write_tiny_mnist(tmp_path, sample_digits, 64, 9)
    path = tmp_path / "MNIST" / "raw" / name
    path.write_bytes(mutate(path.read_bytes()))
    return tmp_path


@pytest.mark.parametrize(
    "name, mutate, message",
    [
        ("train-images-idx3-ubyte", lambda b: b[:-100], "is truncated"),
        ("train-images-idx3-ubyte", lambda b: b[:10], "not even an IDX header"),
        ("t10k-labels-idx1-ubyte", lambda b: struct.pack(">I", 0x803) + b[4:], "magic number"),
        ("t10k-labels-idx1-ubyte", lambda b: b[:-1] + bytes([42]), "label 42"),
        (
            "train-labels-idx1-ubyte",
            lambda b: struct.pack(">II", 0x801, 63) + b[8:-1],
            "64 images but 63 labels",
        ),
    ],
)
def test_broken_files_are_clear_errors(tmp_path, sample_digits, name, mutate, message):
    root = _corrupt(tmp_path, sample_digits, name, mutate)
    with pytest.raises(DataError, match=message):
        load_mnist(root, "auto")


def test_corrupt_gzip_is_a_clear_error(tmp_path, sample_digits):
    write_tiny_mnist(tmp_path, sample_digits, 64, 9, compress=True)
    path = tmp_path / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(DataError, match="cannot read .*t10k-images"):
        load_mnist(tmp_path, "mnist")


def test_incomplete_set_names_the_missing_file(tmp_path, sample_digits):
    write_tiny_mnist(tmp_path, sample_digits, 64, 9)
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match="missing t10k-labels-idx1-ubyte"):
        load_mnist(tmp_path, "auto")


def _gzip_bomb(tmp_path, sample_digits, extra: int, claimed: int | None = None):
    """A gzipped image file whose header is honest about 64 images (or claims ``claimed``)
    and which then inflates to ``extra`` more bytes of zeros."""
    import gzip

    write_tiny_mnist(tmp_path, sample_digits, 64, 9, compress=True)
    path = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte.gz"
    with gzip.open(path, "rb") as f:
        original = f.read()
    if claimed is not None:
        original = struct.pack(">4I", 0x803, claimed, 28, 28) + original[16:]
    with gzip.open(path, "wb", compresslevel=9) as f:
        f.write(original)
        chunk = bytes(1 << 20)
        for _ in range(extra >> 20):
            f.write(chunk)
    return tmp_path


def test_a_gzip_that_inflates_past_its_header_is_not_unpacked(tmp_path, sample_digits):
    import tracemalloc

    root = _gzip_bomb(tmp_path, sample_digits, extra=256 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="longer than its header says"):
            load_mnist(root, "mnist")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"read {peak} bytes of a 256 MiB stream"


def test_a_header_that_promises_too_much_is_refused(tmp_path, sample_digits):
    root = _gzip_bomb(tmp_path, sample_digits, extra=0, claimed=4_000_000)  # 3.1 GB
    with pytest.raises(DataError, match="its header promises 3136000016 bytes"):
        load_mnist(root, "mnist")


def test_a_raw_file_larger_than_the_bound_is_refused_before_it_is_read(tmp_path, sample_digits):
    import tracemalloc

    from raytrain_mnist import data as data_module

    write_tiny_mnist(tmp_path, sample_digits, 64, 9)
    path = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    with path.open("r+b") as f:  # a sparse file: its size costs no disk
        f.truncate(data_module._MAX_IDX_BYTES + 1)
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=f"is {(1 << 30) + 1} bytes, more than any MNIST"):
            load_mnist(tmp_path, "mnist")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"read {peak} bytes of a 1 GiB file"


def test_the_bound_is_the_same_raw_and_gzipped(tmp_path, sample_digits, monkeypatch):
    """A file of exactly the bound is read (and found wrong by its header), one byte more is
    refused: raw by its size, gzipped by what its header promises."""
    from raytrain_mnist import data as data_module

    write_tiny_mnist(tmp_path / "raw", sample_digits, 64, 9)
    size = (tmp_path / "raw/MNIST/raw/train-images-idx3-ubyte").stat().st_size
    monkeypatch.setattr(data_module, "_MAX_IDX_BYTES", size - 1)
    with pytest.raises(DataError, match=f"is {size} bytes, more than any MNIST-like set"):
        load_mnist(tmp_path / "raw", "mnist")
    write_tiny_mnist(tmp_path / "gz", sample_digits, 64, 9, compress=True)
    with pytest.raises(DataError, match=f"its header promises {size} bytes"):
        load_mnist(tmp_path / "gz", "mnist")
    monkeypatch.setattr(data_module, "_MAX_IDX_BYTES", size)
    assert load_mnist(tmp_path / "raw", "mnist").train_size == 64
    assert load_mnist(tmp_path / "gz", "mnist").train_size == 64


_WRITER = """
import sys
from pathlib import Path
from filelock import FileLock

cache, full = Path(sys.argv[1]), Path(sys.argv[2])
target = cache / "MNIST" / "raw" / full.name
with FileLock(str(cache / ".download.lock")):
    target.write_bytes(full.read_bytes()[:100])  # a download half-way through this file
    print("writing", flush=True)
    sys.stdin.readline()
    target.write_bytes(full.read_bytes())
"""


def test_the_cache_is_read_under_its_download_lock(tmp_path, sample_digits):
    """A process downloading into the cache holds its lock while it writes: a reader waits
    for it, then reads whole files, instead of failing on a half-written one."""
    import subprocess
    import sys
    import threading

    write_tiny_mnist(tmp_path / "cache", sample_digits, 64, 9)
    full = tmp_path / "train-images-idx3-ubyte"
    full.write_bytes((tmp_path / "cache/MNIST/raw/train-images-idx3-ubyte").read_bytes())
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path / "cache"), str(full)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout.readline() == "writing\n"
        result = {}

        def read():
            try:
                result["data"] = load_mnist(
                    None, "mnist", cache_dir=tmp_path / "cache", download=False
                )
            except DataError as exc:
                result["error"] = exc

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(1.5)
        assert reader.is_alive(), f"read the cache while a download held it: {result}"
        writer.stdin.write("done\n")
        writer.stdin.flush()
        reader.join(60)
        assert writer.wait(30) == 0
    finally:
        writer.kill()
    assert "error" not in result, result
    assert result["data"].train_size == 64
