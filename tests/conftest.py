"""Shared fixtures. Every test runs on CPU, offline, without ../shared.

Auth mode: tests start their own Ray clusters with token authentication *disabled*
(RAY_AUTH_MODE=disabled), so none of them writes ~/.ray/auth_token. The Jobs tests that
need a token create their own in a temporary directory.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

# Decided before anything imports ray, and inherited by every subprocess a test starts.
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAYTRAIN_MNIST_NO_DOWNLOAD"] = "1"
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# What `fit` sets for a Ray it starts itself, here for the clusters the tests start too; and
# Ray Train's controller polls workers every 0.5 s instead of 2 s: a committed checkpoint and
# the end of a run come sooner, which adds up over the suite's many short runs (fit keeps
# Ray's 2 s: faster polling costs training throughput, benchmarks/README.md).
from raytrain_mnist.driver.cluster import LOCAL_TRAIN_ENV  # noqa: E402

# And a worker group that cannot be placed is given up on after 10 s instead of 60: right
# after a node is lost, an elastic run's first restart asks for the size it had (Ray Train's
# reserved resources lag the node's death), and would wait the whole timeout for it. A
# search whose trial cannot be placed stops after 120 s instead of 300, saying what holds
# the CPUs: a leaked group fails its test in minutes, not at the suite's timeout.
_TEST_TRAIN_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10",
    "RAYTRAIN_MNIST_PLACEMENT_TIMEOUT_S": "120",
    # Ray starts its worker processes at nice 15 (below its raylet and GCS): beside a CPU hog
    # at nice 0 they get a sliver of a core. The tests' Ray workers run at the tests' own
    # priority, as the rest of a CI job does.
    "RAY_worker_niceness": "0",
}
for _key, _value in {**LOCAL_TRAIN_ENV, **_TEST_TRAIN_ENV}.items():
    os.environ.setdefault(_key, _value)

REPO = Path(__file__).resolve().parents[1]

#: Every process of a cluster a test starts by hand carries ``MARKER_VAR=<its marker>`` in
#: its environment, so that the test can kill exactly what it started (never `ray stop`).
MARKER_VAR = "RAYTRAIN_MNIST_TEST_CLUSTER"


def imported(_actor, module: str) -> bool:
    """Whether an actor's process has imported ``module``: ``actor.__ray_call__.remote(
    imported, name)`` (a function here, so that the actor imports this module, not the
    test's)."""
    return module in sys.modules


def wait_for(predicate, what: str, timeout: float = 120, interval: float = 0.2):
    """``predicate()``'s first answer that is not None, polled; AssertionError naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (found := predicate()) is not None:
            return found
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


#: Where :func:`free_ports` draws from: above Ray's default worker ports (10002-19999) and
#: below the kernel's ephemeral range, which every server bound to port 0 draws from (Ray's
#: among them). A port the kernel picked is handed to a server that binds it seconds later,
#: and another test's Ray could take it meanwhile (it did: a serve replica's port, 03:26).
_FREE_PORTS = range(20000, min(_ephemeral_low(), 32768))


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports on 127.0.0.1 that nothing listens on now."""
    import random

    draw, ports = random.Random(), []  # not the tests' seeded generator: xdist workers differ
    while len(ports) < n:
        port = draw.choice(_FREE_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def marked(marker: str) -> list[int]:
    """The processes whose environment holds ``MARKER_VAR=marker``: what one test started
    (a Ray inherits it down to its workers), nobody else's."""
    needle = f"{MARKER_VAR}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in environ:
            pids.append(int(entry.name))
    return pids


def no_process_left(marker: str, timeout: float = 120) -> None:
    """Wait until no process of ``marked(marker)`` is left (the last of a Ray's workers may
    take a while to exit on a loaded machine); AssertionError naming what is."""
    deadline = time.monotonic() + timeout
    while (left := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        commands = {}
        for pid in left:
            with contextlib.suppress(OSError):
                commands[pid] = (Path("/proc") / str(pid) / "cmdline").read_bytes()[:200]
        raise AssertionError(f"processes of the command's own Ray outlived it: {commands}")


def is_loopback(ip: str) -> bool:
    """A socket address (``::ffff:127.0.0.1`` and ``fe80::1%lo`` forms too) on loopback."""
    import ipaddress

    address = ipaddress.ip_address(ip.split("%")[0])
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def listening(pids: set[int]) -> dict[tuple[str, int], str]:
    """(address, port) -> process name of every TCP socket the processes listen on, and of
    every unconnected UDP one."""
    import psutil

    found = {}
    for pid in pids:
        try:
            process = psutil.Process(pid)
            name = process.name()
            for conn in process.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN or (
                    conn.type == socket.SOCK_DGRAM and not conn.raddr
                ):
                    found[(conn.laddr.ip, conn.laddr.port)] = name
        except psutil.Error:  # gone between the listing and the look
            continue
    return found


def kill_marked(marker: str) -> list[int]:
    """SIGKILL every process that carries ``marker``: ours only. Swept until none is left: a
    Ray process started while a sweep killed its parent carries the marker too (a benchmark's
    head left a dashboard agent behind that way, spinning at half a core for 90 s)."""
    killed = []
    for _ in range(20):
        found = marked(marker)
        if not found:
            break
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.1)
    return killed


def signal_all(pids, signum: int) -> None:
    """Send ``signum`` to each of ``pids`` that still runs."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def committed_workers(run_dir: Path, after: set[int] = frozenset(), timeout: float = 60):
    """The workers (rank order) behind the run's latest committed checkpoint, waiting until
    they are none of the processes in ``after``: the snapshot file can lag the printed
    epoch."""

    def workers():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # not yet written
            snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
            found = snapshot["latest_checkpoint_result"]["metrics"]["workers"]
            return None if after & {w["pid"] for w in found} else found

    return wait_for(workers, f"a committed checkpoint from new workers in {run_dir}", timeout)


def client_server_logs(ray_tmp: Path) -> str:
    """The tails of the Ray Client servers' logs of the Ray under ``ray_tmp`` (its
    RAY_TMPDIR): why a ``ray://`` server did not start."""
    return "".join(
        f"\n--- {log.name}:\n" + log.read_text(errors="replace")[-2000:]
        for log in sorted(ray_tmp.glob("ray/session_*/logs/ray_client_server*"))
    )


def full_data_dir() -> Path | None:
    """The full MNIST set, when this checkout has it (RAYTRAIN_MNIST_DATA or ../shared)."""
    candidates = [os.environ.get("RAYTRAIN_MNIST_DATA"), REPO.parent / "shared" / "data" / "mnist"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").is_file():
            return Path(candidate)
    return None


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """No test sees a real MNIST cache in the user's home."""
    monkeypatch.setenv("RAYTRAIN_MNIST_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def sample_digits():
    """Genuine MNIST digits from the sample the package ships with (uint8, int64), shuffled:
    the sample is sorted by label, so its first digits would all be 0s and 1s."""
    from raytrain_mnist.data import load_sample

    data = load_sample()
    order = np.random.default_rng(0).permutation(data.train_size)
    return data.train_images[order], data.train_labels[order]


def write_tiny_mnist(
    root: Path, digits, n_train: int = 512, n_test: int = 203, compress: bool = False
) -> Path:
    """A small, learnable MNIST in torchvision's layout; odd test size on purpose."""
    from raytrain_mnist.data import write_idx

    images, labels = digits
    raw = root / "MNIST" / "raw"
    write_idx(raw, images[:n_train], labels[:n_train], "train", compress)
    write_idx(
        raw,
        images[n_train : n_train + n_test],
        labels[n_train : n_train + n_test],
        "test",
        compress,
    )
    return root


def tiny_run_flags(data_dir, storage, name: str | None = None, *extra: str, **flags) -> list[str]:
    """The flags of a small ``fit`` or ``tune`` on ``data_dir`` (a tiny MNIST, as
    :func:`write_tiny_mnist` writes it) into ``storage``: one worker, batches of 32, the MNIST
    files (never the sample), the run's ``name`` when given. A keyword sets a flag
    (``epochs=2``: ``--epochs 2``, ``cpus_per_worker=1``: ``--cpus-per-worker 1``; None leaves
    a default one out); ``extra`` words follow last, as they are."""
    values = {"num_workers": 1, "batch_size": 32, "dataset": "mnist", **flags}
    values.update(data_dir=data_dir, storage_path=storage, name=name)
    words = []
    for key, value in values.items():
        if value is not None:
            words += [f"--{key.replace('_', '-')}", str(value)]
    return [*words, *extra]


@pytest.fixture(scope="session")
def tiny_mnist(tmp_path_factory, sample_digits) -> Path:
    """2048 training digits: epochs long enough for the failure scenario to kill things
    between them."""
    return write_tiny_mnist(tmp_path_factory.mktemp("tiny"), sample_digits, n_train=2048)


# --------------------------------------------------------------------------- S3 (moto)


def aws_env(url: str, key: tuple[str, str] = ("testing", "testing")) -> dict[str, str]:
    """The standard AWS environment that points pyarrow, Ray, boto3 and every subprocess at
    the S3-compatible server at ``url`` with ``key`` (access key id, secret)."""
    return {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": key[0],
        "AWS_SECRET_ACCESS_KEY": key[1],
        "AWS_REGION": "us-east-1",
    }


class MotoS3:
    """What the :func:`s3` fixture yields: ``s3()`` makes a fresh bucket and returns
    ``s3://<bucket>/runs``; :meth:`bucket` returns a fresh bucket's name; :attr:`client` is a
    boto3 client of the server."""

    def __init__(self, client) -> None:
        self.client = client

    def bucket(self) -> str:
        name = f"runs-{uuid.uuid4().hex[:8]}"
        self.client.create_bucket(Bucket=name)
        return name

    def __call__(self) -> str:
        return f"s3://{self.bucket()}/runs"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def s3(monkeypatch_module) -> MotoS3:
    """A moto S3 server on loopback (one per test module) and the AWS environment pointing at
    it for the module's tests (:func:`aws_env`, as pyarrow, Ray and every subprocess read it);
    yields a :class:`MotoS3`, a fresh-bucket factory."""
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for key, value in aws_env(f"http://{host}:{port}").items():
            monkeypatch_module.setenv(key, value)
        yield MotoS3(boto3.client("s3"))
    finally:
        server.stop()


# --------------------------------------------------------------------------- shared Rays
#
# A Ray that sits idle still burns a few percent of a core (raylet, GCS, idle workers), and
# this machine has two. The shared ones are session fixtures, started by the first test that
# needs one and stopped right after the last; the tests that share them run back to back.

_SHARED = ("ray_local", "two_nodes")
#: The suite's warm service (tests/warm_service.py): its users are one xdist group of their
#: own (a service is a Ray of its own, in a subprocess), and it stops after the last of them.
_SERVICE = "service"
_SERVICE_GROUP = "warm-service"
_STOP_AFTER_LAST_USER: dict[str, object] = {}  # name -> its stop function, once started
_LAST_USER: dict[str, str] = {}  # name -> node id of the last test that uses it


def _shared_by(item) -> int:
    """Sort key: tests without a shared Ray first, then those of each shared Ray in turn.
    A test that needs several goes with the last of them and finds the others' fixtures
    already made (``fitted`` for the failure scenario): it must not need those Rays live."""
    return max(
        (rank for rank, name in enumerate(_SHARED, start=1) if name in item.fixturenames), default=0
    )


# --------------------------------------------------------------------------- slow
#
# `pytest -m "not slow"` (`make test-fast`) runs every module's unit tests in a few minutes:
# what starts no Ray, no cluster, no server and no command that trains. A test is `slow` when
# it uses a fixture that starts one (any file's: the names below), or is named in _SLOW_TESTS
# (it starts one itself: a subprocess `fit`, a Jobs head, a notebook kernel). A test that
# takes longer than _FAST_S without the marker is named at the end of a `-m "not slow"` run.

#: Fixtures that start a Ray, a cluster, a server or a training run (conftest's and the test
#: files' own).
_SLOW_FIXTURES = frozenset(
    {
        *_SHARED,
        "fitted",
        "trained_run",
        "ray_env",
        "onprem",  # test_ray_up
        "heads",  # test_connect
        "on_three_workers",  # test_distributed
        "one_node",  # test_elastic
        "cluster",  # test_job_placement
        "two_hosts",  # test_netns
        "head",  # test_submit
        "server",  # test_serve
        "timed_fit",  # test_startup
        "gpu_ray",  # test_gpu
        "one_worker_nccl",  # test_gpu
        "iam_s3",  # test_iam
        _SERVICE,  # tests/warm_service.py
    }
)

#: What in a test's own body starts a new Python, a Ray or a kernel (a CLI subprocess
#: imports torch, and most start a Ray).
_STARTS = re.compile(
    r"\brun_cli\(|\bsubprocess\.(run|Popen)\(|\bPopen\(|\bray\.init\(|\bCluster\(|NotebookClient\("
)

#: Tests (file::name, any parameters) that start one through a helper.
_SLOW_TESTS = frozenset(
    {
        "test_gpu.py::test_the_gpu_benchmark_runs_its_seeds_and_steps_on_cpu",
        "test_signals.py::test_a_stopped_fit_lets_go_of_ray_before_ray_shuts_down",
        "test_signals.py::test_a_stopped_fit_lets_go_of_ray_before_ray_shuts_down_in_its_own_pytest",
        "test_compile.py::test_compiled_convnet_trains_as_eager_and_checkpoints_as_eager",
    }
)

_FAST_S = 10.0
_UNMARKED_SLOW: list[tuple[str, float]] = []


def _is_slow(item) -> bool:
    name = f"{item.path.name}::{item.originalname}"
    if _SLOW_FIXTURES & set(item.fixturenames) or name in _SLOW_TESTS:
        return True
    try:
        return bool(_STARTS.search(inspect.getsource(item.function)))
    except (OSError, TypeError):  # no source (a generated test)
        return False


# --------------------------------------------------------------------------- in parallel
#
# `make test` runs the suite in two pytest-xdist workers (`-n 2 --dist loadgroup`): most of a
# Ray test's time is waiting (a process starting, a controller's poll, a head coming up), so
# two at once fill the machine's two cores. Each work unit is an xdist group: the tests of
# the shared Rays are one (they need one process: its session fixtures), every other file is
# its own (its module fixtures start once). Units go out in the order collected, the longest
# first so that the short ones fill in at the end: the shared one, the files named in
# _LONGEST (their seconds in CONTRIBUTING.md's timing), then the files with the most tests
# that start something.

_SHARED_GROUP = "shared-rays"
_LONGEST = (
    _SERVICE_GROUP,
    "test_ray_up.py",
    "test_tune.py",
    "test_signals.py",
    "test_iam.py",
    "test_submit.py",
    "test_connect.py",
    "test_resilience.py",
    "test_netns.py",
    "test_elastic.py",
    "test_notebook.py",
    "test_startup.py",
    "test_claim.py",
    "test_full_data.py",
)


def _group(item) -> str:
    if _shared_by(item):
        return _SHARED_GROUP
    return _SERVICE_GROUP if _SERVICE in item.fixturenames else item.path.name


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker, and before xdist groups
def pytest_collection_modifyitems(items):
    slow_in: dict[str, int] = {}
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
            slow_in[_group(item)] = slow_in.get(_group(item), 0) + 1
        item.add_marker(pytest.mark.xdist_group(_group(item)))

    def order(item):
        group = _group(item)
        known = _LONGEST.index(group) if group in _LONGEST else len(_LONGEST)
        return (group != _SHARED_GROUP, known, -slow_in.get(group, 0), _shared_by(item))

    items.sort(key=order)  # stable: file order within each group


class _XdistGroupSuffix:
    """pytest-xdist (3.8) sends a group to one worker by suffixing each test's node id with
    ``@group``, set as ``item._nodeid``; pytest 9.2 keeps the id in ``item._id``, so the
    suffix is lost and groups are split. This sets it where pytest 9.2 reads it."""

    @pytest.hookimpl(trylast=True)  # after xdist's own
    def pytest_collection_modifyitems(self, config, items):
        if not getattr(config.option, "loadgroup", False):  # set in xdist's workers only
            return
        from _pytest.nodeid import coerce_node_id

        for item in items:
            group = item.get_closest_marker("xdist_group")
            suffix = f"@{group.args[0]}" if group and group.args else ""
            if suffix and not item.nodeid.endswith(suffix):
                item._id = coerce_node_id(item.nodeid + suffix)


def pytest_configure(config):
    config.pluginmanager.register(_XdistGroupSuffix(), "raytrain-xdist-group-suffix")
    # A suite started in the background by a shell without job control (`make test &`,
    # some CI runners) inherits SIGINT ignored, and so would every command it starts: the
    # Ctrl-C tests would then test nothing but that. A handler of ours is reset to the
    # default across exec, so the commands get Python's own again.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_runtest_logreport(report):
    if report.when == "call" and report.duration > _FAST_S and "slow" not in report.keywords:
        _UNMARKED_SLOW.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter):
    if _UNMARKED_SLOW:
        terminalreporter.section(f"over {_FAST_S:.0f} s without the slow marker")
        for nodeid, seconds in _UNMARKED_SLOW:
            terminalreporter.write_line(f"{seconds:6.1f}s {nodeid}: add it to _SLOW_TESTS")


def pytest_collection_finish(session):
    for item in session.items:  # after -k and deselection: the tests that will run
        if rank := _shared_by(item):
            _LAST_USER[_SHARED[rank - 1]] = item.nodeid
        elif _SERVICE in item.fixturenames:
            _LAST_USER[_SERVICE] = item.nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_SIGINT_BEFORE] = signal.getsignal(signal.SIGINT)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    for name, last in _LAST_USER.items():
        if item.nodeid == last and name in _STOP_AFTER_LAST_USER:
            _STOP_AFTER_LAST_USER.pop(name)()
    _no_ray_left(item)
    _sigint_handler_kept(item)


_SIGINT_BEFORE = pytest.StashKey[object]()


def _sigint_handler_kept(item) -> None:
    """A test (or a fixture it started) that leaves a SIGINT handler behind fails at its
    teardown, and the handler from before is put back. Ray Train's ``trainer.fit()`` on the
    main thread installs one that aborts its own, long-gone controller: a later test's Ctrl-C
    would reach it and Ray would auto-init."""
    before = item.stash.get(_SIGINT_BEFORE, None)
    now = signal.getsignal(signal.SIGINT)
    if before is None or now is before:
        return
    signal.signal(signal.SIGINT, before)
    raise AssertionError(f"{item.nodeid} left a SIGINT handler installed: {now!r}")


def _no_ray_left(item) -> None:
    """A test that leaves this process connected to a Ray (a shared one aside) fails at its
    teardown, and the connection goes: else a later test finds a Ray it never started."""
    ray = sys.modules.get("ray")
    if _AUTO_INITS:
        raise AssertionError("a Ray call without a Ray, refused: " + _AUTO_INITS.pop())
    kept = "ray_local" in _STOP_AFTER_LAST_USER or _KEPT_RAYS
    if ray is None or kept or not ray.is_initialized():
        return
    ray.shutdown()
    raise AssertionError(f"{item.nodeid} left this process connected to a Ray")


#: In-process Rays that a module's fixture keeps between its tests (:func:`kept_ray`).
_KEPT_RAYS: set[str] = set()


@contextlib.contextmanager
def kept_ray(name: str):
    """Marks the Ray a module-scoped fixture connects (e.g. tests/test_gpu.py's, with the
    GPU that ``ray_local`` does not offer) as kept on purpose between the module's tests:
    the teardown check above lets it be until the fixture ends."""
    _KEPT_RAYS.add(name)
    try:
        yield
    finally:
        _KEPT_RAYS.discard(name)


#: What called Ray in this process while no Ray was connected (Ray would start one).
_AUTO_INITS: list[str] = []


def _refuse_auto_init() -> None:
    """In the tests' own process, a Ray API called while no Ray is connected raises instead
    of starting a new local Ray (Ray's auto-init): a thread left running by an earlier test
    would otherwise start one that later tests find. The test during which it happens fails
    at its teardown, naming the thread and the call."""
    import traceback

    import ray
    import ray._private.auto_init_hook as hook
    import ray._private.client_mode_hook as client_hook

    def refused():
        if ray.is_initialized():
            return
        import threading

        where = "".join(traceback.format_stack(limit=8)[:-1])
        _AUTO_INITS.append(
            f"thread {threading.current_thread().name!r} during "
            f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}:\n{where}"
        )
        raise RuntimeError("no Ray is connected in the tests' process (auto-init is off)")

    hook.auto_init_ray = refused
    client_hook.auto_init_ray = refused


