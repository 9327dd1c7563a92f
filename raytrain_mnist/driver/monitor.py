"""How a run's progress reaches the driver while it trains: the transport behind ``fit``.

Three pieces, one per process that takes part:

* :class:`RunChannel`, a small actor on the driver's node. Rank 0's
  :class:`~raytrain_mnist.worker.feed.ProgressFeed` puts its stream there (``ready``,
  ``first_step``, ``step``), the Train controller puts each committed epoch and its own
  handle, pickled (to abort the run on Ctrl-C). Nothing waits on the driver: every put is
  fire and forget.
* :func:`controller_callbacks`, the callbacks that run on the Train controller and feed it.
* :class:`RunMonitor`, a thread in the driver that drains the channel a few times a second
  and turns what arrives into :mod:`~raytrain_mnist.driver.events` for a sink. It also
  builds what the summary needs: the history, the worker-group restarts and resizes.

The items are plain dicts. Rank 0's carry ``progress`` (its kind), and its ``ready`` carries
``world_size``, ``started_at`` (which worker-group start it came from) and
``resumed_from_epoch``; a committed epoch is the epoch's report (no ``progress`` key) with
its ``checkpoint`` path and ``committed_at``. The controller's carry ``progress:
"controller"`` and a ``moment`` (``controller_started``, ``worker_group_started``, ``state``
changes, ``controller_finished``) with ``at``. The channel stamps every item with
``received`` (its own clock, on the driver's node).

The same items make the run's timeline (:class:`Timeline`): every moment of start-up and
teardown on the driver's clock. The controller runs on the driver's node (Ray puts it
there), so its ``time.time()`` is the driver's. A worker's stamps are its own clock's: on the
driver's node they are used as they are; on another node they are shifted by the offset its
``ready`` message showed (the channel's ``received`` minus the worker's ``at``), which puts
them at most one message's transit (milliseconds on a LAN) late and never early.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

from raytrain_mnist import compat
from raytrain_mnist.driver import preemptions
from raytrain_mnist.driver.events import (
    STARTUP,
    TEARDOWN,
    EpochCommitted,
    EventSink,
    Note,
    Phase,
    Preempted,
    StepProgress,
)

logger = logging.getLogger(__name__)


class RunChannel:
    """The actor that carries a run's stream from the Train controller and rank 0 to the
    driver: committed epochs, rank 0's progress, and the controller's handle. Start it with
    :func:`start_channel`."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.dropped = 0  # items before self.items[0]: acknowledged and dropped
        self.controller = None

    def put(self, item: dict) -> None:
        item["received"] = time.time()  # the driver's node's clock: the timeline's offsets
        self.items.append(item)

    def set_controller(self, pickled: bytes) -> None:
        # Kept pickled: unpickling an actor's handle imports its class's module, and the
        # controller's is Ray Train's whole package (pandas and Ray Data included): seconds
        # of CPU in this process, for a handle only the driver ever calls.
        self.controller = pickled

    def get_controller(self) -> bytes | None:
        return self.controller

    def drain(self, acknowledged: int = 0) -> tuple[int, list[dict]]:
        """Drop the first ``acknowledged`` items ever put (the reader has handled them) and
        return (the number dropped, the items kept). Nothing is dropped before the reader
        says it has it: a read that timed out on a loaded machine loses nothing."""
        if acknowledged > self.dropped:
            del self.items[: acknowledged - self.dropped]
            self.dropped = acknowledged
        return self.dropped, list(self.items)


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
    from ray.train import UserCallback

    def moment(name: str, **item) -> None:
        channel.put.remote({"progress": "controller", "moment": name, "at": time.time(), **item})

    class EpochFeed(UserCallback):
        """After every rank has reported an epoch and its checkpoint is committed."""

        def after_report(self, run_context, metrics, checkpoint):
            channel.put.remote(
                {
                    **metrics[0],
                    "checkpoint": checkpoint.path if checkpoint else None,
                    "committed_at": time.time(),
                }
            )

    callbacks: list = [EpochFeed()]
    # The controller's handle: a public hook for it does not exist in Ray 2.60.
    ControllerCallback = compat.controller_callback_base()
    if ControllerCallback is not None:

        class ControllerFeed(ControllerCallback):
            def after_controller_start(self, train_run_context):
                moment("controller_started")
                announce_controller(channel)

            def after_controller_state_update(self, previous_state, current_state):
                moment("state", to=type(current_state).__name__)

            def after_controller_finish(self, result):
                moment("controller_finished")

        callbacks.append(ControllerFeed())
    WorkerGroupCallback = compat.worker_group_callback_base()
    if WorkerGroupCallback is not None:

        class WorkerGroupFeed(WorkerGroupCallback):
            def before_init_train_context(self, workers):
                # The worker actors are up (each has imported torch and Ray Train); Ray
                # forms their process group next.
                moment("worker_group_started", world_size=len(workers))
                return {}

        callbacks.append(WorkerGroupFeed())
    return callbacks


