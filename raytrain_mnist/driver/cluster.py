"""Connect to a Ray cluster, or start a local one; check that a request can ever be placed.

Shared by ``fit`` and ``tune``. A local Ray is started only when no address is given (flag
or ``RAY_ADDRESS``), sized so the request fits, with its dashboard on 127.0.0.1 (Tune with
Train V2 leaks placement groups without it: ray-project/ray#54305), and it is shut down
again by whoever started it. A Ray we did not start is never stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from raytrain_mnist import compat
from raytrain_mnist.errors import EXIT_USAGE, UserError
from raytrain_mnist.net import is_loopback, split_host_port

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 5.0

#: Ray settings for a Ray this process starts (its processes inherit the environment; a
#: value the user set wins). One machine is never drained for preemption, so the watcher
#: actor is pure start-up cost. The raylet prestarts one idle worker per CPU for jobs without
#: a runtime environment; every job of ours has one (``local_runtime_env``), so those
#: processes only compete with the start-up for the CPUs. (Polling workers every 0.5 s
#: instead of Ray's 2 s all along costs training throughput (benchmarks/README.md): the
#: tests use it; a run of ours polls fast only for its last evaluation, worker/loop.py.)
LOCAL_TRAIN_ENV = {
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_prestart_worker_first_driver": "0",
}


#: Ray settings for this process as a driver, on any Ray (set before ``ray.init``; a value
#: the user set wins). At ``ray.shutdown()`` a driver's core worker waits for its last task
#: events (the state of its own calls, for the dashboard's task list) to reach the GCS: 0.25 s
#: of every command's teardown here (benchmarks/README.md), for records nobody reads.
DRIVER_ENV = {"RAY_task_events_shutdown_flush_timeout_ms": "0"}


def _set_defaults(env: dict[str, str]) -> None:
    """``env`` into this process's environment, where the user set none of it."""
    for key, value in env.items():
        os.environ.setdefault(key, value)


def _worker_logs_to_driver() -> bool:
    """Worker and controller output stays in Ray's log files unless asked for: the driver
    prints every epoch and every failure itself, in one line each."""
    return os.environ.get("RAYTRAIN_MNIST_WORKER_LOGS", "") not in ("", "0")


@dataclass(frozen=True)
class Request:
    """What a run asks of the cluster: ``num_workers`` bundles of CPUs (+ GPUs with
    ``use_gpu``: ``gpus_per_worker`` each, a fraction when workers share a GPU)."""

    num_workers: int
    cpus_per_worker: int
    use_gpu: bool
    #: CPUs needed besides the workers (a Tune trial actor, for example).
    extra_cpus: float = 0
    gpus_per_worker: float = 1

    @classmethod
    def for_run(cls, run, cpus_per_worker: int, extra_cpus: float = 0) -> Request:
        """The request of a :class:`~raytrain_mnist.config.RunSettings`. An elastic run
        asks for its minimum: it starts once that many fit and grows as room appears."""
        scaling = run.scaling
        return cls(
            scaling.min_workers,
            cpus_per_worker,
            scaling.use_gpu,
            extra_cpus,
            scaling.gpus if scaling.use_gpu else 1,
        )


