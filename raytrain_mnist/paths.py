"""Where this package keeps files of its own on this machine (no torch, no Ray: a command
that only finds a service must not pay for importing them)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """MNIST's downloads and the registrations of the services started here;
    ``$RAYTRAIN_MNIST_CACHE`` moves it."""
    return Path(os.environ.get("RAYTRAIN_MNIST_CACHE", Path.home() / ".cache" / "raytrain_mnist"))
