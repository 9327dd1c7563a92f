"""A ``fit --service``: the run trained by a warm service's workers
(:mod:`raytrain_mnist.driver.service`) instead of a TorchTrainer of its own."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from raytrain_mnist.config import (
    FitConfig,
)
from raytrain_mnist.driver import cluster
from raytrain_mnist.driver.events import EventSink, Phase, Stopping
from raytrain_mnist.driver.fitting.stages import (
    Fit,
    FitResult,
    Plotting,
    let_go_of_ray,
    open_run,
    prepare,
    record_end,
    result_of,
    start_timeline,
    summarize,
    write_files,
)
from raytrain_mnist.driver.monitor import (
    RunMonitor,
)
from raytrain_mnist.driver.relay import INTERRUPTED, on_a_thread, relay
from raytrain_mnist.driver.runs import RUN_FILE
from raytrain_mnist.errors import UserError

logger = logging.getLogger(__name__)


def fit_on_service(
    cfg: FitConfig,
    emit: EventSink,
    poll_s: float,
    started_at: float | None,
    invocation: Sequence[str] | None,
) -> FitResult:
    """``fit --service``: the same run (its name, claim, identity, files, resume) trained by
    a warm service's workers (:mod:`~raytrain_mnist.driver.service`) instead of a new
    TorchTrainer. This command connects to the service's Ray, checks the service can honour
    the run, claims it, sends the request and follows it; Ctrl-C cancels the request."""
    from raytrain_mnist.driver.service import ServiceClient

    _, timeline = start_timeline(started_at)
    address = ServiceClient.address_of(cfg.run.scaling.service, cfg.run.address)
    emit(Phase(f"connecting to Ray at {address}", timeline.mark("ray_starting")))
    with cluster.connect(address, cluster.Request(0, 1, False), dashboard=False):
        # The imports of the run's end and tracking (matplotlib, tensorboard), now, while
        # this command waits on the service and its claim: a request trains at once, on
        # cores they would otherwise share with it (after ray.init: beside it, they slow it).
        on_a_thread(_warm_up, name="imports")
        try:
            client = ServiceClient(cfg.run.scaling.service)
            cfg = client.fitted(cfg)
            ctx = prepare(cfg, emit, poll_s, started_at, service=client)
            ctx.timeline, ctx.address, ctx.disconnects = timeline, address, True
            ctx.cpus_per_worker = client.info["cpus_per_worker"]
            ctx.phase("Ray ready", "ray_ready")
            with ctx.run.claim(ctx.cfg.run.storage.fresh):
                ctx.run.held.handled = True
                finished = open_run(ctx)
                if finished is not None:
                    return finished
                _request(ctx, client)
                _disconnect(ctx)
                record_end(ctx)
        finally:
            import ray

            if ray.is_initialized():  # stopped before _disconnect: a refusal, an error
                ray.shutdown()
    return result_of(ctx, invocation)


def _warm_up() -> None:
    try:
        from raytrain_mnist.driver import plots, tracking

        plots.warm_up()
        tracking.warm_up()
    except Exception:  # drawing or opening raises it again, where it is needed
        logger.debug("warming up imports failed", exc_info=True)


def _disconnect(ctx: Fit) -> None:
    """This driver leaves the cluster (the service lives on), then writes the files. Not on
    two threads as a fit on its own trainer does (:func:`~.on_trainer.train`): leaving takes
    tens of milliseconds, and the drawing, which holds the GIL, would only slow it."""
    import gc

    import ray

    collecting = gc.isenabled()
    try:
        let_go_of_ray(ctx)
        gc.disable()  # no collection while Ray shuts down (let_go_of_ray says why)
        ray.shutdown()  # this command's part in the cluster ends here
        ctx.timeline.mark("ray_shut_down")
    finally:
        if collecting:
            gc.enable()
    write_files(ctx)
    ctx.timeline.mark("files_written")


def _request(ctx: Fit, client) -> None:
    """Send the run to the service and follow it to its end (or Ctrl-C's cancel)."""
    cfg, run = ctx.cfg, ctx.run
    ctx.announce(f" on service '{client.name}'")
    run.write_json(RUN_FILE, ctx.identity)
    from raytrain_mnist.driver.tracking import EpochLog

    # TensorBoard's writer imports torch (a second or more): opened while the request trains.
    opening = on_a_thread(lambda: EpochLog(run.dir, cfg), name="tracking")
    ctx.plotting = Plotting()
    request_id = client.submit(cfg, run, run.latest_checkpoint())
    ctx.phase("request sent", "trainer_started")
    try:
        ctx.tracker = opening()
    except BaseException:  # a bad --mlflow-uri: the run stops before its first epoch
        client.cancel(request_id, "its tracking could not be opened")
        raise

    ctx.monitor = RunMonitor(
        client.channel(request_id),
        cfg.train.epochs,
        ctx.prior,
        ctx.emit,
        ctx.timeline,
        on_epoch=ctx.on_epoch,
        poll_s=ctx.poll_s,
    )
    with ctx.monitor:
        outcome = relay(
            lambda: client.follow(request_id, ctx.emit, cfg.train.epochs),
            lambda reason, running: _cancel(ctx, client, request_id, reason),
            name="request",
            watch=ctx.claim_lost,
        )
    ctx.timeline.mark("fit_returned")
    ctx.trainer_ended = True
    ended = outcome.value if outcome.stopped is None else None
    if outcome.stopped is None and ended is not None and ended["state"] == "failed":
        ctx.error = UserError(ended["error"] or "the request failed")
        ctx.logs = client.info.get("logs")  # the service's workers' logs, on its node
    elif outcome.error is not None and outcome.stopped is None:
        ctx.error = outcome.error
    summarize(ctx)


def _cancel(ctx: Fit, client, request_id: str, reason: str) -> None:
    if reason == INTERRUPTED:
        ctx.emit(Stopping("cancelling the request; the last committed checkpoint is kept"))
    else:
        ctx.emit(
            Stopping(f"{reason}: cancelling the request; the last committed checkpoint is kept")
        )
    client.cancel(request_id, reason)
