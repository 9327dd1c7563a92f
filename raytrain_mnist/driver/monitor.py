"""How a run's progress reaches the driver while it trains: the transport behind ``fit``.

Three pieces, one per process that takes part:

* :class:`RunChannel`, a small actor on the driver's node. Rank 0's
  :class:`~raytrain_mnist.worker.feed.ProgressFeed` puts its stream there (``ready``,
  ``first_step``, ``step``), the Train controller puts each committed epoch and its own
  handle (to abort the run on Ctrl-C). Nothing waits on the driver: every put is fire and
  forget.
* :func:`controller_callbacks`, the callbacks that run on the Train controller and feed it.
* :class:`RunMonitor`, a thread in the driver that drains the channel a few times a second
  and turns what arrives into :mod:`~raytrain_mnist.driver.events` for a sink. It also
  builds what the summary needs: the history, the worker-group restarts and resizes.

The items are plain dicts. Rank 0's carry ``progress`` (its kind), and its ``ready`` carries
``world_size``, ``started_at`` (which worker-group start it came from) and
``resumed_from_epoch``; a committed epoch is the epoch's report (no ``progress`` key) with
its ``checkpoint`` path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from raytrain_mnist import compat
from raytrain_mnist.driver.events import EpochCommitted, EventSink, Note, Phase, StepProgress

logger = logging.getLogger(__name__)


class RunChannel:
    """The actor that carries a run's stream from the Train controller and rank 0 to the
    driver: committed epochs, rank 0's progress, and the controller's handle. Start it with
    :func:`start_channel`."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.controller = None

    def put(self, item: dict) -> None:
        self.items.append(item)

    def set_controller(self, handle: list) -> None:
        self.controller = handle[0]

    def get_controller(self):
        return self.controller

    def drain(self) -> list[dict]:
        items, self.items = self.items, []
        return items


