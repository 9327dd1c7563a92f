"""Code that runs inside Ray Train workers: the training loop, its progress feed and the
scoring worker. The only caller of the worker-side ``ray.train`` API; imports nothing from
``driver`` or ``serving``.

The three functions a driver hands Ray to run are named here, in a package that imports
nothing: a driver (a shell's ``fit``, a Tune trial's actor, a service) passes them to its
trainer without importing torch, seconds of CPU that only the workers need to spend. Each
imports the module it runs on the worker that runs it.
"""

from __future__ import annotations

from typing import Any


def train_func_per_worker(config: dict[str, Any]) -> None:
    """The Train loop of ``fit`` and ``tune``: :func:`.loop.train_func_per_worker`."""
    from raytrain_mnist.worker import loop

    loop.train_func_per_worker(config)


def score_per_worker(config: dict[str, Any]) -> dict[str, Any] | None:
    """The scoring of ``evaluate`` on several workers: :func:`.score.score_per_worker`."""
    from raytrain_mnist.worker import score

    return score.score_per_worker(config)


def serve_requests(config: dict[str, Any]) -> None:
    """A service's worker group: :func:`.service.serve_requests`."""
    from raytrain_mnist.worker import service

    service.serve_requests(config)
