"""Just-in-time checkpoints when a node that hosts a rank is being preempted.

Ray Train's preemption watcher polls Ray's drain state and tells every worker when one of
the run's nodes is drained for preemption (a spot reclaim: ``ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N``); the controller then waits
until the deadline and restarts the worker group from the latest committed checkpoint,
charging ``FailureConfig.max_preemption_failures``. A drain for idle termination is refused
while the node runs a rank, so it never gets here.

:class:`JustInTime` is the loop's side. Every rank calls :meth:`JustInTime.after_step`
after every step; at the steps all ranks agree on, each calls
``ray.train.get_preemption_info()`` (a barrier: every rank, the same number of times). The
cadence is rank 0's: about one check every :data:`CHECK_EVERY_S` seconds of training, in
steps, the next check's step sent to every rank with the check, so ranks never disagree and
a fast device does not check every step. When the answer is a preemption:

1. rank 0 writes a checkpoint at that step (mid-epoch) and every rank reports it; training
   goes on;
2. from then on rank 0 decides at every step whether the next step could still be
   committed before the deadline; at the last one it writes the final checkpoint, and every
   rank holds (no more steps) until Ray ends the worker group. Nothing trained after the
   final checkpoint is lost, because nothing is trained after it.

Rank 0 tells the driver through its progress feed: ``preemption`` (seen), ``preempt_step``
(every step trained during the notice), ``holding`` (the final checkpoint reported).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: About how often the ranks check for a preemption, in seconds of training. Ray's watcher
#: polls the drain state every 5 s (RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S): checking much
#: more often only adds barriers.
CHECK_EVERY_S = 2.0
#: Ray Train's own wait when a drain names no deadline
#: (ray.train.v2._internal.constants.DEFAULT_PREEMPTION_DEADLINE_S in Ray 2.60).
NO_DEADLINE_S = 120.0
#: The most steps between two checks, whatever the step time.
MAX_EVERY_STEPS = 10_000
#: Sets the cadence instead of CHECK_EVERY_S, in seconds of training: for a provider whose
#: notice is short, or a watcher polled more often (the driver forwards it to the workers).
CHECK_EVERY_ENV = "RAYTRAIN_MNIST_PREEMPTION_CHECK_S"


def check_every_s() -> float:
    """The cadence: $RAYTRAIN_MNIST_PREEMPTION_CHECK_S when it is a positive number of
    seconds, else :data:`CHECK_EVERY_S` (with a warning when it is set but not a number)."""
    text = os.environ.get(CHECK_EVERY_ENV)
    if text is None:
        return CHECK_EVERY_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if math.isfinite(value) and value > 0:
        return value
    logger.warning(
        "%s=%r is not a positive number of seconds; checking every %.0f s",
        CHECK_EVERY_ENV,
        text,
        CHECK_EVERY_S,
    )
    return CHECK_EVERY_S


def _broadcast_int(value: int, world_size: int, device: torch.device) -> int:
    """Rank 0's ``value`` on every rank (one small collective, on the process group's
    ``device``: NCCL takes only CUDA tensors; nothing with one rank)."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def commit_latency_s() -> float:
    """How long the controller may take to commit a reported checkpoint: one poll of its
    workers (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, Ray's default 2 s), and a poll's own time."""
    try:
        interval = float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2"))
    except ValueError:
        interval = 2.0
    return interval + 0.5


