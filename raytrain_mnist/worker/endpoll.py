"""Rank 0 asks Ray Train's controller to poll fast near the run's end.

The controller polls the workers every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` (Ray's 2 s); a
report is committed at the poll after it, and the run's end is seen one poll later still. So
rank 0 has it poll every :data:`END_POLL_S` for the run's last moments
(``compat.poll_workers_every``). The controller takes a new interval only after the wait it
is in: asked at the last evaluation, a wait begun just before was still running when the last
report came, and the commit waited out its rest (0.02-1.5 s, 2026-12-04). Asked once the
training left is expected to take less than an interval (and a margin), that wait is over
before the last report.
"""

from __future__ import annotations

import os
import time

from raytrain_mnist import compat

#: Seconds between the controller's polls for the run's last moments (Ray's 2 s otherwise:
#: polling this often all along costs training throughput, benchmarks/README.md).
END_POLL_S = 0.1
#: Ray's own interval, which a service's next request starts at again.
SLOW_POLL_S = float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2"))
#: Asked this much earlier than an interval before the end: step times vary.
MARGIN_S = 0.5


class EndPoll:
    """Rank 0's per-step check (:meth:`on_step`) for when to ask; :meth:`now` asks at once
    (the last evaluation's fallback). Asks once."""

    def __init__(self, steps_per_epoch: int, interval_s: float | None = None) -> None:
        if interval_s is None:
            interval_s = SLOW_POLL_S
        self.steps_per_epoch, self.interval_s = steps_per_epoch, interval_s
        self.asked = False
        self._epochs_after = 0
        self._since: tuple[float, int] | None = None  # (perf_counter, steps) at the first step

    def epoch_start(self, epochs_after: int) -> None:
        """An epoch begins; ``epochs_after`` more follow it."""
        self._epochs_after, self._since = epochs_after, None

    def on_step(self, steps: int, sums=None) -> None:
        if self.asked:
            return
        now = time.perf_counter()
        if self._since is None:
            self._since = (now, steps)
            return
        began, first = self._since
        per_step = (now - began) / max(steps - first, 1)
        left = (self.steps_per_epoch - steps) + self._epochs_after * self.steps_per_epoch
        if left * per_step <= self.interval_s + MARGIN_S:
            self.now()

    def now(self) -> None:
        if not self.asked:
            self.asked = True
            compat.poll_workers_every(END_POLL_S)