def announce_controller(channel) -> None:
    """Put the calling actor's handle (the Train controller's) in ``channel``, pickled: the
    channel keeps it as bytes, which :func:`abort_run` unpickles on the driver."""
    import ray

    channel.set_controller.remote(pickle.dumps(ray.get_runtime_context().current_actor))


def abort_run(channel, is_running: Callable[[], bool]) -> None:
    """Stop the run ``channel`` serves by aborting its controller, as Ray's own SIGINT
    handler would: its workers stop, the committed checkpoints stay. Interrupted while the
    controller was starting, wait for it to announce itself (while ``is_running()``)."""
    import ray

    pickled = None
    for _ in range(60):
        pickled = ray.get(channel.get_controller.remote(), timeout=30)
        if pickled is not None or not is_running():
            break
        time.sleep(0.5)
    if pickled is not None:
        controller = pickle.loads(pickled)  # a handle pickled out of band, as Ray allows
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


class Timeline:
    """The moments of a run's start-up and teardown (:data:`~.events.STARTUP`,
    :data:`~.events.TEARDOWN`), as unix times on the driver's clock, and their seconds since
    ``t0`` (the command's start). A start-up moment keeps its first time (a restarted worker
    group does not move it), a teardown moment its last."""

    def __init__(self, t0: float, t0_is: str) -> None:
        self.t0, self.t0_is = t0, t0_is
        self.at: dict[str, float] = {}

    def mark(self, key: str, at: float | None = None) -> float:
        """Record moment ``key`` (now, or at unix time ``at``); returns its seconds since t0."""
        at = time.time() if at is None else at
        if key in STARTUP:
            self.at.setdefault(key, at)
        elif key in TEARDOWN:
            self.at[key] = at
        else:
            raise KeyError(key)
        return self.at[key] - self.t0

    def seconds(self, key: str) -> float | None:
        return None if key not in self.at else self.at[key] - self.t0

    def to_dict(self, clock: str = "") -> dict[str, Any]:
        """``summary.json``'s ``timeline``: ``t0`` (unix time) and what it is, ``startup_s``
        and ``teardown_s`` (each moment's seconds since t0, in order; a moment not reached
        is absent), and how the workers' clock was put on the driver's (``clock``)."""

        def part(keys) -> dict[str, float]:
            return {k: round(self.at[k] - self.t0, 3) for k in keys if k in self.at}

        return {
            "t0": self.t0,
            "t0_is": self.t0_is,
            "startup_s": part(STARTUP),
            "teardown_s": part(TEARDOWN),
            "worker_clock": clock,
        }


