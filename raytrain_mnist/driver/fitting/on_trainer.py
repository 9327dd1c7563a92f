"""A ``fit`` on a TorchTrainer of its own: connect (or start Ray), build the trainer, follow
it, and the one order in which such a fit stops (:func:`train`)."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable

from raytrain_mnist.config import FitConfig
from raytrain_mnist.driver import cluster
from raytrain_mnist.driver.events import EventSink
from raytrain_mnist.driver.fitting.stages import (
    Fit,
    Plotting,
    follow,
    let_go_of_ray,
    stopping,
    summarize,
    write_files,
)
from raytrain_mnist.driver.monitor import abort_run, controller_callbacks, start_channel
from raytrain_mnist.driver.relay import on_a_thread
from raytrain_mnist.driver.runs import RUN_FILE
from raytrain_mnist.errors import UserError, cause_line, diverged_line

logger = logging.getLogger(__name__)


def train(ctx: Fit) -> None:
    """Connect, build, monitor, summarize; then the files are written while Ray shuts down.
    The one owner of the order in which a fit stops, whatever stopped it (the end, Ctrl-C,
    SIGTERM, a lost claim, a failure): the trainer has ended and the progress is drained
    (:func:`_monitor`); the files are written on a thread of their own (:func:`write_files`:
    curves, summary.json, tracking, none of which touches Ray); nothing of this fit holds
    Ray any more (:func:`let_go_of_ray`) and no thread collects garbage (``gc.disable``);
    then :func:`cluster.connect` shuts down a Ray this fit started (or this fit disconnects
    from the cluster it connected to), and the files are waited for. Nothing touches Ray
    after: what follows (:func:`record_end`, the claim's release) is files only."""
    request = _size(ctx)
    collecting = gc.isenabled()
    try:
        # A single run needs no dashboard: without it its own Ray starts seconds sooner.
        with cluster.connect(ctx.address, request, dashboard=False) as started:
            try:
                ctx.phase("Ray ready", "ray_ready")
                _build(ctx)
                _monitor(ctx)
                summarize(ctx)
                files = on_a_thread(lambda: write_files(ctx), name="files")
            finally:
                let_go_of_ray(ctx)
                # No thread collects while Ray shuts down: none frees a Ray object then.
                gc.disable()
            leaves = ctx.disconnects and ctx.trainer_ended
            if leaves:
                import ray

                ray.shutdown()  # the cluster lives on; this driver's part in it ends here
    finally:
        if collecting:
            gc.enable()
    shut_down = time.time()
    files()
    if started or leaves:
        ctx.timeline.mark("ray_shut_down", shut_down)
    ctx.timeline.mark("files_written")


def _size(ctx: Fit) -> cluster.Request:
    """Where the run trains and what it asks of the cluster."""
    import ray

    ctx.address = cluster.resolve_address(ctx.cfg.run.address)
    ctx.local = ctx.address is None and not ray.is_initialized()
    ctx.disconnects = ctx.address is not None and not ray.is_initialized()
    scaling = ctx.cfg.run.scaling
    # Sized for the most workers the run may have; placed once the fewest fit.
    ctx.cpus_per_worker = scaling.cpus_per_worker or cluster.default_cpus_per_worker(
        scaling.max_workers, ctx.local
    )
    ctx.phase(
        "starting a local Ray"
        if ctx.local
        else f"connecting to Ray at {ctx.address}"
        if ctx.address
        else "using the connected Ray",
        "ray_starting",
    )
    return cluster.Request.for_run(ctx.cfg.run, ctx.cpus_per_worker)


def _build(ctx: Fit) -> None:
    """Say what starts, write run.json, open tracking and the progress channel, and build
    the trainer (the data goes into the object store once, for every worker)."""
    import ray

    cfg, data, run = ctx.cfg, ctx.data, ctx.run
    ctx.announce()
    run.write_json(RUN_FILE, ctx.identity)
    from raytrain_mnist.driver.tracking import EpochLog
    from raytrain_mnist.driver.trainer import build_trainer
    from raytrain_mnist.worker import train_func_per_worker

    ctx.tracker = EpochLog(run.dir, cfg)  # a bad --mlflow-uri fails here, before training
    ctx.channel = start_channel()
    ctx.plotting = Plotting()
    # --progress off: no stream from rank 0 at all (the epochs still arrive).
    loop_config = {
        "train": cfg.train.to_dict(),
        "data": ray.put(data),
        "cpus_per_worker": ctx.cpus_per_worker,
        "progress": None if cfg.run.output.progress == "off" else ctx.channel,
        "compile": cfg.run.torch.compile,
        "cuda_graphs": cfg.run.torch.cuda_graphs,
    }
    ctx.trainer = build_trainer(
        cfg.run,
        train_func_per_worker,
        loop_config,
        ctx.cpus_per_worker,
        run.storage,
        run.name,
        callbacks=controller_callbacks(ctx.channel),
        own_ray=ctx.local,
    )


def _monitor(ctx: Fit) -> None:
    """``trainer.fit()`` followed (:func:`~.stages.follow`) until the run ends, fails, or is
    stopped; returns once it has returned, with what is left in the channel drained."""
    import ray

    ctx.phase("workers starting", "trainer_started")
    try:
        outcome = follow(
            ctx,
            ctx.channel,
            ctx.trainer.fit,
            lambda reason, running: _stop(ctx, reason, running),
            name="trainer.fit",
            stop_wait_s=_STOP_WAIT_S,
        )
    except ray.train.TrainingFailedError as exc:
        ctx.trainer_ended = True
        # A diverged run ends in the line a service's run ends in (its request's error).
        diverged = diverged_line(exc)
        ctx.error = exc if diverged is None else UserError(diverged)
        ctx.logs = cluster.worker_logs_dir()
        logger.debug("training failed: %s (worker logs: %s)", cause_line(exc), ctx.logs)
        return
    ctx.result = outcome.value if outcome.stopped is None else None
    ctx.trainer_ended = outcome.finished
    if not outcome.finished:
        logger.warning(
            "trainer.fit() had not returned %.0f s after the run was stopped", _STOP_WAIT_S
        )


#: How long a stopped run's ``trainer.fit()`` may take to return once its controller was
#: aborted (it returns within seconds; a loaded machine takes longer).
_STOP_WAIT_S = 120.0


def _stop(ctx: Fit, reason: str, running: Callable[[], bool]) -> None:
    """Stop the run as Ray's own SIGINT handler would: abort its controller. Its workers
    stop, the committed checkpoints stay, a Ray that is not ours lives on."""
    stopping(ctx, reason, "stopping the workers")
    abort_run(ctx.channel, running)


class TrainerBackend:
    """A fit on a TorchTrainer of its own (the default): the data is loaded first, then
    :func:`train` connects to (or starts) Ray, builds the trainer and follows it."""

    client = None  # no service holds the data

    @contextlib.contextmanager
    def reached(self, cfg: FitConfig, emit: EventSink, started_at: float | None):
        yield cfg  # Ray is reached in train(), once the data is loaded

    def ready(self, ctx: Fit) -> None:
        pass

    def train(self, ctx: Fit) -> None:
        train(ctx)
