"""Every private Ray and torch name this project uses, in one place: the upgrade surface.

Each entry says what it reaches, the versions it was checked against, what breaks without it
and what it falls back to, and the upstream issue where one exists. Nothing else in the
package imports ``ray._private``, a ``*._internal`` module or a torch private name (the
import contracts in ``pyproject.toml`` hold that). Checked against **ray 2.60.0** and
**torch 2.14.1**; the ``ray==2.60.0`` pin in ``pyproject.toml`` is for this file: every entry
below was read in 2.60's source, and :func:`controller_callback_base` and
:func:`single_node_ray` are the ones a Ray release is most likely to move.

This module imports nothing of ours, and Ray and torch only inside the functions that need
them: the worker, the driver and Serve replicas may all import it.

| entry | private name | without it |
|---|---|---|
| :func:`single_node_ray` | ``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` | a local Ray's servers listen on every interface |
| :func:`store_on_master_addr` | ``torch.distributed.rendezvous._create_c10d_store`` | rank 0's TCPStore listens on every interface |
| :func:`without_log_monitor` | ``ray._private.parameter.RayParams`` | every local Ray we start runs a log monitor that publishes worker output nobody reads (2.5 CPU-seconds a start) |
| :func:`token_auth_chosen` | ``ray._raylet.Config.initialize`` | every local Ray we start prints Ray's WARNING that it chose token authentication |
| :func:`session_logs_dir` | ``ray._private.worker.global_worker.node`` | a failed run points at Ray's default log folder |
| :func:`auto_address` | ``ray._private.services.get_ray_address_from_environment`` | ``--address auto`` cannot be checked before ``ray.init``, which waits minutes on a stopped cluster |
| :func:`gcs_refuses_token` | ``ray.core.generated.gcs_service_pb2_grpc`` (the GCS's gRPC stubs) | a cluster that requires a token is found out by ``ray.init`` after 20 s of C++ warnings |
| :func:`autoscaler_ceiling` | ``ray._private.state.state.get_max_resources_from_cluster_config`` | placement checks cannot count nodes an autoscaler would add |
| :func:`controller_callback_base` | ``ray.train.v2._internal.execution.callback.ControllerCallback`` | Ctrl-C cannot abort a run's controller: the run stops only with the Ray that runs it |
| :func:`worker_group_callback_base` | ``ray.train.v2._internal.execution.callback.WorkerGroupCallback`` | ``summary.json``'s timeline has no "worker group started" moment |
| :func:`lighter_run_callbacks`, :func:`on_its_own_ray` | ``ray.train.v2._internal.callbacks.placement_group_callback``, ``...callbacks.datasets.DatasetsCallback``, ``...controller.placement_group_cleaner.is_actor_alive``, ``ray._private.state``, ``...execution.scaling_policy.FixedScalingPolicy`` | every run's teardown waits 12 s for Ray Train's PlacementGroupCleaner (its State API call blocks for 40 s without a dashboard), every run starts a DatasetManager actor it never uses, and a run on a Ray of its own a cleaner that guards nothing and an AutoscalingCoordinator no autoscaler reads |
| :func:`poll_workers_every` | ``ray.train.v2._internal.execution.context.get_train_context``, ``TrainController._health_check_interval_s`` | a run's last checkpoint is committed at the controller's next 2 s poll and its end seen one poll later: every run's teardown is 1-4 s longer |
| :func:`quiet_train_report_log` | ``ray.train.v2._internal.execution.context`` | every report logs an INFO line |
| :func:`serve_http_config` | ``ray.serve.context._get_global_client`` | a second ``serve`` with other HTTP settings is not refused up front |
| :func:`serve_http_reuses_address` | ``ray.serve._private.http_util.socket`` | a direct replica that replaces a dead one cannot bind the port for a minute (its connections' TIME_WAIT) |
| :func:`serve_replica_grpc_on_loopback` | ``ray.serve._private.replica.add_port_to_grpc_server`` | a loopback serve's replica listens on every interface (its inter-deployment gRPC server) |
| :func:`serve_http_bounded` | ``ray.serve._private.http_util.uvicorn`` | Serve's uvicorn (a direct replica's, Serve's proxy's) takes any request head, keeps silent connections forever and starts a request before its body is in |
| :data:`JOB_SDK_LOGGERS` | logger names under ``ray._private.runtime_env`` | the Jobs SDK logs INFO lines per upload |
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import logging
import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

# --------------------------------------------------------------------------- ray (driver)


@contextlib.contextmanager
def single_node_ray() -> Iterator[None]:
    """While a local Ray starts in this process: its single-node switch, read when ``ray``
    was imported, set as ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` would have set it (the caller
    sets that variable for the processes Ray starts). Without it a loopback node is moved to
    the machine's outward address and listens on every interface."""
    from ray._private import ray_constants

    saved = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if saved is not None:
            ray_constants.ENABLE_RAY_CLUSTER = saved


@contextlib.contextmanager
def without_log_monitor() -> Iterator[None]:
    """While a local Ray starts in this process with ``log_to_driver=False``: no log monitor
    (``RayParams.include_log_monitor``, which ``ray.init`` does not take). It only publishes
    the workers' log lines to drivers that ask, and none does (2.5 CPU-seconds a start)."""
    from ray._private.parameter import RayParams

    original = RayParams.__init__
    RayParams.__init__ = functools.partialmethod(original, include_log_monitor=False)
    try:
        yield
    finally:
        RayParams.__init__ = original


def token_auth_chosen() -> None:
    """Before a new local Ray starts in this process with ``RAY_AUTH_MODE`` unset: token
    authentication, Ray's own default for a new local cluster, chosen explicitly, the way Ray
    does it (the variable for the processes Ray starts, and a reload of the configuration this
    process cached when it imported ray, which Ray makes only when it chooses, and then warns
    that it did). Without the reload this process would still think auth is off, and the
    local Ray it starts would not come up."""
    from ray._raylet import Config

    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")


def session_logs_dir() -> str | None:
    """The log folder of the connected Ray session on this node: there is no public API
    for it. None when not connected, or when Ray moved it."""
    import ray

    try:
        return ray._private.worker.global_worker.node.get_logs_dir_path()
    except AttributeError:
        return None


def auto_address() -> str | None:
    """The ``HOST:PORT`` that ``ray.init(address="auto")`` would connect to: ``RAY_ADDRESS``,
    else the address the last ``ray start`` on this machine wrote in Ray's temp folder
    (``RAY_TMPDIR`` honoured), else any GCS process found running here. There is no public
    API for it (2.60); resolving it first lets the caller check that something answers
    there. None when Ray finds nothing (or moved the function)."""
    try:
        from ray._private import services
    except ImportError:
        return None
    quiet = logging.getLogger(services.__name__)  # "multiple Ray instances": others' here
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return services.get_ray_address_from_environment("auto", None)
    except (AttributeError, ConnectionError):
        return None
    finally:
        quiet.setLevel(level)


@contextlib.contextmanager
def _node_info_stub(address: str, token: str | None):
    """The GCS's node-info service at ``HOST:PORT`` on a plain gRPC channel, and the
    metadata that carries ``token`` as Ray's own clients send it (``authorization: Bearer``,
    2.60's token auth; None without one)."""
    import grpc
    from ray.core.generated import gcs_service_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address) as channel:
        yield gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel), metadata


def gcs_refuses_token(address: str, token: str | None, timeout: float) -> bool | None:
    """Whether the GCS at ``HOST:PORT`` refuses a request with this token (None: without
    one), asked with its cheapest call (``GetClusterId``, what ``ray.init`` asks first) and
    the header Ray's own clients send (``authorization: Bearer``, 2.60's token auth). A GCS
    without token auth accepts any. None when it cannot tell (no answer in ``timeout``,
    the stubs moved): ``ray.init`` finds out then."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2
    except ImportError:
        return None
    with _node_info_stub(address, token) as (stub, metadata):
        try:
            stub.GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout, metadata=metadata
            )
        except grpc.RpcError as exc:
            return True if exc.code() == grpc.StatusCode.UNAUTHENTICATED else None
        except Exception:  # a changed stub: let ray.init find out
            return None
    return False


def alive_node_addresses(address: str, token: str | None, timeout: float) -> set[str] | None:
    """The addresses the cluster's alive nodes registered, asked of the GCS at ``HOST:PORT``
    (``GetAllNodeInfo``, with the token as :func:`gcs_refuses_token` sends it). None when it
    cannot tell: ``ray.init`` finds out then."""
    try:
        import grpc  # noqa: F401  (the channel's; without it, ray.init finds out)
        from ray.core.generated import gcs_pb2, gcs_service_pb2
    except ImportError:
        return None
    with _node_info_stub(address, token) as (stub, metadata):
        try:
            reply = stub.GetAllNodeInfo(
                gcs_service_pb2.GetAllNodeInfoRequest(), timeout=timeout, metadata=metadata
            )
            alive = gcs_pb2.GcsNodeInfo.GcsNodeState.Value("ALIVE")
            return {n.node_manager_address for n in reply.node_info_list if n.state == alive}
        except Exception:  # no answer, a refusal or a changed stub: let ray.init find out
            return None


def autoscaler_ceiling() -> dict[str, int] | None:
    """The most resources an autoscaler may provide, when the cluster has one (read from
    the cluster config the autoscaler published). None: no autoscaler we know of."""
    try:
        from ray._private.state import state

        return state.get_max_resources_from_cluster_config()
    except Exception:  # absent or changed means "no autoscaler we know of"
        return None


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
        if getattr(self, _OWN_RAY, False):
            return [c for c in kept if type(c) is not module.PlacementGroupCleanerCallback]
        return [ours() if type(c) is module.PlacementGroupCleanerCallback else c for c in kept]

    create_default_callbacks._asks_gcs = True
    DataParallelTrainer._create_default_callbacks = create_default_callbacks

    start = DataParallelTrainer._initialize_and_run_controller

    def initialize_and_run_controller(self, scaling_policy, **kwargs):
        requestless = __getattr__(_POLICY_NAME) if getattr(self, _OWN_RAY, False) else None
        if requestless is not None and type(scaling_policy) is requestless.__base__:
            scaling_policy = requestless(scaling_policy.scaling_config)
        return start(self, scaling_policy=scaling_policy, **kwargs)

    DataParallelTrainer._initialize_and_run_controller = initialize_and_run_controller


#: Set on a trainer by :func:`on_its_own_ray`; read by :func:`lighter_run_callbacks`' patch.
_OWN_RAY = "_raytrain_mnist_own_ray"


def on_its_own_ray(trainer) -> None:
    """For a run on a Ray its own command started and stops (with
    :func:`lighter_run_callbacks` in place): no PlacementGroupCleaner (it removes a dead
    controller's placement group from a cluster that outlives the run: here one more process
    that guards nothing), and a fixed size asks no autoscaler for resources (the requests
    start Ray Data's AutoscalingCoordinator actor, which no autoscaler reads here)."""
    setattr(trainer, _OWN_RAY, True)


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
        def start_monitoring(self):  # in the cleaner's own process
            cleaner.is_actor_alive = _actor_alive_in_gcs
            return super().start_monitoring()

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


#: Loggers of the Jobs SDK that log an INFO line per request, upload and closed log stream,
#: and the one that warns that ``.git`` is ignored (we exclude it anyway). Names, not imports.
JOB_SDK_LOGGERS = {
    "ray.dashboard.modules.job.sdk": logging.WARNING,
    "ray.dashboard.modules.dashboard_sdk": logging.WARNING,
    "ray._private.runtime_env.packaging": logging.WARNING,
    "ray._private.runtime_env.working_dir": logging.ERROR,
}


def quiet_job_sdk() -> None:
    for name, level in JOB_SDK_LOGGERS.items():
        logging.getLogger(name).setLevel(level)


def serve_http_config() -> Any | None:
    """The HTTP options (``host``, ``port``) of the Serve instance running on the connected
    cluster: Serve keeps the ones it started with and has no public accessor. None when Serve
    is not running or the accessor moved."""
    try:
        from ray.serve import context

        return context._get_global_client().http_config
    except Exception:
        return None


# --------------------------------------------------------------------------- ray (worker)


class _ReuseAddressSockets:
    """The ``socket`` module, but the sockets it makes take ``SO_REUSEADDR`` (what uvicorn,
    and most servers, set on a listening socket: binding past TIME_WAIT, never past a
    listener)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(socket, name)

    @staticmethod
    def socket(*args, **kwargs) -> socket.socket:
        sock = socket.socket(*args, **kwargs)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return sock


def serve_http_reuses_address() -> None:
    """In a Serve replica: the HTTP server of the direct ingress binds its port with
    ``SO_REUSEADDR``. Ray 2.60's ``start_asgi_http_server`` binds without it, so when a replica
    dies with connections open, the one that replaces it cannot bind the same port until their
    TIME_WAIT ends (60 s on Linux; measured: answers again 67 s after a SIGKILL). Without the
    private name: a warning, and that wait."""
    try:
        from ray.serve._private import http_util
    except ImportError:
        logging.getLogger(__name__).warning("Serve's http_util moved: no SO_REUSEADDR")
        return
    if getattr(http_util, "socket", None) is socket:
        http_util.socket = _ReuseAddressSockets()


def serve_replica_grpc_on_loopback() -> None:
    """In a Serve replica, before Serve starts the replica's inter-deployment gRPC server
    (after the deployment's constructor): bind it to loopback. Ray 2.60 binds it to
    ``[::]:0``, every interface, in every ingress mode, with no setting; a serve on loopback
    must listen on nothing else. Serve uses that server only for handle calls over gRPC
    (``RAY_SERVE_USE_GRPC_BY_DEFAULT``, off here), which reach it on the node's address:
    loopback on the local Ray serve starts. Without the private name: a warning, and the
    server stays on every interface."""
    try:
        from ray.serve._private import replica
    except ImportError:
        logging.getLogger(__name__).warning("Serve's replica module moved: gRPC on every interface")
        return
    add_port = getattr(replica, "add_port_to_grpc_server", None)
    if add_port is None or getattr(add_port, "_on_loopback", False):
        return

    def add_port_on_loopback(server, address: str):
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address.rpartition(":")[2]
        return add_port(server, address)

    add_port_on_loopback._on_loopback = True
    replica.add_port_to_grpc_server = add_port_on_loopback


class _BoundedUvicorn:
    """The ``uvicorn`` module, but every ``Config`` made through it takes ``protocol`` as its
    HTTP protocol and keeps idle connections at most ``keep_alive_s``."""

    def __init__(self, uvicorn: Any, protocol: type, keep_alive_s: int) -> None:
        self.module, self.protocol, self.keep_alive_s = uvicorn, protocol, keep_alive_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def Config(self, *args, **kwargs) -> Any:  # noqa: N802  (uvicorn's name)
        kwargs["http"] = self.protocol
        keep = kwargs.get("timeout_keep_alive", self.keep_alive_s)
        kwargs["timeout_keep_alive"] = min(keep, self.keep_alive_s)
        return self.module.Config(*args, **kwargs)


def serve_http_bounded(protocol: type, keep_alive_s: int, replace: bool = True) -> bool:
    """In a Serve replica or proxy, before it starts its HTTP server: uvicorn runs
    ``protocol`` (a subclass of uvicorn's httptools protocol that bounds a connection's head,
    time and body) and closes idle connections after ``keep_alive_s``. Ray 2.60's
    ``start_asgi_http_server`` (``ray/serve/_private/http_util.py``, used by the direct
    ingress and by the proxy) builds ``uvicorn.Config`` with httptools and no header, request
    line, head-time or idle limit, and no setting for any: one request's headers could take
    a replica's memory before our code saw them. Checked against ray 2.60.0 and uvicorn
    0.54 (``Config(http=<class>)`` takes a protocol class). ``replace``: whether an earlier
    call's protocol gives way. Without the private name: a warning, and Ray's unbounded
    server. True when installed."""
    try:
        from ray.serve._private import http_util
    except ImportError:
        logging.getLogger(__name__).warning("Serve's http_util moved: its HTTP is unbounded")
        return False
    current = getattr(http_util, "uvicorn", None)
    if isinstance(current, _BoundedUvicorn):
        if not replace:
            return True
        current = current.module
    if current is None or not hasattr(current, "Config"):
        logging.getLogger(__name__).warning("Serve's http_util changed: its HTTP is unbounded")
        return False
    http_util.uvicorn = _BoundedUvicorn(current, protocol, keep_alive_s)
    return True


def poll_workers_every(seconds: float) -> bool:
    """In a Ray Train worker: the run's controller polls its workers every ``seconds`` once
    its current wait is over (fire and forget). Ray 2.60's ``TrainController`` reads
    ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` once, into ``_health_check_interval_s``; a report is
    committed at the poll after it, and a worker whose poll carries a report counts as running
    even when its train function has returned, so a run's end is seen one more whole interval
    later. The worker's train context holds the controller's handle (``controller_actor``),
    and Ray's ``__ray_call__`` (a DeveloperAPI) runs a function on the actor instance. Returns
    whether the call was sent; nothing changes otherwise."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        controller = get_train_context().controller_actor
        controller.__ray_call__.remote(_set_poll_interval, seconds)
    except Exception:  # another Ray Train: the controller keeps its own poll
        return False
    return True


