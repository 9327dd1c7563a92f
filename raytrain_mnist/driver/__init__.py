"""Code that runs in the driver process: connecting to Ray, a run's storage and claim, the
trainer, the progress transport, tracking and plots. Library code: it logs and returns
results, never prints.

The entry points a notebook uses are importable from here (loaded on first use, so that
importing a submodule does not pull in the rest)::

    from raytrain_mnist.driver import evaluate_checkpoint, fit, search
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the module that defines it.
_EXPORTS = {
    "fit": "raytrain_mnist.driver.fitting",
    "FitResult": "raytrain_mnist.driver.fitting",
    # The Tune search: its package is not named ``search``, or importing it would bind this
    # package's ``search`` attribute to the package instead of the function.
    "search": "raytrain_mnist.driver.searching",
    "SearchResult": "raytrain_mnist.driver.searching",
    "evaluate_checkpoint": "raytrain_mnist.driver.evaluation",
    "Evaluation": "raytrain_mnist.driver.evaluation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