class JustInTime:
    """The preemption checks and just-in-time checkpoints of one worker group.

    ``save(step, sums, final)`` writes (rank 0) and reports (every rank) a checkpoint at
    ``step`` of the current epoch, ``sums`` this rank's running sums (``on_step``'s), the last
    before the deadline when ``final``, and returns. ``check`` is
    ``ray.train.get_preemption_info`` (a stand-in in tests). ``send(kind, **item)`` is rank
    0's progress feed (a no-op elsewhere). ``clock`` is ``time.time``: the deadline Ray
    reports is unix time. ``device``: where the process group's collectives run.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        save: Callable[[int, torch.Tensor, bool], None],
        check: Callable[[], object],
        send: Callable[..., None] = lambda kind, **item: None,
        every_s: float | None = None,
        clock: Callable[[], float] = time.time,
        device: torch.device = torch.device("cpu"),
    ) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self._save, self._check, self._send = save, check, send
        self.every_s = check_every_s() if every_s is None else every_s
        self._clock = clock
        self.steps = 0  # steps this worker group has trained
        self._next = 1  # the step of the next check: the group's first
        self._checked_at_step = 0  # self.steps at the last check
        self._since = time.perf_counter()  # when the last check ended
        self._last_step_at: float | None = None
        self._step_s = 0.0  # the last step's seconds, during a notice
        self.check_s: list[float] = []  # each check's seconds, on this rank
        self.info = None  # the PreemptionInfo seen, once seen
        self.deadline: float | None = None  # unix time the node goes
        self._margin_s = 0.0
        self.epoch = 0  # set by the loop: completed epochs (for the feed's messages)
        self._sums: torch.Tensor | None = None

    @property
    def on_step(self) -> Callable[[int, torch.Tensor], None]:
        return self.after_step

    def after_step(self, step: int, sums: torch.Tensor) -> None:
        """After each step on every rank: ``step`` is the steps of this epoch done."""
        self.steps += 1
        self._sums = sums
        if self.info is not None:
            self._during_notice(step)
        elif self.steps >= self._next:
            self._check_now(step)

    def _check_now(self, step: int) -> None:
        trained_s = time.perf_counter() - self._since
        began = time.perf_counter()
        info = self._check()
        self.check_s.append(time.perf_counter() - began)
        if info is not None:
            self._seen(info, step)
            return
        per_step = trained_s / max(self.steps - self._checked_at_step, 1)
        self._checked_at_step = self.steps
        every = min(MAX_EVERY_STEPS, max(1, math.ceil(self.every_s / max(per_step, 1e-6))))
        self._next = self.steps + _broadcast_int(every, self.world_size, self.device)
        self._since = time.perf_counter()

    def _seen(self, info, step: int) -> None:
        """A preemption: the first checkpoint now, unless the deadline is already too near
        (then this one is the final one)."""
        self.info = info
        now = self._clock()
        deadline_ms = getattr(info, "deadline_ms", None)
        self.deadline = deadline_ms / 1000 if deadline_ms else now + NO_DEADLINE_S
        nodes = dict(getattr(info, "preempted_node_to_ranks", {}) or {})
        if self.rank == 0:
            logger.warning(
                "node(s) %s hosting rank(s) %s preempted: %.1f s left; checkpointing at "
                "step %d of epoch %d",
                ", ".join(n[:12] for n in nodes),
                sorted({r for ranks in nodes.values() for r in ranks}),
                self.deadline - now,
                step,
                self.epoch + 1,
            )
        self._send(
            "preemption",
            nodes=nodes,
            deadline_s=round(self.deadline - now, 3),
            epoch=self.epoch + 1,
            step=step,
        )
        began = time.perf_counter()
        final = self._final_due(step, probe=True)
        self._save(step, self._sums, final)
        save_s = time.perf_counter() - began
        # The last checkpoint must be committed before the deadline: its own save and
        # report, the controller's poll that commits it, and a step or two of slack.
        self._margin_s = 2 * save_s + commit_latency_s() + 1.0
        self._last_step_at = time.perf_counter()
        if final:
            self._hold(step)

    def _final_due(self, step: int, probe: bool = False) -> bool:
        """Rank 0's word, on every rank: is this the last step that can still be committed?"""
        due = 0
        if self.rank == 0:
            margin = self._margin_s or commit_latency_s() + 1.0
            due = int(self._clock() + margin + (0 if probe else self._step_s) >= self.deadline)
        return bool(_broadcast_int(due, self.world_size, self.device))

    def _during_notice(self, step: int) -> None:
        now = time.perf_counter()
        self._step_s = now - (self._since if self._last_step_at is None else self._last_step_at)
        self._last_step_at = now
        self._send("preempt_step", epoch=self.epoch + 1, step=step)
        if self._final_due(step):
            self._save(step, self._sums, True)
            self._hold(step)

    def _hold(self, step: int) -> None:
        """Train no further: what the final checkpoint holds is all the worker group will
        have done when Ray ends it at the deadline."""
        self._send("holding", epoch=self.epoch + 1, step=step)
        if self.rank == 0:
            logger.warning(
                "final checkpoint at step %d of epoch %d; waiting for the node to go",
                step,
                self.epoch + 1,
            )
        while True:  # Ray stops this worker group at the deadline (or when the node goes)
            time.sleep(1.0)

    def end_epoch(self) -> dict[str, float]:
        """The loop evaluated an epoch (that time is not a step's): the checks of the epoch
        on this rank, ``preemption_checks`` and their ``preemption_check_s``."""
        self._since = time.perf_counter()
        self._last_step_at = None
        checks, self.check_s = self.check_s, []
        return {"preemption_checks": len(checks), "preemption_check_s": sum(checks)}
