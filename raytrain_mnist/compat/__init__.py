"""Every private Ray and torch name this project uses, in one package: the upgrade surface.

Each entry says what it reaches, the versions it was checked against, what breaks without it
and what it falls back to, and the upstream issue where one exists. Nothing else in the
package imports ``ray._private``, a ``*._internal`` module or a torch private name (the
import contracts in ``pyproject.toml`` hold that). Checked against **ray 2.60.0** and
**torch 2.14.1**; the ``ray==2.60.0`` pin in ``pyproject.toml`` is for this package: every entry
below was read in 2.60's source, and :func:`controller_callback_base` and
:func:`single_node_ray` are the ones a Ray release is most likely to move.

Its modules import nothing of ours, and Ray and torch only inside the functions that need
them: the worker, the driver and Serve replicas may all import the package. One module per
side of Ray: :mod:`.cluster` (starting, finding and checking a cluster), :mod:`.train` (Ray
Train's controller and run callbacks), :mod:`.serve` (Serve's HTTP and gRPC servers),
:mod:`.rendezvous` (torch's rendezvous store) and :mod:`.process_group` (the workers' process
group without torch in the controller); callers use the names below, from here.

| entry | private name | without it |
|---|---|---|
| :func:`single_node_ray` | ``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` | a local Ray's servers listen on every interface |
| :func:`store_on_master_addr` | ``torch.distributed.rendezvous._create_c10d_store`` | rank 0's TCPStore listens on every interface |
| :func:`lean_local_ray` | ``ray._private.parameter.RayParams``, ``ray._private.node.Node.start_api_server`` | every local Ray we start runs an autoscaler monitor with nothing to scale, which holds ``ray.shutdown`` 1 s, a log monitor that publishes worker output nobody reads (2.5 CPU-seconds a start), and without a dashboard a dashboard process all the same (0.7 s of ``ray.init``); beside another Ray on the machine its ``ray.init`` waits 3.4 s for the dashboard agent's fixed port |
| :func:`token_auth_chosen` | ``ray._raylet.Config.initialize`` | every local Ray we start prints Ray's WARNING that it chose token authentication |
| :func:`session_logs_dir` | ``ray._private.worker.global_worker.node`` | a failed run points at Ray's default log folder |
| :func:`auto_address` | ``ray._private.services.get_ray_address_from_environment`` | ``--address auto`` cannot be checked before ``ray.init``, which waits minutes on a stopped cluster |
| :func:`gcs_refuses_token` | ``ray.core.generated.gcs_service_pb2_grpc`` (the GCS's gRPC stubs) | a cluster that requires a token is found out by ``ray.init`` after 20 s of C++ warnings |
| :func:`dead_jobs` | ``ray._private.state.state.job_table`` | a warm service cancels the request of a requester that is only slow to ask (a loaded machine) once its lease lapses, not only of one that is gone |
| :func:`placement_groups` | ``ray._private.state.state._connect_and_get_accessor`` (the GCS's placement-group and actor tables) | a search cannot find the placement group a stopped trial's Train controller created as it was killed (ray-project/ray#54305): the group holds its CPUs until the search ends and the next trials wait for ever |
| :func:`autoscaler_ceiling` | ``ray._private.state.state.get_max_resources_from_cluster_config`` | placement checks cannot count nodes an autoscaler would add |
| :func:`controller_callback_base` | ``ray.train.v2._internal.execution.callback.ControllerCallback`` | Ctrl-C cannot abort a run's controller: the run stops only with the Ray that runs it |
| :func:`worker_group_callback_base` | ``ray.train.v2._internal.execution.callback.WorkerGroupCallback`` | ``summary.json``'s timeline has no "worker group started" moment |
| :func:`lighter_run_callbacks`, :func:`on_its_own_ray`, :func:`without_cleaner`, :func:`without_autoscaler` | ``ray.train.v2._internal.callbacks.placement_group_callback``, ``...callbacks.datasets.DatasetsCallback``, ``...controller.placement_group_cleaner.is_actor_alive``, ``ray._private.state``, ``...execution.scaling_policy.FixedScalingPolicy`` | every run's teardown waits 12 s for Ray Train's PlacementGroupCleaner (its State API call blocks for 40 s without a dashboard), and on a cluster up to 1 s more for its monitor to see the stop; every run starts a DatasetManager actor it never uses; a run on a Ray of its own (or a search's trial, whose groups the search's reaper removes) starts a cleaner that guards nothing, and one on any Ray without an autoscaler an AutoscalingCoordinator that nothing reads |
| :func:`poll_workers_every` | ``ray.train.v2._internal.execution.context.get_train_context``, ``TrainController._health_check_interval_s`` | a run's last checkpoint is committed at the controller's next 2 s poll and its end seen one poll later: every run's teardown is 1-4 s longer |
| :func:`quiet_train_report_log` | ``ray.train.v2._internal.execution.context`` | every report logs an INFO line |
| :func:`tune_trial_relays_without_deadlock` | ``ray.train._internal.session._TrainSession`` | a trial whose function returns while its Train run's last report is still on the way hangs, and its search with it |
| :func:`torch_config` | ``ray.train.torch.config``'s ``_setup_torch_process_group``, ``_set_torch_distributed_env_vars``, ``_shutdown_torch``, ``TorchConfigContextManager``; ``ray.train._internal.utils.get_address_and_port``; ``ray.train.v2._internal.util.TrainingFramework`` | every run's driver and controller import torch with Ray's ``TorchConfig`` and ``TorchTrainer`` (2-4 CPU-seconds each of every run's start-up); falls back to Ray's ``TorchConfig`` where a name moved (read from Ray's source, not imported) |
| :func:`checkpoint_manager_snapshot` | ``ray.train.v2._internal.execution.checkpoint.checkpoint_manager._CheckpointManagerState`` | a warm service cannot file the checkpoints it trains into the requester's run as Ray Train's own record, so ``runs``, ``evaluate`` and a resume by a plain ``fit`` would not see them |
| :func:`serve_http_config` | ``ray.serve.context._get_global_client`` | a second ``serve`` with other HTTP settings is not refused up front |
| :func:`serve_http_reuses_address` | ``ray.serve._private.http_util.socket`` | a direct replica that replaces a dead one cannot bind the port for a minute (its connections' TIME_WAIT) |
| :func:`serve_replica_grpc_on_loopback` | ``ray.serve._private.replica.add_port_to_grpc_server`` | a loopback serve's replica listens on every interface (its inter-deployment gRPC server) |
| :func:`serve_http_bounded` | ``ray.serve._private.http_util.uvicorn`` | Serve's uvicorn (a direct replica's, Serve's proxy's) takes any request head, keeps silent connections forever and starts a request before its body is in |
| :data:`JOB_SDK_LOGGERS` | logger names under ``ray._private.runtime_env`` | the Jobs SDK logs INFO lines per upload |
"""