_refuse_auto_init()


def stopped_after_last_user(name: str, stop):
    """Register ``stop`` to run after the last test that uses ``name``; return a function
    for the fixture's own teardown that runs it at most once."""
    done = []

    def once():
        if not done:
            done.append(True)
            stop()

    _STOP_AFTER_LAST_USER[name] = once
    return once


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray in this process (3 CPUs: the most any in-process test asks for)."""
    import ray

    from raytrain_mnist import compat
    from raytrain_mnist.driver.cluster import LOOPBACK, local_runtime_env, loopback_node

    # On loopback, without an autoscaler monitor and a log monitor (no driver reads the
    # workers' output), as fit starts its own.
    with loopback_node(), compat.lean_local_ray():
        ray.init(
            address="local",
            num_cpus=3,
            num_gpus=0,
            include_dashboard=False,
            _node_ip_address=LOOPBACK,
            runtime_env=local_runtime_env(),
            logging_level="WARNING",
            log_to_driver=False,
        )  # fit prints what matters
    stop = stopped_after_last_user("ray_local", ray.shutdown)
    yield ray
    stop()


@pytest.fixture(scope="session")
def _two_nodes_cluster():
    """A Ray cluster on this machine, reached by address like a real one: a head that hosts
    no training (0 CPUs) and two 1-CPU nodes. Started by the first test that needs it,
    stopped after the last."""
    from ray.cluster_utils import Cluster

    from raytrain_mnist.driver.cluster import loopback_node

    with loopback_node():  # every node on 127.0.0.1, listening on nothing else
        cluster = Cluster(
            initialize_head=True,
            # No autoscaler, and no driver of it reads its workers' output: no monitor
            # and no log monitor either; its agent's port is the system's (another Ray here
            # may hold Ray's fixed one): compat.lean_local_ray says why.
            head_node_args={
                "num_cpus": 0,
                "include_dashboard": False,
                "no_monitor": True,
                "include_log_monitor": False,
                "dashboard_agent_listen_port": 0,
            },
        )
        nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    stop = stopped_after_last_user("two_nodes", cluster.shutdown)
    yield cluster, nodes
    stop()


@pytest.fixture
def two_nodes(_two_nodes_cluster):
    """``_two_nodes_cluster`` with two live 1-CPU nodes, none of them draining, whatever the
    test before did to them (drained, removed, one added): each test starts on the same
    cluster, and a test that fails half-way fails alone."""
    from raytrain_mnist.driver.cluster import loopback_node

    cluster, nodes = _two_nodes_cluster
    state = cluster.global_state
    live, draining = state._live_node_ids(), state.get_draining_nodes()
    gone = [n for n in nodes if n.node_id not in live or n.node_id in draining]
    for node in gone + [n for n in nodes if n not in gone][2:]:
        cluster.remove_node(node)
        nodes.remove(node)
    if len(nodes) < 2:
        with loopback_node():
            nodes.extend(cluster.add_node(num_cpus=1) for _ in range(2 - len(nodes)))
        cluster.wait_for_nodes()
    return cluster, nodes


@pytest.fixture(scope="session")
def fitted(ray_local, tiny_mnist, tmp_path_factory) -> dict:
    """One 2-worker, 8-epoch `fit` on tiny data on one node, shared by the tests of fit,
    evaluate and tracking, and the uninterrupted reference of the failure scenario (every fit
    pays Ray Train's start-up; CONTRIBUTING.md): ``cfg``, ``result`` (the FitResult),
    ``summary`` and ``out``, what the command printed."""
    import io

    from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig
    from raytrain_mnist.fit import fit_and_show

    cfg = FitConfig(
        TrainConfig(epochs=8, batch_size=32, lr=0.05),
        RunSettings.from_flags(
            num_workers=2,
            cpus_per_worker=1,
            data_dir=str(tiny_mnist),
            dataset="mnist",
            keep_checkpoints=2,
            storage_path=str(tmp_path_factory.mktemp("runs")),
            name="fitted",
        ),
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = fit_and_show(cfg)  # the library's fit, shown as the command shows it
    return {"cfg": cfg, "summary": result.summary, "out": out.getvalue(), "result": result}


@pytest.fixture
def trained_run(fitted) -> dict:
    """The shared fit's summary.json."""
    return fitted["summary"]


@pytest.fixture
def ray_env():
    """The environment of a command that starts its own Ray (on short unix socket paths, its
    output unbuffered); whatever that Ray leaves is killed after the test, nothing else."""
    import shutil
    import tempfile

    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: unix socket paths
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "RAY_TMPDIR": str(ray_tmp),
        MARKER_VAR: uuid.uuid4().hex,  # on every process of the Ray the command starts
    }
    yield env
    kill_marked(env[MARKER_VAR])
    shutil.rmtree(ray_tmp, ignore_errors=True)


def run_cli_here(*args: str):
    """``raytrain-mnist ...`` in this process, for what ends before any Ray starts (error
    paths, one-process evaluation): the same exit status and output, without a new
    interpreter importing torch."""
    import io

    from raytrain_mnist.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(
        ["raytrain-mnist", *args], code, out.getvalue(), err.getvalue()
    )


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, cwd=None):
    """Run ``python -m raytrain_mnist ...`` as a user would; returns CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "raytrain_mnist", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or REPO,
        env={**os.environ, **(env or {})},
    )


# The suite's warm service, a fixture of every test file that asks for it (defined beside its
# helpers; a fixture imported here is one fixture, started once per test process).
from tests.warm_service import service  # noqa: E402, F401
