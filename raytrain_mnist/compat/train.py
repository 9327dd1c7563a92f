"""Private Ray Train names: the controller's callbacks, the lighter run (no cleaner that
blocks, no DatasetManager, no resource requests on a Ray of its own) and the controller's poll
(see the package's table). The classes built here are pickled by name: they live in this
module, built on first use by its ``__getattr__``."""

from __future__ import annotations

import logging
from typing import Any


def controller_callback_base() -> type | None:
    """Ray Train V2's controller-side callback class, whose ``after_controller_start`` hands
    us the controller's actor handle (to abort the run on Ctrl-C from a thread Ray installs no
    signal handler on). Public ``ray.train.UserCallback`` has no such hook in 2.60. None when
    the class moved."""
    try:
        from ray.train.v2._internal.execution.callback import ControllerCallback
    except ImportError:
        return None
    return ControllerCallback


def worker_group_callback_base() -> type | None:
    """Ray Train V2's worker-group callback class, whose ``before_init_train_context`` runs
    on the controller once the worker actors are up, before Ray forms their process group
    (fit's start-up timeline). None when the class moved."""
    try:
        from ray.train.v2._internal.execution.callback import WorkerGroupCallback
    except ImportError:
        return None
    return WorkerGroupCallback


# Ray Train 2.60 adds a PlacementGroupCleaner actor to every run. Its monitor thread asks the
# State API, once a second, whether the controller lives; that call finds "the" cluster by
# auto-detection (RAY_ADDRESS, the last `ray start` here, any GCS process on the machine:
# possibly another Ray) and reads the dashboard's address from its GCS, 20 tries 2 s apart
# when there is no dashboard, ignoring its 10 s timeout. The controller's shutdown then waits
# 12 s (stop's join) for that thread. The cleaner below asks its own GCS instead, in a
# millisecond, with or without a dashboard. Version-checked: the names must be as read in 2.60.
_CLEANER_NAMES = ("GcsPlacementGroupCleanerCallback", "GcsPlacementGroupCleaner")
#: A fixed-size run's scaling policy that asks no autoscaler for anything: see on_its_own_ray.
_POLICY_NAME = "RequestlessFixedScalingPolicy"


def lighter_run_callbacks() -> None:
    """In the driver, before a trainer's ``fit``: Ray Train's default PlacementGroupCleaner
    callback is swapped for one whose cleaner asks the GCS whether the controller lives (the
    classes are built on first use here, so that the controller and the cleaner's processes
    unpickle them by name). And a trainer given no Ray Datasets (all of ours: each rank reads
    its shard through ``prepare_data_loader``) gets no DatasetsCallback: it starts a
    DatasetManager actor (it imports Ray Data: 1.5 CPU s of every run's CPU-bound start-up,
    2026-12-01) that serves nothing. Without the names as read in 2.60, Ray's own are kept."""
    try:
        from ray.train.v2._internal.callbacks import placement_group_callback as module
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    except ImportError:
        return
    default = getattr(DataParallelTrainer, "_create_default_callbacks", None)
    if default is None or getattr(default, "_asks_gcs", False):
        return
    ours = __getattr__(_CLEANER_NAMES[0])
    if ours is None:
        return

    def create_default_callbacks(self):
        kept = [c for c in default(self) if self.datasets or type(c) is not DatasetsCallback]
        if getattr(self, _NO_CLEANER, False):
            return [c for c in kept if type(c) is not module.PlacementGroupCleanerCallback]
        return [ours() if type(c) is module.PlacementGroupCleanerCallback else c for c in kept]

    create_default_callbacks._asks_gcs = True
    DataParallelTrainer._create_default_callbacks = create_default_callbacks

    start = DataParallelTrainer._initialize_and_run_controller

    def initialize_and_run_controller(self, scaling_policy, **kwargs):
        requestless = __getattr__(_POLICY_NAME) if getattr(self, _NO_AUTOSCALER, False) else None
        if requestless is not None and type(scaling_policy) is requestless.__base__:
            scaling_policy = requestless(scaling_policy.scaling_config)
        return start(self, scaling_policy=scaling_policy, **kwargs)

    DataParallelTrainer._initialize_and_run_controller = initialize_and_run_controller


#: Set on a trainer by :func:`without_cleaner` and :func:`without_autoscaler`; read by
#: :func:`lighter_run_callbacks`' patch.
_NO_CLEANER = "_raytrain_mnist_no_cleaner"
_NO_AUTOSCALER = "_raytrain_mnist_no_autoscaler"


