"""The search's placement-group reaper: from a thread of the driver while trials run, it
removes the worker placement groups that ended trials leave behind (ray-project/ray#54305),
and says so when a trial's workers wait longer than a bound to be placed."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from raytrain_mnist import compat

logger = logging.getLogger(__name__)

#: Seconds a trial's workers may wait to be placed before the search stops and says what
#: holds the cluster (an autoscaler adding a node takes minutes; a leaked group, for ever).
PLACEMENT_TIMEOUT_S = float(os.environ.get("RAYTRAIN_MNIST_PLACEMENT_TIMEOUT_S", 300))
#: The states of a group that waits for resources.
WAITING = ("PENDING", "RESCHEDULING")


@dataclass
class PlacementWatch:
    """Which creators (Train controllers) have waited longer than ``bound_s`` for a group to
    be placed. A controller whose workers cannot start removes its group and asks for a new
    one every ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, so the wait is the creator's, not
    one group's: it ends when the creator has a group placed, or when the creator has had
    no group at all for two looks in a row (it ended; a single look may fall between a
    removal and the next request)."""

    bound_s: float
    since: dict[str, float] = field(default_factory=dict)  # creator -> first seen waiting
    _absent: set[str] = field(default_factory=set)  # creators with no group at the last look

    def update(self, groups: list[dict], now: float) -> list[str]:
        """Take one look at ``groups`` (this job's, :func:`compat.placement_groups`); return
        the creators waiting longer than the bound."""
        states: dict[str, set[str]] = {}
        for group in groups:
            if group["creator"] is not None and not group["orphaned"]:
                states.setdefault(group["creator"], set()).add(group["state"])
        for creator in list(self.since):
            seen = states.get(creator, set())
            gone = not seen and creator in self._absent
            if "CREATED" in seen or gone:
                del self.since[creator]
        self._absent = {c for c in self.since if c not in states}
        for creator, seen in states.items():
            if seen & set(WAITING) and "CREATED" not in seen:
                self.since.setdefault(creator, now)
        return [c for c, t in self.since.items() if now - t > self.bound_s]


def held_by(groups: list[dict], waiting: list[str], bound_s: float) -> str:
    """One line: what the waiting workers ask for, and the placed groups that hold the
    cluster's resources (``groups``: every job's, :func:`compat.placement_groups`)."""
    import ray

    asks = [g for g in groups if g["creator"] in waiting and g["state"] in WAITING]
    ask = _bundles(asks[0]["bundles"]) if asks else "resources"
    placed = [g for g in groups if g["state"] == "CREATED"]
    holders = "; ".join(
        f"{g['id'][:12]} {_bundles(g['bundles'])} (job {g['job']}, "
        f"{'its creator dead' if g['orphaned'] else 'in use'})"
        for g in placed
    )
    return (
        f"a trial's workers could not be placed for {bound_s:.0f} s: they ask {ask}; the "
        f"cluster has {_resources(ray.cluster_resources())}, "
        f"{_resources(ray.available_resources())} free; placement groups holding it: "
        f"{holders or 'none'}. Free those resources (or lower --max-concurrent-trials or "
        "--num-workers) and run the search again: it resumes"
    )


def _resources(resources: dict) -> str:
    shown = {k: round(v, 2) for k, v in resources.items() if k in ("CPU", "GPU") and v}
    return ", ".join(f"{v:g} {k}" for k, v in sorted(shown.items())) or "nothing"


def _bundles(bundles: list[dict]) -> str:
    if not bundles:
        return "no resources"
    return f"{len(bundles)} x {{{_resources(bundles[0])}}}"


class PlacementGroupReaper:
    """Removes the placement groups of this job whose creator died, and watches the ones
    that wait, from a thread of the driver while the search runs.

    When Tune ends a trial (ASHA stops it, or it finishes) it kills the trial's actor, and
    the Train controller that actor owns dies with it. The GCS keeps a group its creator
    made until the creator's job ends too, and Ray Train's cleaner removes only the group
    the controller registered with it: one the controller asked for as it was killed (its
    log: the request 0.2 s after the next trial's own) was never registered, has no worker
    in it, and held one of a 2-CPU cluster's CPUs until the search ended, so the next trial
    waited for ever (2026-12-06). The GCS knows every group's creator, whatever state the
    trial was in: a group of this job whose creator is dead is removed. The groups Tune
    makes for its trials are the driver's, never touched.

    A trial whose workers wait longer than ``bound_s`` calls ``on_stalled`` once with one
    line that says what holds the cluster.
    """

    def __init__(
        self,
        on_stalled: Callable[[str], None] = lambda line: None,
        every_s: float = 1.0,
        bound_s: float = PLACEMENT_TIMEOUT_S,
    ) -> None:
        self.every_s = every_s
        self.removed: list[str] = []
        self.stalled: str | None = None
        self._on_stalled = on_stalled
        self._watch = PlacementWatch(bound_s)
        self._blind = False  # already said that the GCS cannot be read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="placement-reaper", daemon=True)

    def __enter__(self) -> PlacementGroupReaper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check()
            except Exception as exc:  # the next look may answer; say it once
                self._cannot_tell(f"{type(exc).__name__}: {exc}")

    def check(self, now: float | None = None) -> None:
        """One look: remove this job's orphaned groups; note a wait past the bound."""
        import ray

        groups = compat.placement_groups()
        if groups is None:
            self._cannot_tell("the GCS's placement-group table cannot be read")
            return
        job = ray.get_runtime_context().get_job_id()
        ours = [g for g in groups if g["job"] == job]
        for group in ours:
            if group["orphaned"] and group["id"] not in self.removed:
                self._remove(group["id"])
        waiting = self._watch.update(ours, time.monotonic() if now is None else now)
        if waiting and self.stalled is None:
            self.stalled = held_by(groups, waiting, self._watch.bound_s)
            self._on_stalled(self.stalled)

    def _remove(self, pg_id: str) -> None:
        import ray
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
        self.removed.append(pg_id)
        logger.info("removed placement group %s: its creator (a Train controller) died", pg_id)

    def _cannot_tell(self, why: str) -> None:
        if not self._blind:
            self._blind = True
            logger.warning("the search cannot remove ended trials' placement groups: %s", why)