def start_channel():
    """A :class:`RunChannel` actor on this (the driver's) node, as Ray puts the Train
    controller: a lost worker node must not take the stream (and the epochs it carries)
    with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return (
        ray.remote(num_cpus=0)(RunChannel)
        .options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False
            )
        )
        .remote()
    )


def controller_callbacks(channel) -> list:
    """Controller-side callbacks feeding ``channel``: they fire and forget, the controller
    never waits on the driver."""
    import ray
    from ray.train import UserCallback

    class EpochFeed(UserCallback):
        """After every rank has reported an epoch and its checkpoint is committed."""

        def after_report(self, run_context, metrics, checkpoint):
            channel.put.remote(
                {**metrics[0], "checkpoint": checkpoint.path if checkpoint else None}
            )

    callbacks: list = [EpochFeed()]
    # The controller's handle: a public hook for it does not exist in Ray 2.60.
    ControllerCallback = compat.controller_callback_base()
    if ControllerCallback is None:
        return callbacks

    class ControllerFeed(ControllerCallback):
        def after_controller_start(self, train_run_context):
            # In a list: a bare handle passed to a task is not the same as one sent as data.
            channel.set_controller.remote([ray.get_runtime_context().current_actor])

    return callbacks + [ControllerFeed()]


def abort_run(channel, is_running: Callable[[], bool]) -> None:
    """Stop the run ``channel`` serves by aborting its controller, as Ray's own SIGINT
    handler would: its workers stop, the committed checkpoints stay. Interrupted while the
    controller was starting, wait for it to announce itself (while ``is_running()``)."""
    import ray

    controller = None
    for _ in range(60):
        controller = ray.get(channel.get_controller.remote(), timeout=30)
        if controller is not None or not is_running():
            break
        time.sleep(0.5)
    if controller is not None:
        try:
            ray.get(controller.abort.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            pass  # the controller ends itself once it has stopped its workers


#: What an epoch's report carries about the run rather than the epoch: not history.
_RUN_KEYS = (
    "val_total",
    "best_val_accuracy",
    "resumed_from_epoch",
    "started_at",
    "workers",
    "checkpoint",
)


def epoch_entry(metrics: dict) -> dict:
    """An epoch's report as one entry of the run's history."""
    return {k: v for k, v in metrics.items() if k not in _RUN_KEYS}


class RunMonitor:
    """Drains ``channel`` from a thread every ``poll_s`` seconds and hands what it carries to
    ``on_event`` as events: rank 0's progress (worker-group starts, the first step, steps
    within an epoch) and the epochs as they commit (each also to ``on_epoch``: TensorBoard,
    MLflow). Builds the run's history (the epochs before a resume, from its checkpoint, and
    those seen now) and its record of worker-group restarts and resizes. ``started`` is the
    ``time.perf_counter()`` the phases' elapsed seconds count from. Use it as a context
    manager: what is left in the channel is drained on exit."""

    def __init__(
        self,
        channel,
        epochs: int,
        prior: list[dict],
        on_event: EventSink,
        started: float,
        on_epoch: Callable[[dict], Any] | None = None,
        poll_s: float = 0.5,
    ) -> None:
        self.channel, self.epochs = channel, epochs
        self.on_event, self.on_epoch = on_event, on_epoch
        self.started, self.poll_s = started, poll_s
        self.prior = [epoch_entry(h) for h in prior]
        self.seen: list[dict] = []
        self.restarts = 0  # worker-group restarts seen (after a failure, or a resize)
        #: Each change of the world size: {"from", "to", "at_epoch"} (the first epoch the
        #: new size trains).
        self.resizes: list[dict] = []
        self._group: tuple | None = None  # (started_at, world size) of the current group
        self._first_step = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="RunMonitor", daemon=True)

    def __enter__(self) -> RunMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._flush()

    @property
    def history(self) -> list[dict]:
        """One entry per epoch; an epoch trained again after a restart counts once."""
        by_epoch = {h["epoch"]: h for h in self.prior}
        by_epoch.update({m["epoch"]: epoch_entry(m) for m in self.seen})
        return [by_epoch[e] for e in sorted(by_epoch)]

    def _phase(self, text: str) -> None:
        self.on_event(Phase(text, time.perf_counter() - self.started))

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._flush()

    def _flush(self) -> None:
        import ray

        if not ray.is_initialized():  # a call now would start a new Ray of its own
            return
        try:
            items = ray.get(self.channel.drain.remote(), timeout=10)
        except Exception:  # the cluster is going away; what was shown stays shown
            return
        for m in items:
            kind = m.get("progress")
            if kind == "step":
                self.on_event(StepProgress(m, self.epochs))
                continue
            # Each worker-group start stamps its reports (rank 0 also announces it before its
            # first epoch): a new stamp is a new group, after a failure or a resize.
            self._group_started(m)
            if kind == "first_step":
                if not self._first_step:
                    self._first_step = True
                    self._phase("first step")
            elif kind is None:  # a committed epoch
                self.seen.append(m)
                self.on_event(EpochCommitted(m, self.epochs))
                if self.on_epoch is not None:
                    self.on_epoch(m)

    def _group_started(self, m: dict) -> None:
        started_at, size = m.get("started_at"), m.get("world_size")
        if started_at is None or (self._group and self._group[0] == started_at):
            return
        previous, self._group = self._group, (started_at, size)
        resumed = m.get("resumed_from_epoch") or 0
        if previous is None:
            if resumed:
                self.on_event(Note(f"resumed from the checkpoint of epoch {resumed}"))
            if m.get("progress") == "ready":
                self._phase(f"{size} worker(s) started")
            return
        self.restarts += 1
        if size is not None and previous[1] is not None and size != previous[1]:
            self.resizes.append({"from": previous[1], "to": size, "at_epoch": resumed + 1})
            self.on_event(Note(f"workers {previous[1]} → {size} at epoch {resumed + 1}"))
        else:
            self.on_event(Note(f"workers restarted from the checkpoint of epoch {resumed}"))
