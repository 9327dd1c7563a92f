"""Shared fixtures. Every test runs on CPU, offline, without ../shared.

Auth mode: tests start their own Ray clusters with token authentication *disabled*
(RAY_AUTH_MODE=disabled), so none of them writes ~/.ray/auth_token. The Jobs tests that
need a token create their own in a temporary directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

# Decided before anything imports ray, and inherited by every subprocess a test starts.
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAYTRAIN_MNIST_NO_DOWNLOAD"] = "1"
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

REPO = Path(__file__).resolve().parents[1]


def full_data_dir() -> Path | None:
    """The full MNIST set, when this checkout has it (RAYTRAIN_MNIST_DATA or ../shared)."""
    candidates = [os.environ.get("RAYTRAIN_MNIST_DATA"), REPO.parent / "shared" / "data" / "mnist"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").is_file():
            return Path(candidate)
    return None


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """No test sees a real MNIST cache in the user's home."""
    monkeypatch.setenv("RAYTRAIN_MNIST_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def sample_digits():
    """Genuine MNIST digits from the sample the package ships with (uint8, int64), shuffled:
    the sample is sorted by label, so its first digits would all be 0s and 1s."""
    from raytrain_mnist.data import load_sample

    data = load_sample()
    order = np.random.default_rng(0).permutation(data.train_size)
    return data.train_images.numpy()[order], data.train_labels.numpy()[order]


def write_tiny_mnist(root: Path, digits, n_train: int = 512, n_test: int = 203,
                     compress: bool = False) -> Path:
    """A small, learnable MNIST in torchvision's layout; odd test size on purpose."""
    from raytrain_mnist.data import write_idx

    images, labels = digits
    raw = root / "MNIST" / "raw"
    write_idx(raw, images[:n_train], labels[:n_train], "train", compress)
    write_idx(raw, images[n_train:n_train + n_test], labels[n_train:n_train + n_test], "test",
              compress)
    return root


@pytest.fixture(scope="session")
def tiny_mnist(tmp_path_factory, sample_digits) -> Path:
    return write_tiny_mnist(tmp_path_factory.mktemp("tiny"), sample_digits)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the in-process tests, shut down at the end of the session."""
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False,
             logging_level="WARNING")
    yield ray
    ray.shutdown()


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, cwd=None):
    """Run ``python -m raytrain_mnist ...`` as a user would; returns CompletedProcess."""
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", "raytrain_mnist", *args],
        capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO,
        env={**os.environ, **(env or {})},
    )