class RunMonitor:
    """Drains ``channel`` from a thread every ``poll_s`` seconds and hands what it carries to
    ``on_event`` as events: rank 0's progress (worker-group starts, the first step, steps
    within an epoch) and the epochs as they commit (each also to ``on_epoch``: TensorBoard,
    MLflow). Builds the run's history (the epochs before a resume, from its checkpoint, and
    those seen now) and its record of worker-group restarts and resizes. The moments it
    sees (the controller's, rank 0's) go into ``timeline``, whose ``t0`` the phases' elapsed
    seconds count from. Use it as a context manager: what is left in the channel is drained
    on exit."""

    def __init__(
        self,
        channel,
        epochs: int,
        prior: list[dict],
        on_event: EventSink,
        timeline: Timeline,
        on_epoch: Callable[[dict], Any] | None = None,
        poll_s: float = 0.5,
    ) -> None:
        import ray

        self.channel, self.epochs = channel, epochs
        self.on_event, self.on_epoch = on_event, on_epoch
        self.timeline, self.poll_s = timeline, poll_s
        self._node = ray.get_runtime_context().get_node_id()
        self._offset = 0.0  # the current worker group rank 0's clock, to the driver's
        #: How the workers' stamps were put on the driver's clock.
        self.clock = "rank 0 on the driver's node: the same clock"
        self._shown: set[str] = set()
        self._handled = 0  # items of the channel handled
        self.prior = [epoch_entry(h) for h in prior]
        self.seen: list[dict] = []
        self.restarts = 0  # worker-group restarts seen (after a failure, or a resize)
        #: Each change of the world size: {"from", "to", "at_epoch"} (the first epoch the
        #: new size trains).
        self.resizes: list[dict] = []
        self._group: tuple | None = None  # (started_at, world size) of the current group
        #: The preemptions seen: summary.json's ``preemptions``.
        self.preemptions = preemptions.PreemptionLog()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="RunMonitor", daemon=True)

    def __enter__(self) -> RunMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        # To its end (its drain's ray.get times out after 10 s): a thread of ours still in
        # Ray when the Ray it uses shuts down can take the process with it.
        self._thread.join()
        self._flush()
        # The controller's last moments are sent as it finishes: they can reach the channel
        # just after trainer.fit() returned.
        for _ in range(10):
            if self._ended or not self._flush():
                break
            time.sleep(0.05)

    @property
    def _ended(self) -> bool:
        return "controller_finished" in self.timeline.at or "controller" not in self._shown

    @property
    def history(self) -> list[dict]:
        """One entry per epoch; an epoch trained again after a restart counts once."""
        by_epoch = {h["epoch"]: h for h in self.prior}
        by_epoch.update({m["epoch"]: epoch_entry(m) for m in self.seen})
        return [by_epoch[e] for e in sorted(by_epoch)]

    def _phase(self, key: str, text: str, at: float | None) -> None:
        """Moment ``key`` at ``at`` (driver clock) into the timeline; its phase line (once)."""
        if at is None or at < self.timeline.t0:  # a warm service's: before this command
            return
        elapsed = self.timeline.mark(key, at)
        if key in STARTUP and key not in self._shown:
            self._shown.add(key)
            self.on_event(Phase(text, elapsed))

    def _mark(self, key: str, at: float | None) -> None:
        if at is not None:
            self.timeline.mark(key, at)

    def _worker_time(self, at: float | None) -> float | None:
        return None if at is None else at + self._offset

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._flush()

    def _flush(self) -> bool:
        """Drain the channel once; False when it could not be asked."""
        import ray

        if not ray.is_initialized():  # a call now would start a new Ray of its own
            return False
        try:
            dropped, items = ray.get(self.channel.drain.remote(self._handled), timeout=10)
        except Exception:  # a loaded machine, or the cluster is going away: asked again
            return False
        new = items[self._handled - dropped :]
        self._handled = dropped + len(items)
        for m in new:
            kind = m.get("progress")
            if kind == "step":
                self.on_event(StepProgress(m, self.epochs))
                continue
            if kind == "controller":
                self._controller_moment(m)
                continue
            if kind in preemptions.KINDS:
                line = self.preemptions.handle(m)
                if line is not None:
                    self.on_event(Preempted(line))
                if kind != "checkpoint":  # a committed checkpoint also marks its group
                    continue
            if kind == "ready":
                self._clock_of(m)
            # Each worker-group start stamps its reports (rank 0 also announces it before its
            # first epoch): a new stamp is a new group, after a failure or a resize.
            self._group_started(m)
            if kind == "ready":
                backend = m.get("backend")
                self._phase(
                    "process_group_formed",
                    "process group formed" + (f" ({backend})" if backend else ""),
                    self._worker_time(m.get("started_at")),
                )
                self._phase(
                    "model_prepared", "model prepared", self._worker_time(m.get("prepared_at"))
                )
            elif kind == "first_step":
                self._phase("first_step", "first step", self._worker_time(m.get("at")))
            elif kind is None:  # a committed epoch
                self.seen.append(m)
                self._mark("last_report", self._worker_time(m.get("evaluated_at")))
                self._mark("checkpoint_committed", m.get("committed_at"))
                self.on_event(EpochCommitted(m, self.epochs))
                if self.on_epoch is not None:
                    self.on_epoch(m)
        return True

    def _clock_of(self, m: dict) -> None:
        """Rank 0's clock of this worker group, from its ``ready`` message."""
        if m.get("node_id") in (None, self._node) or "received" not in m:
            self._offset = 0.0
            self.clock = "rank 0 on the driver's node: the same clock"
        else:
            self._offset = m["received"] - m["at"]
            self.clock = (
                f"rank 0 on another node: its stamps + {self._offset:+.3f} s (the channel's "
                "receipt of its ready message minus its send time: at most that message's "
                "transit late)"
            )

    def _controller_moment(self, m: dict) -> None:
        """A moment the Train controller sent (its clock is the driver's)."""
        self._shown.add("controller")
        moment, at = m.get("moment"), m.get("at")
        if moment == "controller_started":
            self._phase("controller_started", "controller started", at)
        elif moment == "worker_group_started":
            self._phase("worker_group_started", f"{m.get('world_size')} worker(s) started", at)
        elif moment == "controller_finished":
            self._mark("controller_finished", at)
        elif moment == "state":
            state = m.get("to")
            if state == "ShuttingDownState":
                self._mark("workers_finished", at)
            elif state in ("FinishedState", "ErroredState", "AbortedState"):
                self._mark("worker_group_shut_down", at)

    def _group_started(self, m: dict) -> None:
        started_at, size = m.get("started_at"), m.get("world_size")
        if started_at is None or (self._group and self._group[0] == started_at):
            return
        previous, self._group = self._group, (started_at, size)
        resumed = m.get("resumed_from_epoch") or 0
        if previous is None:
            if text := preemptions.resume_text(m):
                self.on_event(Note(text))
            if m.get("progress") == "ready" and "worker_group_started" not in self._shown:
                # Without the controller's moment (a Ray whose callback class moved).
                self._shown.add("worker_group_started")
                at = self._worker_time(m.get("at")) or time.time()
                self.on_event(Phase(f"{size} worker(s) started", at - self.timeline.t0))
            return
        self.restarts += 1
        after_preemption = self.preemptions.resumed(m) if m.get("progress") == "ready" else None
        resized = size is not None and previous[1] is not None and size != previous[1]
        if resized:
            self.resizes.append({"from": previous[1], "to": size, "at_epoch": resumed + 1})
            step = f", step {m['resumed_from_step']}" if m.get("resumed_from_step") else ""
            self.on_event(Note(f"workers {previous[1]} → {size} at epoch {resumed + 1}{step}"))
        if after_preemption is not None:  # an elastic run's too: it says the size differs
            self.on_event(Preempted(after_preemption))
        elif resized:
            return  # the resize's line said it
        elif m.get("resumed_from_step"):
            self.on_event(
                Note(
                    f"workers restarted from the checkpoint at step "
                    f"{m['resumed_from_step']} of epoch {resumed + 1}"
                )
            )
        else:
            self.on_event(Note(f"workers restarted from the checkpoint of epoch {resumed}"))
