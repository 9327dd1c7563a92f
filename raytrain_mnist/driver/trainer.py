"""The one builder of every ``TorchTrainer`` the package starts: fit, each Tune trial,
a service's worker groups and evaluate's workers. A run setting (``--socket-ifname``,
``--placement-strategy``, ``--backend``, the GPU request) is honoured by all of them or by
none.

Ray's ``TorchTrainer`` is its ``DataParallelTrainer`` given a ``TorchConfig`` as its backend
config, and nothing more for a run of workers; but its module, and ``TorchConfig``'s, import
torch into the process that builds it, 1.5 CPU-seconds of every command's start-up (a
shell's ``fit``, each Tune trial's actor) in a process that never touches a tensor. So the
trainer is built as ``TorchTrainer`` builds it, from the ``DataParallelTrainer`` and a
``TorchConfig`` whose steps are Ray's own, run on the workers (:func:`compat.torch_config`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from raytrain_mnist import compat
from raytrain_mnist.config import CHECKPOINT_METRIC, RunSettings

#: The driver's variables that its workers read too (a worker's environment is its node's).
FORWARDED = ("RAYTRAIN_MNIST_PREEMPTION_CHECK_S",)


def forwarded_env() -> dict[str, str]:
    """This process's values of :data:`FORWARDED`."""
    return {name: os.environ[name] for name in FORWARDED if name in os.environ}


def worker_env(run: RunSettings, forwarded: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables every worker needs for this run's settings; ``forwarded``:
    the :data:`FORWARDED` values of the command's own process, where that is not this one
    (a Tune trial runs in an actor, whose environment is its node's)."""
    ifname = run.torch.socket_ifname
    env = forwarded_env() if forwarded is None else dict(forwarded)
    return {**env, "GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname} if ifname else env


def build_trainer(
    run: RunSettings,
    train_func: Callable[[dict], Any],
    loop_config: dict,
    cpus_per_worker: int,
    storage: str,
    name: str,
    callbacks: list | None = None,
    storage_filesystem=None,
    forwarded: dict[str, str] | None = None,
    own_ray: bool = False,
):
    """A ``TorchTrainer`` (as the module says) running ``train_func(loop_config)`` on
    ``run.scaling.num_workers`` workers (a count, or an elastic range) of ``cpus_per_worker``
    CPUs (and ``run.scaling.gpus`` GPUs) each, its run directory ``<storage>/<name>``.
    ``own_ray``: the run's Ray was started by its command and stops with it (no
    placement-group cleaner)."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer  # TorchTrainer's base

    # Ray Train's PlacementGroupCleaner asks the State API, which holds every run's teardown
    # for 12 s, and its DatasetManager serves datasets we never pass (compat says more).
    compat.lighter_run_callbacks()
    env_vars = worker_env(run, forwarded)
    trainer = DataParallelTrainer(
        train_func,
        train_loop_config=loop_config,
        # Workers sharing a GPU get Gloo (on CUDA tensors): NCCL refuses two ranks on one device.
        # Ray's process-group setup, from a config whose driver and controller need not
        # import torch.
        backend_config=compat.torch_config(run.resolved_backend, run.torch.init_method),
        scaling_config=_scaling_config(run, cpus_per_worker),
        run_config=RunConfig(
            name=name,
            storage_path=storage,
            storage_filesystem=storage_filesystem,
            failure_config=FailureConfig(
                max_failures=run.failure.max_failures,
                # A preempted node is not a failure: the run checkpoints just in time and
                # resumes from that step (worker/preempt.py), on its own budget.
                max_preemption_failures=run.failure.max_preemptions,
            ),
            checkpoint_config=CheckpointConfig(
                num_to_keep=run.checkpoint.keep_checkpoints,
                checkpoint_score_attribute=CHECKPOINT_METRIC,
                checkpoint_score_order="max",
            ),
            callbacks=callbacks or [],
            # Ray Train's INFO lines (every report, every checkpoint) drown the epoch lines.
            logging_config=ray.LoggingConfig(log_level="WARNING"),
            worker_runtime_env={"env_vars": env_vars} if env_vars else None,
        ),
    )
    if own_ray:
        compat.on_its_own_ray(trainer)
    elif compat.autoscaler_ceiling() is None:  # a running Ray that cannot grow
        compat.without_autoscaler(trainer)
    return trainer


def _scaling_config(run: RunSettings, cpus_per_worker: int):
    """Ray Train's ScalingConfig of ``run``. A (min, max) range is Ray's elastic policy: when
    it finds room to grow (or less than the group holds) it restarts the group from the
    latest checkpoint, and that is no failure. A node lost without notice kills its workers:
    that one is a failure (--max-failures), after which the group restarts at the size that
    fits."""
    from ray.train import ScalingConfig

    scaling = run.scaling
    resources = {"CPU": cpus_per_worker, **({"GPU": scaling.gpus} if scaling.use_gpu else {})}
    return ScalingConfig(
        num_workers=tuple(scaling.num_workers) if scaling.elastic else scaling.num_workers,
        elastic_resize_monitor_interval_s=scaling.resize_check_s,
        use_gpu=scaling.use_gpu,
        resources_per_worker=resources,
        placement_strategy=scaling.placement_strategy,
    )