def resolve_address(address: str | None) -> str | None:
    """The cluster to use: ``--address``, else ``RAY_ADDRESS``, else None (start locally)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def default_cpus_per_worker(num_workers: int, local: bool) -> int:
    """Torch threads per worker: share this machine's cores locally, 1 on a cluster."""
    if not local:
        return 1
    return max(1, (os.cpu_count() or 1) // num_workers)


@contextlib.contextmanager
def connect(address: str | None, request: Request, dashboard: bool = True) -> Iterator[bool]:
    """Connect to ``address`` or start a local Ray sized for ``request`` (with its dashboard
    unless ``dashboard`` is false: fit's own Ray goes without, benchmarks/README.md).

    Yields True when this call started Ray (and so will stop it). Raises :class:`UserError`
    when the cluster cannot be reached or can never place the request.
    """
    import ray

    if ray.is_initialized():  # a notebook or test that already holds a Ray: use it
        preflight(request)
        yield False
        return
    if address:
        _connect_to(address)
        started = False
    else:
        _check_local_gpus(request)  # seconds sooner than starting a Ray to find out
        needed = request.num_workers * request.cpus_per_worker + request.extra_cpus
        start_local(
            max(os.cpu_count() or 1, int(needed + 0.999)),
            num_gpus=None if request.use_gpu else 0,
            dashboard=dashboard,
        )
        started = True
    try:
        preflight(request)
        yield started
    finally:
        if started:
            ray.shutdown()


@dataclass(frozen=True)
class _Head:
    """How ``ray.init`` reaches a cluster: ``address`` as given (``auto`` resolved), and
    whether its head listens on this machine's loopback alone (single-node mode)."""

    address: str
    loopback_only: bool = False


def _connect_to(address: str) -> None:
    """``ray.init`` on the cluster at ``address``, after :func:`_find_head` made sure
    something answers there; a refusal becomes one line."""
    import ray

    head = _find_head(address)
    _set_defaults(DRIVER_ENV)
    if not head.address.startswith("ray://"):
        _choose_token(head.address, address)
        nodes = None
        if not head.loopback_only:
            nodes = compat.alive_node_addresses(head.address, _token_sent(), _CONNECT_TIMEOUT_S)
        head = _as_registered(head, nodes)
        _check_a_node_here(head, nodes, address)
    for attempt in range(2):
        try:
            # A head that listens on loopback alone registered 127.0.0.1: Ray, left to
            # itself, maps a loopback address to the machine's outward one, where nothing of
            # it listens.
            with (
                loopback_node() if head.loopback_only else contextlib.nullcontext(),
                keeping_sigterm_handler(),
            ):
                ray.init(
                    address=head.address,
                    logging_level=logging.WARNING,
                    log_to_driver=_worker_logs_to_driver(),
                )
            return
        except (ConnectionError, RuntimeError, ValueError) as exc:
            server_died = any(sign in str(exc) for sign in _RAY_CLIENT_SERVER_DIED)
            if attempt == 0 and server_died:
                # The head's Ray Client proxy starts one server per client; now and then
                # that server dies as it starts, saying nothing (below), or starting it
                # fails inside the proxy. A new client gets a new one.
                logger.warning(
                    "Ray Client's server for this driver did not start (%s); again", _why(exc)
                )
                continue
            why = _why(exc) + (_CLIENT_SERVER_FIX if server_died else "")
            raise UserError(f"cannot connect to the Ray cluster at {address}: {why}") from exc


#: What Ray Client's proxy answers when the server it started for a client exited at once,
#: when starting it failed (the traceback of its ``start_specific_server``), or when the
#: server never answered (it died after its start was seen: the proxy waits 30 s for it).
_RAY_CLIENT_SERVER_DIED = (
    "Starting Ray client server failed",
    "in start_specific_server",
    "Proxy failed to Connect to backend",
)
#: Why it dies: the proxy forks the server from a process whose gRPC threads are running,
#: and gRPC's fork handlers crash the child (ray-project/ray#63202). A head started with
#: them off (cluster.yaml's, the Kubernetes manifests', the suite's) does not meet it
#: (benchmarks/results/connect.md).
CLIENT_HEAD_ENV = {"GRPC_ENABLE_FORK_SUPPORT": "0"}
_CLIENT_SERVER_FIX = (
    "; Ray Client's server for this driver failed to start, twice (where the head runs "
    "gRPC's fork handlers, a Ray bug kills it as it starts: ray-project/ray#63202): start "
    "the head with "
    + " ".join(f"{key}={value}" for key, value in CLIENT_HEAD_ENV.items())
    + " in its environment, or use `raytrain-mnist submit`"
)


def _as_registered(head: _Head, nodes: set[str] | None) -> _Head:
    """A head reached on loopback whose ``nodes`` (the addresses they registered) are all
    loopback listens on loopback alone, whatever else listens at its port on the machine's
    outward address (:func:`_find_head`'s look): another Ray's agent there, on a port the
    system gave it, sent ``ray.init`` to the wrong server for minutes of retries."""
    if head.loopback_only or not is_loopback(split_host_port(head.address)[0] or ""):
        return head
    if nodes and all(is_loopback(node) for node in nodes):
        return _Head(head.address, loopback_only=True)
    return head


def _token_sent() -> str | None:
    """The token Ray's clients send from this process (only with ``RAY_AUTH_MODE=token``)."""
    return _local_token()[0] if os.environ.get("RAY_AUTH_MODE", "").lower() == "token" else None


def _check_a_node_here(head: _Head, nodes: set[str] | None, address: str) -> None:
    """A driver joins the cluster through a Ray node on its own machine (``nodes``: the
    addresses the cluster's nodes registered, None when unknown): without one, ``ray.init``
    waits a minute for a raylet that never comes. One line instead, and the way that needs
    none (Ray Client, or a job)."""
    if head.loopback_only:
        return  # that head is on this machine
    here = _interface_addresses()
    if nodes is None or not here or nodes & here:
        return
    host = split_host_port(head.address)[0]
    raise UserError(
        f"cannot connect to the Ray cluster at {address}: no node of it runs on this machine "
        f"(its nodes: {', '.join(sorted(nodes)) or 'none'}), and a driver needs one; use Ray "
        f"Client (--address ray://{host}:10001, `ray start --head --ray-client-server-port "
        "10001`) or `raytrain-mnist submit`"
    )


#: Where Ray reads a cluster's token, in its order (docs: ray-security/token-auth).
_TOKEN_VAR, _TOKEN_PATH_VAR = "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"


def _local_token() -> tuple[str | None, str]:
    """The token this machine holds for Ray and where it was read."""
    if os.environ.get(_TOKEN_VAR, "").strip():
        return os.environ[_TOKEN_VAR].strip(), _TOKEN_VAR
    path = os.environ.get(_TOKEN_PATH_VAR) or os.path.expanduser("~/.ray/auth_token")
    try:
        with open(path) as file:
            return (file.read().strip() or None), path
    except OSError:
        return None, path


def _choose_token(canonical: str, address: str) -> None:
    """Token authentication as the cluster requires it, asked before ``ray.init`` (which
    would retry for 20 s). Ray's clients send a token only with ``RAY_AUTH_MODE=token``:
    with the mode unset and a token here (what ``ray start --head`` on this machine used),
    it is chosen for this process; a mode the user set is kept."""
    mode = os.environ.get("RAY_AUTH_MODE", "").lower()
    if mode != "token" and not compat.gcs_refuses_token(canonical, None, _CONNECT_TIMEOUT_S):
        return
    token, source = _local_token()
    if mode == "disabled" or token is None:
        raise UserError(
            f"the Ray cluster at {address} requires token authentication; set RAY_AUTH_MODE="
            f"token and its token in {_TOKEN_VAR} (or a file in {_TOKEN_PATH_VAR})"
        )
    if compat.gcs_refuses_token(canonical, token, _CONNECT_TIMEOUT_S):
        raise UserError(
            f"the Ray cluster at {address} refuses the token in {source}; set "
            f"{_TOKEN_VAR} to the cluster's (`ray get-auth-token` on its head)"
        )
    if mode != "token":
        logger.info("the Ray cluster requires token authentication: the token in %s", source)
        compat.token_auth_chosen()


def _why(exc: Exception) -> str:
    """Ray's reason in one line; a refused token said as what to do about it."""
    text = " ".join(str(exc).split())
    lowered = text.lower()
    if "unauthenticated" in lowered or "auth" in lowered and "token" in lowered:
        return (
            "it requires token authentication; set RAY_AUTH_MODE=token and its token "
            "(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
        )
    if "Traceback (most recent call last)" in text:
        # A server's traceback (Ray Client's proxy sends its own): what was raised is last.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        prefix = text.partition("Traceback")[0].strip()
        text = f"{prefix} {lines[-1]}".strip() if lines else text
    return text[:300]


def _find_head(address: str) -> _Head:
    """Fail in seconds, with one line, where ``ray.init`` would retry for minutes: the
    address's form, ``auto`` resolved as Ray resolves it, and a TCP connect to it."""
    from raytrain_mnist.config import ConfigError, check_ray_address

    flag = "--address" if address != os.environ.get("RAY_ADDRESS") else "RAY_ADDRESS"
    try:
        check_ray_address(address, flag)  # RAY_ADDRESS has not been looked at before
    except ConfigError as exc:
        raise UserError(str(exc), EXIT_USAGE) from None
    named = address
    if address == "auto":
        address = compat.auto_address() or ""
        if not address:
            raise UserError(
                f"{flag} auto: no Ray cluster runs on this machine; start one with "
                "`ray start --head`, or drop --address to train on a local Ray"
            )
    host, port = split_host_port(address.removeprefix("ray://"))
    if host is None or port is None:  # auto's address comes from a file Ray wrote
        raise UserError(f"{flag} {named}: {address!r} is not a Ray address")
    seen = f"{named} (found at {address})" if named != address else address
    refused = _refused(host, port)
    if refused:
        raise UserError(
            f"no Ray cluster answers at {seen} ({refused}); start one with `ray start "
            "--head` or drop --address to train on a local Ray"
        )
    if address.startswith("ray://") or not is_loopback(host):
        return _Head(address)
    import ray

    outward = ray.util.get_node_ip_address()
    return _Head(address, is_loopback(outward) or bool(_refused(outward, port)))


def _refused(host: str, port: int) -> str | None:
    """Why a TCP connect to ``host:port`` fails (None: something listens there)."""
    try:
        socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    return None


def start_local(
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    log_to_driver: bool | None = None,
    dashboard: bool = True,
) -> None:
    """Start a new single-node Ray in this process, every server on loopback, its dashboard
    on 127.0.0.1 (Tune with Train V2 leaks placement groups without it: ray-project/ray#54305).
    What fit, tune and evaluate start for themselves; a notebook calls it too. Stop it with
    ``ray.shutdown()``. ``dashboard=False``: without it (fit's: a single run needs none, and
    its eleven processes cost seconds of a start-up that is CPU-bound)."""
    import ray

    _set_defaults({**LOCAL_TRAIN_ENV, **DRIVER_ENV})
    if "RAY_AUTH_MODE" not in os.environ:  # a mode the user set wins
        compat.token_auth_chosen()  # Ray's default, made explicit: no warning that it chose
    if log_to_driver is None:
        log_to_driver = _worker_logs_to_driver()
    try:
        with (
            loopback_node(),
            keeping_sigterm_handler(),
            # Nothing to autoscale; without log_to_driver nobody reads what the log monitor
            # would publish; another Ray here may hold the agent's fixed port.
            compat.lean_local_ray(log_monitor=log_to_driver),
        ):
            ray.init(
                address="local",  # a new Ray, never one that `ray start` left running
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                include_dashboard=dashboard,
                dashboard_host=LOOPBACK,
                _node_ip_address=LOOPBACK,
                runtime_env=local_runtime_env(),
                logging_level=logging.WARNING,
                log_to_driver=log_to_driver,
            )
    except Exception as exc:  # Ray raises bare Exception when its processes fail to start
        raise UserError(f"could not start a local Ray: {str(exc).strip()[:300]}") from exc


@contextlib.contextmanager
def keeping_sigterm_handler() -> Iterator[None]:
    """Around ``ray.init``: on the main thread Ray replaces the SIGTERM handler with its own
    (an immediate ``sys.exit``). A handler the caller installed (a command's: SIGTERM stops it
    as Ctrl-C does, ``raytrain_mnist._cli``) is put back; the system default is left to Ray."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(before) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def keeping_sigint_handler() -> Iterator[None]:
    """Around a ``trainer.fit()`` on the main thread: Ray Train installs a SIGINT handler that
    aborts that run's controller and never takes it down, so a later Ctrl-C (in a notebook,
    after ``evaluate``) would call a controller long gone, with Ray's auto-init starting a new
    local Ray when Ray is down. The handler from before is put back."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT) if main else None
    try:
        yield
    finally:
        if main and before is not None:
            signal.signal(signal.SIGINT, before)