def _set_poll_interval(controller, seconds: float) -> None:
    """In the controller's process (:func:`poll_workers_every`)."""
    if isinstance(getattr(controller, "_health_check_interval_s", None), float):
        controller._health_check_interval_s = min(controller._health_check_interval_s, seconds)


def quiet_train_report_log() -> None:
    """Ray 2.60 logs every ``ray.train.report`` at INFO through
    ``logging.getLogger(__file__)`` of its context module, a name outside ``ray.train`` that
    RunConfig's logging level does not reach."""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


# --------------------------------------------------------------------------- torch (worker)

#: ``worker_process_setup_hook`` of a Ray this process starts (a dotted name: Ray imports it
#: in every worker process).
STORE_ON_MASTER_ADDR_HOOK = f"{__name__}.store_on_master_addr"

_STORE_MODULE = "torch.distributed.rendezvous"


def store_on_master_addr() -> None:
    """``worker_process_setup_hook`` of a local Ray (:data:`STORE_ON_MASTER_ADDR_HOOK`): rank 0's TCPStore (the rendezvous that
    ``init_process_group`` starts) listens on MASTER_ADDR, here loopback, instead of on
    every interface, which is torch's default and has no setting.

    Runs in every worker process Ray starts, most of which never train: torch is not
    imported for them; the patch is applied when a process imports torch's rendezvous.
    """
    if _STORE_MODULE in sys.modules:
        _patch_store(sys.modules[_STORE_MODULE])
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds torch's rendezvous module with the other finders, then patches it once loaded."""

    def find_spec(self, name, path, target=None):
        if name != _STORE_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch_store(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _patch_store(rendezvous) -> None:
    # torch 2.14: init_process_group(init_method="env://"/"tcp://") builds rank 0's store with
    # the private _create_c10d_store, which binds every interface and takes no address.
    create = rendezvous._create_c10d_store
    if getattr(create, "_on_master_addr", False):
        return

    def create_c10d_store(hostname, port, rank, world_size, timeout, *args, **kwargs):
        if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return create(hostname, port, rank, world_size, timeout, *args, **kwargs)
        from torch.distributed import TCPStore

        family = socket.AF_INET6 if ":" in hostname else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((hostname, port))
            listener.listen(socket.SOMAXCONN)
        except OSError:  # not an address of this machine after all: torch's own way
            listener.close()
            return create(hostname, port, rank, world_size, timeout, *args, **kwargs)
        use_libuv = args[0] if args else kwargs.get("use_libuv", True)
        return TCPStore(
            host_name=hostname,
            port=port,
            world_size=world_size,
            is_master=True,
            timeout=timeout,
            multi_tenant=True,
            master_listen_fd=listener.detach(),
            use_libuv=use_libuv,
        )

    create_c10d_store._on_master_addr = True
    rendezvous._create_c10d_store = create_c10d_store
