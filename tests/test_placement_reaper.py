"""The search's placement-group reaper (driver/searching/reaper.py): a group whose creator
(a trial's Train controller) died is removed whatever state it was in, a live creator's is
never touched, and workers that wait past the bound are reported with what holds the
cluster. The watch's bookkeeping is tested without Ray; the reaper on the shared Ray, with
a plain actor standing in for the controller, stopped at each stage of a run's start."""

from __future__ import annotations

import pytest

from raytrain_mnist.driver.searching.reaper import PlacementGroupReaper, PlacementWatch
from tests.conftest import wait_for


def group(creator: str | None, state: str, orphaned: bool = False, pg: str = "pg") -> dict:
    return {
        "id": pg,
        "job": "01000000",
        "state": state,
        "bundles": [{"CPU": 1.0}],
        "creator": creator,
        "detached": False,
        "orphaned": orphaned,
    }


# --------------------------------------------------------------------------- the watch


def test_a_creator_waiting_past_the_bound_is_named_once_its_wait_exceeds_it():
    watch = PlacementWatch(bound_s=10)
    assert watch.update([group("a", "PENDING")], now=0) == []
    assert watch.update([group("a", "PENDING", pg="p2")], now=10) == []  # at the bound
    assert watch.update([group("a", "PENDING", pg="p3")], now=10.5) == ["a"]


def test_the_wait_is_the_creators_across_its_groups_and_one_look_without_any():
    """Train removes a group that did not start in time and asks for a new one: the wait
    goes on. A look that falls between the removal and the new request does not end it."""
    watch = PlacementWatch(bound_s=10)
    watch.update([group("a", "PENDING", pg="p1")], now=0)
    watch.update([], now=4)  # between two of its groups
    assert watch.update([group("a", "PENDING", pg="p2")], now=11) == ["a"]


def test_a_placed_group_or_a_creator_gone_for_two_looks_ends_the_wait():
    watch = PlacementWatch(bound_s=10)
    watch.update([group("a", "PENDING"), group("b", "PENDING")], now=0)
    watch.update([group("a", "CREATED")], now=1)  # a placed; b not seen once
    watch.update([], now=2)  # b not seen twice: it ended
    assert watch.since == {}
    assert watch.update([group("a", "PENDING")], now=50) == []  # a new wait starts afresh


def test_drivers_groups_and_orphans_are_not_waits():
    """Tune's own trial groups are the driver's (no creator); an orphan is the reaper's to
    remove, not a trial that waits."""
    watch = PlacementWatch(bound_s=1)
    watch.update([group(None, "PENDING"), group("a", "PENDING", orphaned=True)], now=0)
    assert watch.update([group(None, "PENDING"), group("a", "PENDING", orphaned=True)], 9) == []


# --------------------------------------------------------------------------- on Ray


@pytest.fixture
def controller(ray_local):
    """A stand-in for a Train controller: an actor that creates a placement group and,
    when asked, places a worker actor of its own in it (as the controller does)."""
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Worker:
        def ready(self) -> bool:
            return True

    @ray.remote(num_cpus=0)
    class Controller:
        def group(self, cpus: float, wait: bool) -> str:
            from ray.util.placement_group import placement_group

            self.pg = placement_group([{"CPU": cpus}])
            if wait:
                ray.get(self.pg.ready(), timeout=60)
            return self.pg.id.hex()

        def place_worker(self) -> bool:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg)
            self.worker = Worker.options(num_cpus=1, scheduling_strategy=strategy).remote()
            return ray.get(self.worker.ready.remote(), timeout=60)

    made = []

    def start():
        made.append(Controller.remote())
        return made[-1]

    yield start
    for actor in made:
        ray.kill(actor)
    # Their groups would hold the shared Ray's CPUs: the reaper's own look removes them.
    PlacementGroupReaper().check()


def _state(ray, pg_id: str) -> str:
    return ray.util.placement_group_table()[pg_id]["state"]


@pytest.mark.parametrize(
    "stage",
    ["asked (unplaceable, pending)", "placed, no worker yet", "placed, its worker running"],
)
def test_a_dead_controllers_group_is_removed_at_every_stage_of_its_start(
    ray_local, controller, stage
):
    """The leak of 2026-12-06: the controller is killed with its trial after it asked for
    its workers' group, before or after Ray placed it, before or after a worker started in
    it. Each time the reaper removes it; the live controller's group beside it stays."""
    ray = ray_local
    live, doomed = controller(), controller()
    kept = ray.get(live.group.remote(1, wait=True))
    pending = stage.startswith("asked")
    pg_id = ray.get(doomed.group.remote(64 if pending else 1, wait=not pending))
    if stage.endswith("running"):
        assert ray.get(doomed.place_worker.remote())
    ray.kill(doomed)
    reaper = PlacementGroupReaper()

    def looked() -> list[str]:  # the GCS marks the actor dead once its kill went through
        reaper.check()
        return reaper.removed

    wait_for(looked, "the dead controller's group removed", timeout=60)
    assert reaper.removed == [pg_id]
    assert _state(ray, pg_id) == "REMOVED"
    assert _state(ray, kept) == "CREATED"
    reaper.check()  # a second look removes nothing twice
    assert reaper.removed == [pg_id]


def test_workers_that_wait_past_the_bound_stop_with_what_holds_the_cluster(ray_local, controller):
    """A live controller whose group cannot be placed: past the bound the reaper calls back
    once with one line naming what the workers ask and the groups that hold the CPUs."""
    ray = ray_local
    holder, waiter = controller(), controller()
    held = ray.get(holder.group.remote(1, wait=True))
    ray.get(waiter.group.remote(64, wait=False))
    lines: list[str] = []
    reaper = PlacementGroupReaper(on_stalled=lines.append, bound_s=5)
    reaper.check(now=0)
    assert lines == []
    reaper.check(now=6)
    reaper.check(now=7)
    assert len(lines) == 1 and "\n" not in lines[0]
    line = lines[0]
    assert "could not be placed for 5 s" in line
    assert "they ask 1 x {64 CPU}" in line
    assert f"{held[:12]} 1 x {{1 CPU}}" in line and "in use" in line
    assert "run the search again: it resumes" in line
    assert reaper.removed == []
