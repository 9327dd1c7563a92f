"""The search's placement-group reaper: the worker placement groups that ended trials leave
behind (ray-project/ray#54305) are removed from a thread of the driver while trials run."""

from __future__ import annotations

import threading


class PlacementGroupReaper:
    """Removes the worker placement groups that ended trials leave behind, from a thread of
    the driver while the search runs.

    When a trial ends (ASHA stops it, or it finishes), Tune kills its actor and the Train
    controller with it; the workers' placement group outlives them (ray-project/ray#54305).
    Train's own cleaner finds it through the State API, but finds the cluster by address
    discovery, which fails wherever one machine runs two Ray instances: the group then holds
    its CPUs forever and later trials never start. The driver knows its cluster, so it
    checks too: a placement group of this job whose Train workers are all dead is removed.
    A group whose workers are starting or running is never touched.
    """

    def __init__(self, every_s: float = 3.0) -> None:
        self.every_s = every_s
        self.removed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PlacementGroupReaper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.removed += self.reap()
            except Exception:  # no State API (no dashboard): Ray's own cleaner is all there is
                pass

    @staticmethod
    def reap() -> list[str]:
        import ray
        from ray.util.placement_group import PlacementGroup
        from ray.util.state import list_actors

        context = ray.get_runtime_context()
        actors = list_actors(
            address=context.gcs_address,
            detail=True,
            limit=10_000,
            filters=[("class_name", "=", "RayTrainWorker"), ("job_id", "=", context.get_job_id())],
            raise_on_missing_output=False,
        )
        dead: dict[str, bool] = {}
        for actor in actors:
            if actor.placement_group_id:
                dead[actor.placement_group_id] = (
                    dead.get(actor.placement_group_id, True) and actor.state == "DEAD"
                )
        removed = []
        for pg_id, info in ray.util.placement_group_table().items():
            if info.get("state") == "CREATED" and dead.get(pg_id):
                ray.util.remove_placement_group(
                    PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id)))
                )
                removed.append(pg_id)
        return removed