#: The address a Ray this process starts binds its servers to: nothing outside the machine.
LOOPBACK = "127.0.0.1"
#: Ray's single-node switch (its default on macOS and Windows): the node IP is loopback.
_SINGLE_NODE_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_node() -> Iterator[None]:
    """Around ``ray.init`` of a new local Ray: every server it starts listens on loopback.

    Ray turns a loopback ``node_ip_address`` into the machine's outward address, and its GCS,
    raylet, object manager and agents then listen on every interface, unless it runs as a
    single-node cluster. That switch is read when ray is imported (this process has usually
    imported it already, so its constant is set too) and by every process Ray starts, which
    inherit the environment: workers then also give Train (MASTER_ADDR) the loopback address.
    """
    saved_env = os.environ.get(_SINGLE_NODE_VAR)
    os.environ[_SINGLE_NODE_VAR] = "0"
    try:
        with compat.single_node_ray():
            yield
    finally:
        if saved_env is None:
            os.environ.pop(_SINGLE_NODE_VAR, None)
        else:
            os.environ[_SINGLE_NODE_VAR] = saved_env


def _interfaces() -> dict[str, set[str]]:
    """Each interface's IP addresses ({} without psutil, which comes with ray[default])."""
    try:
        import psutil

        return {
            name: {a.address.split("%")[0] for a in addresses if a.family in _IP_FAMILIES}
            for name, addresses in psutil.net_if_addrs().items()
        }
    except Exception:
        return {}