def on_its_own_ray(trainer) -> None:
    """For a run on a Ray its own command started and stops: :func:`without_cleaner` (the
    cluster does not outlive the run) and :func:`without_autoscaler`."""
    without_cleaner(trainer)
    without_autoscaler(trainer)


def without_cleaner(trainer) -> None:
    """For a run whose placement group is removed by another if its controller dies (with
    :func:`lighter_run_callbacks` in place): no PlacementGroupCleaner, the process that
    would remove it from a cluster that outlives the run (2 CPU-seconds of every start)."""
    setattr(trainer, _NO_CLEANER, True)


def without_autoscaler(trainer) -> None:
    """For a run on a cluster with no autoscaler (with :func:`lighter_run_callbacks` in
    place): a fixed size asks no autoscaler for resources. The requests start Ray Data's
    AutoscalingCoordinator actor (a process that imports Ray Data), which nothing reads."""
    setattr(trainer, _NO_AUTOSCALER, True)


def _actor_alive_in_gcs(actor_id: str, timeout: float) -> bool:
    """``is_actor_alive`` as Ray Train 2.60 calls it, answered by this worker's GCS."""
    from ray._private.state import state
    from ray.util.state.exception import RayStateApiException

    try:
        info = state.actor_table(actor_id)
    except Exception as exc:  # the cleaner keeps watching on this one
        raise RayStateApiException(f"actor table unavailable: {exc}") from exc
    return bool(info) and info.get("State") != "DEAD"


def _cleaner_classes() -> dict[str, type] | None:
    try:
        from ray.train.v2._internal.callbacks import placement_group_callback as callback
        from ray.train.v2._internal.execution.controller import placement_group_cleaner as cleaner
    except ImportError:
        return None
    if not hasattr(cleaner, "is_actor_alive") or not hasattr(callback, "PlacementGroupCleaner"):
        return None

    class GcsPlacementGroupCleaner(cleaner.PlacementGroupCleaner):
        _registered = None  # the placement group last registered

        def start_monitoring(self):  # in the cleaner's own process
            cleaner.is_actor_alive = _actor_alive_in_gcs
            return super().start_monitoring()

        def register_placement_group(self, placement_group):
            self._registered = placement_group
            return super().register_placement_group(placement_group)

        def stop(self):
            # Its monitor waits on its queue for up to a check interval (1 s) before it sees
            # the stop: the placement group it already watches, handed to it again, wakes it
            # at once (0.3-0.75 s of every teardown on a cluster, 2026-12-04).
            self._stop_event.set()
            if self._registered is not None:
                self._pg_queue.put(self._registered)
            return super().stop()

    class GcsPlacementGroupCleanerCallback(callback.PlacementGroupCleanerCallback):
        def after_controller_start(self, train_run_context):  # in the controller
            saved, callback.PlacementGroupCleaner = (
                callback.PlacementGroupCleaner,
                GcsPlacementGroupCleaner,
            )
            try:
                super().after_controller_start(train_run_context)
            finally:
                callback.PlacementGroupCleaner = saved

    classes = {}
    for cls in (GcsPlacementGroupCleanerCallback, GcsPlacementGroupCleaner):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
        classes[cls.__name__] = cls
    return classes


def _policy_classes() -> dict[str, type] | None:
    try:
        from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy
    except ImportError:
        return None

    class RequestlessFixedScalingPolicy(FixedScalingPolicy):  # the names as read in 2.60
        _send_resource_request = _maybe_send_resource_request = _cancel_resource_request = (
            lambda self: None
        )

    cls = RequestlessFixedScalingPolicy
    cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return {cls.__name__: cls}


def __getattr__(name: str) -> Any:
    """The cleaner and policy classes, built when first asked for (by name, by pickle too)."""
    if name not in (*_CLEANER_NAMES, _POLICY_NAME):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    classes = _policy_classes() if name == _POLICY_NAME else _cleaner_classes()
    if classes is None:
        return None
    globals().update(classes)
    return classes[name]


