"""Private Ray names the driver uses to start, find and check a cluster, and to quiet the
Jobs SDK (see the package's table)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator


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
def lean_local_ray(log_monitor: bool = False) -> Iterator[None]:
    """While a local Ray starts in this process, what ``ray.init`` does not take
    (``RayParams``): no autoscaler monitor (``no_monitor``), no log monitor unless
    ``log_monitor`` (``include_log_monitor``), and a dashboard agent whose HTTP server takes
    a port the system picks (``dashboard_agent_listen_port=0``) instead of Ray's fixed 52365.
    The autoscaler monitor scales nothing on a Ray started without a cluster config, and it
    does not exit on SIGTERM: ``ray.shutdown`` waits its whole second for it, then kills it
    (1.0 s of every 1.2-1.6 s shutdown, 2026-12-03). The log monitor only publishes the
    workers' log lines to drivers that ask (``log_to_driver``), 2.5 CPU-seconds a start.
    Where another Ray on the machine holds 52365, the agent retries the bind for 3.4 s and
    ``ray.init`` waits for it (2.2 s alone, 5.2 s beside a ``ray start --head``,
    2026-12-04); the agent publishes the port it got, where the dashboard looks it up.

    And with ``include_dashboard=False`` no dashboard process at all (``Node.
    start_api_server``): Ray starts one anyway, to run nothing but its usage-statistics
    reporter (``--modules-to-load=UsageStatsHead``); it made ``ray.init`` 0.7 s slower and
    cost 0.6 CPU-seconds a start (benchmarks/README.md, "What a Ray start costs"). A Ray
    we start without a dashboard so reports no usage statistics."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    original = RayParams.__init__
    options = {"no_monitor": True, "dashboard_agent_listen_port": 0}
    if not log_monitor:
        options["include_log_monitor"] = False
    RayParams.__init__ = functools.partialmethod(original, **options)
    start_api_server = Node.start_api_server

    def no_dashboard_unless_asked(self, *, include_dashboard, raise_on_failure):
        if include_dashboard is not False:
            start_api_server(
                self, include_dashboard=include_dashboard, raise_on_failure=raise_on_failure
            )

    Node.start_api_server = no_dashboard_unless_asked
    try:
        yield
    finally:
        RayParams.__init__ = original
        Node.start_api_server = start_api_server


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


def dead_jobs(job_ids: set[str]) -> set[str] | None:
    """Which of the Ray jobs ``job_ids`` (hex ids) the GCS has marked dead, or does not know
    (an id a client made up is no live requester): a driver that
    exited, or was killed, is marked when its raylet sees its connection close. In a
    process connected to Ray (a warm service's queue asks about its requesters). Ray 2.60
    has no public call for the job table without the dashboard: ``ray._private.state``'s
    ``job_table()``. None when it cannot be asked (the caller then goes by time alone)."""
    try:
        from ray._private.state import state

        table = state.job_table()
    except Exception:
        return None
    alive = {j.get("JobID") for j in table if not j.get("IsDead")}
    return set(job_ids) - alive


def placement_groups() -> list[dict] | None:
    """The cluster's placement groups that are not removed, read from the GCS itself
    (``ray._private.state``'s accessor: Ray 2.60 has no public call that says who created a
    group, and the State API needs the dashboard): each one's ``id`` and ``job`` (hex),
    ``state`` (PENDING, PREPARED, CREATED, RESCHEDULING), ``bundles`` (a resources dict
    each), ``creator`` (the hex id of the actor that created it, None for a driver),
    ``detached``, and ``orphaned``: not detached, and its creator is an actor that is dead.
    The GCS frees a group only when its creator *and* its job are dead, so an orphan of a
    live driver holds its resources until someone removes it (ray-project/ray#54305). The
    creator's own record is read too: a group whose creation reached the GCS after its
    creator was marked dead never gets ``creator_actor_dead``. None when the GCS cannot be
    read this way."""
    try:
        import ray
        from ray._private.state import state
        from ray.core.generated import gcs_pb2

        accessor = state._connect_and_get_accessor()
        parse = gcs_pb2.PlacementGroupTableData.FromString
        table = [parse(raw) for raw in accessor.get_placement_group_table()]
        removed = gcs_pb2.PlacementGroupTableData.REMOVED
        groups = []
        for data in table:
            if data.state == removed:
                continue
            creator = ray.ActorID(data.creator_actor_id)
            dead = not creator.is_nil() and (
                data.creator_actor_dead or _actor_dead(accessor, creator)
            )
            groups.append(
                {
                    "id": data.placement_group_id.hex(),
                    "job": data.creator_job_id.hex(),
                    "state": gcs_pb2.PlacementGroupTableData.PlacementGroupState.Name(data.state),
                    "bundles": [dict(b.unit_resources) for b in data.bundles],
                    "creator": None if creator.is_nil() else creator.hex(),
                    "detached": data.is_detached,
                    "orphaned": dead and not data.is_detached,
                }
            )
    except Exception:  # absent or changed: the caller says it cannot tell
        return None
    return groups


def _actor_dead(accessor, actor_id) -> bool:
    from ray.core.generated import gcs_pb2

    raw = accessor.get_actor_info(actor_id)
    if raw is None:  # never registered (its creation never reached the GCS), or forgotten
        return True
    return gcs_pb2.ActorTableData.FromString(raw).state == gcs_pb2.ActorTableData.DEAD
