"""Data-parallel MNIST training on Ray Train: the reference implementation.

Library entry points; the command line is ``python -m raytrain_mnist.<fit|...>`` or
``raytrain-mnist <command>``.
"""

from raytrain_mnist.config import ConfigError, FitConfig, RunSettings, TrainConfig
from raytrain_mnist.model import ConvNet

__all__ = ["ConfigError", "ConvNet", "FitConfig", "RunSettings", "TrainConfig", "fit"]
__version__ = "0.1.0"


def fit(cfg: FitConfig) -> dict:
    """Train as ``cfg`` says and return the run's summary (see :mod:`raytrain_mnist.fit`)."""
    from raytrain_mnist.fit import fit as _fit

    return _fit(cfg)
