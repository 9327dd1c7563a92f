"""A ``fit --service``: the run trained by a warm service's workers
(:mod:`raytrain_mnist.driver.service`) instead of a TorchTrainer of its own."""

from __future__ import annotations

import contextlib
import logging

from raytrain_mnist.config import FitConfig
from raytrain_mnist.driver import cluster
from raytrain_mnist.driver.events import EventSink, Phase
from raytrain_mnist.driver.fitting.stages import (
    Fit,
    Plotting,
    follow,
    let_go_of_ray,
    start_timeline,
    stopping,
    summarize,
    write_files,
)
from raytrain_mnist.driver.relay import on_a_thread
from raytrain_mnist.driver.runs import RUN_FILE
from raytrain_mnist.errors import UserError

logger = logging.getLogger(__name__)


class ServiceBackend:
    """``fit --service NAME``: the same run (its name, claim, identity, files, resume)
    trained by a warm service's workers instead of a new TorchTrainer. The command connects
    to the service's Ray first (the service holds the data and says what it can honour),
    then claims the run, sends the request and follows it; Ctrl-C cancels the request."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.client = None  # the ServiceClient, once connected
        self.address: str | None = None
        self.timeline = None  # from before the connection: its seconds count

    @contextlib.contextmanager
    def reached(self, cfg: FitConfig, emit: EventSink, started_at: float | None):
        """Connected to the service's Ray; yields ``cfg`` as the service trains it (its
        worker count, device and data), or raises the one line of what it cannot honour."""
        from raytrain_mnist.driver.service import ServiceClient

        _, self.timeline = start_timeline(started_at)
        self.address = ServiceClient.address_of(self.name, cfg.run.address)
        emit(Phase(f"connecting to Ray at {self.address}", self.timeline.mark("ray_starting")))
        with cluster.connect(self.address, cluster.Request(0, 1, False), dashboard=False):
            # The imports of the run's end and tracking (matplotlib, tensorboard), now, while
            # this command waits on the service and its claim: a request trains at once, on
            # cores they would otherwise share with it (after ray.init: beside it, they slow it).
            on_a_thread(_warm_up, name="imports")
            try:
                self.client = ServiceClient(self.name)
                yield self.client.fitted(cfg)
            finally:
                import ray

                if ray.is_initialized():  # stopped before _disconnect: a refusal, an error
                    ray.shutdown()

    def ready(self, ctx: Fit) -> None:
        ctx.timeline, ctx.address, ctx.disconnects = self.timeline, self.address, True
        ctx.cpus_per_worker = self.client.info["cpus_per_worker"]
        ctx.phase("Ray ready", "ray_ready")

    def train(self, ctx: Fit) -> None:
        _request(ctx, self.client)
        _disconnect(ctx)


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

    outcome = follow(
        ctx,
        client.channel(request_id),
        lambda: client.follow(request_id, ctx.emit, cfg.train.epochs),
        lambda reason, running: _cancel(client, ctx, request_id, reason),
        name="request",
    )
    ctx.trainer_ended = True
    ended = outcome.value if outcome.stopped is None else None
    if outcome.stopped is None and ended is not None and ended["state"] == "failed":
        ctx.error = UserError(ended["error"] or "the request failed")
        ctx.logs = client.info.get("logs")  # the service's workers' logs, on its node
    elif outcome.error is not None and outcome.stopped is None:
        ctx.error = outcome.error
    summarize(ctx)


def _cancel(client, ctx: Fit, request_id: str, reason: str) -> None:
    stopping(ctx, reason, "cancelling the request")
    client.cancel(request_id, reason)