_IP_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def _interface_addresses() -> set[str]:
    """Every IP address of this machine's interfaces, loopback's too."""
    return set().union(*_interfaces().values())


def _loopback_interface() -> str | None:
    """The name of the interface that holds 127.0.0.1 (lo on Linux, lo0 on macOS); None
    where it cannot tell (Gloo then picks as it does)."""
    return next((name for name, ips in _interfaces().items() if LOOPBACK in ips), None)


def local_runtime_env() -> dict:
    """The runtime environment of every worker of a Ray this process starts: the torch
    rendezvous on loopback, and Gloo's sockets on the loopback interface unless the user
    chose one (``--socket-ifname`` sets it per run and wins over this)."""
    env: dict = {"worker_process_setup_hook": compat.STORE_ON_MASTER_ADDR_HOOK}
    interface = _loopback_interface()
    if interface and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["env_vars"] = {"GLOO_SOCKET_IFNAME": interface}
    return env


def worker_logs_dir() -> str:
    """The worker logs of the connected Ray session on this node (every node keeps its own,
    at the same path when its Ray started alike); without one, Ray's default place."""
    return compat.session_logs_dir() or "/tmp/ray/session_latest/logs"


def _check_local_gpus(request: Request) -> None:
    """A local Ray sees this machine's GPUs, as PyTorch does (``CUDA_VISIBLE_DEVICES``
    included): refuse ``--use-gpu`` before starting Ray when there are too few."""
    if not request.use_gpu:
        return
    import torch

    found = torch.cuda.device_count()
    if gpu_workers(found, request.gpus_per_worker) < request.num_workers:
        raise _too_few_gpus(
            request,
            found,
            "(this machine; no --address or RAY_ADDRESS "
            "given); drop --use-gpu to train on CPUs, lower --num-workers, "
            "or pass --address of a GPU cluster",
        )