def poll_workers_every(seconds: float, exact: bool = False) -> bool:
    """In a Ray Train worker: the run's controller polls its workers every ``seconds`` once
    its current wait is over (fire and forget). Ray 2.60's ``TrainController`` reads
    ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` once, into ``_health_check_interval_s``; a report is
    committed at the poll after it, and a worker whose poll carries a report counts as running
    even when its train function has returned, so a run's end is seen one more whole interval
    later. The worker's train context holds the controller's handle (``controller_actor``),
    and Ray's ``__ray_call__`` (a DeveloperAPI) runs a function on the actor instance. Returns
    whether the call was sent; nothing changes otherwise. The interval only shortens,
    unless ``exact`` (a service sets Ray's back between two requests)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        controller = get_train_context().controller_actor
        controller.__ray_call__.remote(_set_poll_interval, seconds, exact)
    except Exception:  # another Ray Train: the controller keeps its own poll
        return False
    return True


def _set_poll_interval(controller, seconds: float, exact: bool = False) -> None:
    """In the controller's process (:func:`poll_workers_every`)."""
    if isinstance(getattr(controller, "_health_check_interval_s", None), float):
        now = controller._health_check_interval_s
        controller._health_check_interval_s = float(seconds) if exact else min(now, seconds)


def quiet_train_report_log() -> None:
    """Ray 2.60 logs every ``ray.train.report`` at INFO through
    ``logging.getLogger(__file__)`` of its context module, a name outside ``ray.train`` that
    RunConfig's logging level does not reach."""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def checkpoint_manager_snapshot(results: list, latest: str, reports: int) -> bytes:
    """Ray Train's ``checkpoint_manager_snapshot.json`` of a run whose checkpoints a warm
    service filed (``driver/runs/filing.py``): ``results`` as (folder name, metrics, report
    index) in the manager's order, ``latest`` the latest's folder, ``reports`` the reports
    made. Built with Ray 2.60's own models (``_CheckpointManagerState``, private, in
    ``train/v2/_internal/execution/checkpoint/checkpoint_manager.py``), so the file carries
    its schema and ``ray_version``: Ray refuses a snapshot of another version, and a plain
    ``fit`` resuming the run loads it as one of its own."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
        _CheckpointManagerState,
        _TrainingResultState,
    )

    states = {
        name: _TrainingResultState(checkpoint_dir_name=name, metrics=m) for name, m, _ in results
    }
    state = _CheckpointManagerState(
        checkpoint_results=list(states.values()),
        checkpoint_report_indices=[index for _, _, index in results],
        latest_checkpoint_result=states[latest],
        pending_training_results=[],
        pending_validation_specs=[],
        current_report_index=reports,
        validated_checkpoint_dir_names=[],
        timed_out_validation_checkpoint_dir_names=[],
        failed_validation_checkpoint_dir_names=[],
    )
    return state.json().encode()


def tune_trial_relays_without_deadlock() -> None:
    """In a Tune trial's process: the trial's main thread hands a Ray Train report on to Tune
    directly, instead of through the trial's one-slot result queue. Ray (2.60) relays each
    report that Train's ``TuneReportCallback`` sends from the controller by calling
    ``report`` on the main thread, which puts it in that queue and then takes it out. When the
    trial function has just returned, its own thread has already put Tune's closing
    ``RESULT_DUPLICATE`` there, so the main thread's put waits forever on a queue only it
    empties: the trial hangs, and the search with it (seen 2026-12-05 03:47, the S3 ASHA
    test, a stack dump of the trial in ``_report_training_result``'s ``put``). The report's
    own work (metrics, checkpoint, artifacts) is unchanged; only the queue is skipped for it."""
    import queue
    import threading

    try:
        from ray.train._internal import session
        from ray.util.queue import Empty
    except ImportError:
        return
    cls = session._TrainSession
    if getattr(cls, "_relays_directly", False):
        return
    fetch_timeout = session._RESULT_FETCH_TIMEOUT
    report_training_result = cls._report_training_result

    def _report_training_result(self, training_result) -> None:
        relayed = getattr(self, "_relayed", None)
        if relayed is None or relayed[0] != threading.get_ident():
            return report_training_result(self, training_result)
        if training_result.checkpoint:  # as Ray's: it populates train.get_checkpoint
            self.loaded_checkpoint = training_result.checkpoint
        relayed[1].append(training_result)
        return None

    def _get_result_from_queues(self, block: bool):
        if self._inter_actor_queue is not None:
            try:
                item = self._inter_actor_queue.get(block=block, timeout=fetch_timeout)
            except Empty:
                item = None
            if item:
                self._relayed = (threading.get_ident(), [])
                try:
                    self.report(item)
                    if results := self._relayed[1]:
                        return results[0]
                finally:
                    self._relayed = None
        try:
            return self.result_queue.get(block=block, timeout=fetch_timeout)
        except queue.Empty:
            return None

    cls._report_training_result = _report_training_result
    cls._get_result_from_queues = _get_result_from_queues
    cls._relays_directly = True
