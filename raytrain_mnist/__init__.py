"""Data-parallel MNIST training on Ray Train: the reference implementation.

The command line is ``python -m raytrain_mnist.fit`` (or ``raytrain-mnist fit``). The library
calls, which return results and never print, are ``raytrain_mnist.driver.fit``, ``.search`` and
``.evaluate_checkpoint``. Entry points are imported lazily, so the CLI answers ``--help`` and
bad flags without loading torch or ray.
"""

from __future__ import annotations

import importlib
from typing import Any

from raytrain_mnist.config import ConfigError, FitConfig, RunSettings, TrainConfig

__all__ = ["ConfigError", "ConvNet", "FitConfig", "RunSettings", "TrainConfig", "load_mnist"]
__version__ = "0.1.0"

# (``fit`` is not re-exported here: ``raytrain_mnist.fit`` is the command module; the library
# call is ``raytrain_mnist.driver.fit``.)
_LAZY = {"ConvNet": "raytrain_mnist.nn.model", "load_mnist": "raytrain_mnist.data"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raytrain_mnist' has no attribute {name!r}")