def _too_few_gpus(request: Request, found: float, rest: str) -> UserError:
    """The one wording of "--use-gpu cannot be served", locally and on a cluster."""
    each = (
        ""
        if request.gpus_per_worker == 1
        else f" of {request.gpus_per_worker:g} GPU (--gpus-per-worker)"
    )
    return UserError(
        f"--use-gpu asks for {request.num_workers} GPU worker(s){each} but the "
        f"cluster has {found:g} GPU(s) {rest}"
    )


#: Ray accounts resources in fixed point, in units of 1/10,000.
_RESOURCE_UNITS = 10_000


def gpu_workers(gpus: float, gpus_per_worker: float) -> int:
    """How many workers asking for ``gpus_per_worker`` fit on a node with ``gpus`` GPUs.

    A fraction is taken from one device, never split over two, so each GPU holds
    ``floor(1 / fraction)`` workers (0.4 each: two per GPU, not five on two GPUs).
    """
    need = round(gpus_per_worker * _RESOURCE_UNITS)
    if gpus_per_worker < 1:
        return int(gpus) * (_RESOURCE_UNITS // need)
    return round(gpus * _RESOURCE_UNITS) // need


def placeable_workers(per_node: list[dict[str, float]], request: Request) -> int:
    """How many workers of ``request`` the given nodes' total resources can hold."""
    count = 0
    for resources in per_node:
        fits = resources.get("CPU", 0) // request.cpus_per_worker
        if request.use_gpu:
            fits = min(fits, gpu_workers(resources.get("GPU", 0), request.gpus_per_worker))
        count += int(fits)
    return count


def preflight(request: Request) -> None:
    """Refuse, at once, a request the cluster can never place.

    Ray Train would otherwise retry the worker-group start-up forever. A cluster whose
    autoscaler could add the missing nodes passes, with a notice.
    """
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if placeable_workers(nodes, request) >= request.num_workers:
        return
    total_gpus = sum(n.get("GPU", 0) for n in nodes)
    total_cpus = sum(n.get("CPU", 0) for n in nodes)
    ceiling = compat.autoscaler_ceiling()
    if ceiling:
        gpu_ok = (
            not request.use_gpu
            or gpu_workers(ceiling.get("GPU", 0), request.gpus_per_worker) >= request.num_workers
        )
        cpu_ok = ceiling.get("CPU", 0) >= request.num_workers * request.cpus_per_worker
        if gpu_ok and cpu_ok:
            logger.info(
                "waiting for the autoscaler to add nodes for %d workers", request.num_workers
            )
            return
    if request.use_gpu and gpu_workers(total_gpus, request.gpus_per_worker) < request.num_workers:
        raise _too_few_gpus(
            request,
            total_gpus,
            "and no autoscaler that could add them; "
            "drop --use-gpu to train on CPUs, or lower --num-workers",
        )
    raise UserError(
        f"the cluster cannot place {request.num_workers} worker(s) x {request.cpus_per_worker} "
        f"CPU(s) (it has {total_cpus:g} CPUs over {len(nodes)} node(s)); lower --num-workers "
        "or --cpus-per-worker"
    )