from __future__ import annotations

from raytrain_mnist.compat.cluster import (
    JOB_SDK_LOGGERS,
    alive_node_addresses,
    auto_address,
    autoscaler_ceiling,
    dead_jobs,
    gcs_refuses_token,
    lean_local_ray,
    placement_groups,
    quiet_job_sdk,
    session_logs_dir,
    single_node_ray,
    token_auth_chosen,
)
from raytrain_mnist.compat.process_group import torch_config
from raytrain_mnist.compat.rendezvous import STORE_ON_MASTER_ADDR_HOOK, store_on_master_addr
from raytrain_mnist.compat.serve import (
    serve_http_bounded,
    serve_http_config,
    serve_http_reuses_address,
    serve_replica_grpc_on_loopback,
)
from raytrain_mnist.compat.train import (
    checkpoint_manager_snapshot,
    controller_callback_base,
    lighter_run_callbacks,
    on_its_own_ray,
    poll_workers_every,
    quiet_train_report_log,
    tune_trial_relays_without_deadlock,
    without_autoscaler,
    without_cleaner,
    worker_group_callback_base,
)

__all__ = [
    "JOB_SDK_LOGGERS",
    "STORE_ON_MASTER_ADDR_HOOK",
    "alive_node_addresses",
    "auto_address",
    "autoscaler_ceiling",
    "checkpoint_manager_snapshot",
    "controller_callback_base",
    "dead_jobs",
    "gcs_refuses_token",
    "placement_groups",
    "lean_local_ray",
    "lighter_run_callbacks",
    "on_its_own_ray",
    "poll_workers_every",
    "quiet_job_sdk",
    "quiet_train_report_log",
    "serve_http_bounded",
    "serve_http_config",
    "serve_http_reuses_address",
    "serve_replica_grpc_on_loopback",
    "session_logs_dir",
    "single_node_ray",
    "store_on_master_addr",
    "token_auth_chosen",
    "torch_config",
    "tune_trial_relays_without_deadlock",
    "without_autoscaler",
    "without_cleaner",
    "worker_group_callback_base",
]
