"""One training run from the driver: ``fit(cfg) -> FitResult``. Library code: it never prints.

``fit`` loads MNIST once and puts it in the object store, claims the run directory
``<storage-path>/<name>``, connects to (or starts) Ray, then builds and fits a
``TorchTrainer`` and writes ``summary.json`` and ``training_curves.png``. It never touches
a tensor itself. It is a row of named stages over one :class:`~.stages.Fit`: *prepare*,
*open*, *connect*, *build*, *monitor*, *summarize*, then *write* while Ray shuts down
(:func:`~.on_trainer.train` alone orders the stop, whatever stopped the run). One sequence
over two backends: a TorchTrainer of the run's own (:class:`~.on_trainer.TrainerBackend`)
or, with ``--service``, a request to a warm service (:class:`~.on_service.ServiceBackend`);
both follow the run with :func:`~.stages.follow` and say why it stops with
:func:`~.stages.stopping`. What happens on the way reaches the caller as
:mod:`~raytrain_mnist.driver.events` (the CLI renders them; a notebook passes its own sink
or reads the log), and the outcome as a :class:`FitResult`::

    from raytrain_mnist.driver import fit

    result = fit(FitConfig(TrainConfig(epochs=3), RunSettings.from_flags(num_workers=2)))
    result.status, result.best_checkpoint

Errors a user can cause (bad data, a run of other settings under the name, a cluster that
cannot place the run) raise :class:`~raytrain_mnist.errors.UserError` before training; a
run that fails or is stopped with Ctrl-C returns its result with that status.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from raytrain_mnist.config import FitConfig
from raytrain_mnist.driver.events import EventSink, log_event
from raytrain_mnist.driver.fitting.on_service import ServiceBackend
from raytrain_mnist.driver.fitting.on_trainer import TrainerBackend
from raytrain_mnist.driver.fitting.stages import (
    Backend,
    FitResult,
    Serialized,
    default_invocation,
    gpu_text,
    open_run,
    prepare,
    process_started_at,
    record_end,
    result_of,
    resume_command,
)

__all__ = [
    "FitResult",
    "default_invocation",
    "fit",
    "gpu_text",
    "process_started_at",
    "resume_command",
]


def fit(
    cfg: FitConfig,
    on_event: EventSink | None = None,
    *,
    invocation: Sequence[str] | None = None,
    poll_s: float = 0.5,
    started_at: float | None = None,
    service: str | None = None,
) -> FitResult:
    """Train as ``cfg`` says, or report the run of that name as it finished before.

    ``on_event`` receives the run's :mod:`~raytrain_mnist.driver.events` (default:
    :func:`~raytrain_mnist.driver.events.log_event`). ``invocation`` is how the resume
    command starts (the CLI passes the words that started it; default
    :func:`default_invocation`). ``poll_s``: how often the driver collects the run's
    progress (a redrawn bar wants it sooner). Ctrl-C while training stops the run's workers
    and returns an ``interrupted`` result; the committed checkpoints stay.

    ``started_at``: when the command started (unix time; the CLI passes
    :func:`process_started_at`): the phases' seconds and ``summary.json``'s ``timeline``
    count from it. Default: this call.

    ``service``: train on that warm service (``raytrain-mnist service start``), as
    ``--service`` does; a ``cfg`` that did not choose a worker count (``auto_workers``)
    takes the service's.
    """
    if service is not None:  # as --service: the warm service of that name trains it
        cfg = dataclasses.replace(
            cfg,
            run=dataclasses.replace(
                cfg.run, scaling=dataclasses.replace(cfg.run.scaling, service=service)
            ),
        )
    emit = Serialized(on_event or log_event)
    name = cfg.run.scaling.service
    backend: Backend = TrainerBackend() if name is None else ServiceBackend(name)
    with backend.reached(cfg, emit, started_at) as cfg:
        ctx = prepare(cfg, emit, poll_s, started_at, service=backend.client)
        backend.ready(ctx)
        with ctx.run.claim(ctx.cfg.run.storage.fresh):
            ctx.run.held.handled = True  # a lost claim stops the run, with one line (Stopping)
            finished = open_run(ctx)
            if finished is not None:
                return finished
            backend.train(ctx)
            record_end(ctx)
    return result_of(ctx, invocation)
