"""The service's driver (:func:`run_service`): the data, the queue, the trainer whose
controller files every checkpoint into its request's run; and ``service status|stop``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from raytrain_mnist.config import RunSettings, check_run_name
from raytrain_mnist.display import printable
from raytrain_mnist.driver import cluster
from raytrain_mnist.driver.events import EventSink, Note, Phase, Stopping, log_event
from raytrain_mnist.driver.relay import relay
from raytrain_mnist.driver.runs import RunStorage, storage_root
from raytrain_mnist.driver.service.client import ServiceClient
from raytrain_mnist.driver.service.queue import find_queue, registry_file, start_queue
from raytrain_mnist.driver.service.request import canonical
from raytrain_mnist.errors import EXIT_USAGE, ConfigError, UserError, cause_line

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- filing


def filing_callbacks(queue, token: str, group: int = 0) -> list:
    """The controller callback of the service's worker group ``group``: every committed
    checkpoint is filed into its request's run (the run's record rewritten as Ray's own),
    then the epoch goes to the request's stream with the filed path, as a ``fit``'s
    controller sends it; the workers' failures go to the queue (the request's error line)."""
    import ray
    from ray.train import UserCallback

    class FileCheckpoints(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            report = metrics[0]
            request_id = report.get("request_id")
            where = ray.get(queue.run_of.remote(token, request_id)) if request_id else None
            if where is None:
                return
            path = None
            if checkpoint is not None:
                path = _file(where, checkpoint, report)
                if path is not None:
                    queue.filed.remote(token, request_id, path)
            item = {**report, "checkpoint": path, "committed_at": time.time()}
            queue.put.remote(token, request_id, item)

        def after_exception(self, run_context, worker_exceptions):
            errors = [cause_line(e) for _, e in sorted(worker_exceptions.items())]
            queue.group_failed.remote(token, group, errors[0] if errors else "a worker failed")

    return [FileCheckpoints()]


def _file(where: dict, checkpoint, report: dict) -> str | None:
    from raytrain_mnist.driver.runs.filing import file_checkpoint

    files = RunStorage(where["storage"], where["name"])
    try:
        return file_checkpoint(files, checkpoint.path, checkpoint.filesystem, report, where["keep"])
    except Exception as exc:  # the run resumes from the last one filed
        logger.warning("could not file a checkpoint into %s: %s", files.dir, cause_line(exc))
        return None


# --------------------------------------------------------------------------- the driver


@dataclass(frozen=True)
class ServiceSpec:
    """What a service is: its name, how its workers run (``run``: the scaling, torch and
    data sections of :class:`RunSettings`, its ``address``, and its own storage path,
    where its Train run lives), the storage roots requests may write under, and how many
    worker groups of ``run.scaling.num_workers`` each train requests side by side."""

    name: str
    run: RunSettings = field(default_factory=RunSettings)
    storage_roots: tuple[str, ...] = ()
    groups: int = 1

    def __post_init__(self) -> None:
        try:  # the library call's check, in the words the command's own gives
            check_run_name(self.name, "--name", "service")
        except ConfigError as bad:
            raise UserError(str(bad), EXIT_USAGE) from None
        if self.run.scaling.elastic:
            raise UserError(
                "a service runs a fixed number of workers: give --num-workers N", EXIT_USAGE
            )
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise UserError(f"--groups {self.groups}: a count >= 1", EXIT_USAGE)

    @property
    def roots(self) -> list[str]:
        """The storage roots, each as what it names (:func:`~.request.canonical`)."""
        roots = self.storage_roots or (self.run.storage.storage_path,)
        named = [canonical(storage_root(r)) for r in roots]
        if None in named:
            raise UserError(f"--storage-root: one of {', '.join(roots)} names no plain path")
        return named


@dataclass(frozen=True)
class ServiceResult:
    """How :func:`run_service` ended: ``stopped`` (stop or Ctrl-C) or ``failed``."""

    status: str
    served: int
    error: str | None = None
    interrupted: bool = False  # Ctrl-C or SIGTERM stopped it


def run_service(
    spec: ServiceSpec,
    on_event: EventSink | None = None,
    ready: Callable[[dict], Any] | None = None,
) -> ServiceResult:
    """Run the service until ``service stop`` or Ctrl-C (SIGTERM is one): load MNIST, join
    (or start) Ray, start the queue and the trainers, call ``ready(info)`` once every
    worker group waits for requests. Ctrl-C cancels the requests in flight (their runs
    stay resumable)."""
    emit = on_event or log_event
    from raytrain_mnist.data import load_mnist

    run = spec.run
    _check_not_registered(spec.name)
    data = load_mnist(run.data.data_dir, run.data.dataset)
    emit(Note(f"data loaded: {data.train_size} train / {data.test_size} test ({data.kind})"))
    address = cluster.resolve_address(run.address)
    workers = run.scaling.num_workers * spec.groups
    cpus = run.scaling.cpus_per_worker or cluster.default_cpus_per_worker(workers, address is None)
    request = cluster.Request.for_run(run, cpus)
    request = dataclasses.replace(request, num_workers=request.num_workers * spec.groups)
    with cluster.connect(address, request, dashboard=False) as own_ray:
        import ray

        info = _info(spec, data, cpus)
        token = secrets.token_hex(16)  # only the service's own worker groups hold it
        try:
            queue = start_queue(info, token)
            ray.get(queue.info.remote())
        except ValueError:
            raise UserError(f"a service named '{spec.name}' already runs on this cluster") from None
        with _registered(spec.name, info):
            return _serve(spec, queue, token, data, cpus, emit, ready, own_ray)


def _info(spec: ServiceSpec, data, cpus: int) -> dict[str, Any]:
    """The service's record: what ``service status`` shows and what a requester checks."""
    import ray

    from raytrain_mnist.driver.runs.records import data_identity

    run = spec.run
    data_dir = run.data.data_dir
    return {
        "name": spec.name,
        "groups": spec.groups,
        "num_workers": run.scaling.num_workers,
        "use_gpu": run.scaling.use_gpu,
        "gpus_per_worker": run.scaling.gpus if run.scaling.use_gpu else 0,
        "cpus_per_worker": cpus,
        "backend": run.resolved_backend,
        "dataset": run.data.dataset,
        # Recorded in every run it trains, as a plain fit records its --data-dir.
        "data_dir": None if data_dir is None else str(Path(data_dir).expanduser().resolve()),
        "data": {**data_identity(data), "source": data.source},
        "storage_roots": spec.roots,
        "max_failures": run.failure.max_failures,
        "address": ray.get_runtime_context().gcs_address,
        "pid": os.getpid(),
        "logs": cluster.worker_logs_dir(),  # on the service's node
    }


def _check_not_registered(service: str) -> None:
    """Refuse to start a second service of a name this machine's registry holds for a
    service still running (its process alive): a name finds the service it names."""
    try:
        record = json.loads(registry_file(service).read_text())
        pid, born = int(record["pid"]), float(record["pid_started"])
        alive = psutil.pid_exists(pid) and psutil.Process(pid).create_time() == born
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return  # no entry, or one of a service that is gone
    if alive and pid != os.getpid():
        raise UserError(
            f"a service named '{service}' already runs on this machine (pid {pid}, Ray at "
            f"{printable(str(record.get('address')), lines=False)}); stop it first "
            f"(`raytrain-mnist service stop --name {service}`) or pick another --name",
            EXIT_USAGE,
        )


@contextlib.contextmanager
def _registered(service: str, info: dict) -> Iterator[None]:
    path = registry_file(service)
    path.parent.mkdir(parents=True, exist_ok=True)
    born = psutil.Process().create_time()
    record = {"address": info["address"], "pid": info["pid"], "pid_started": born}
    path.write_text(json.dumps(record))
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()) == record:
                path.unlink()


def _serve(
    spec, queue, token: str, data, cpus: int, emit: EventSink, ready, own_ray: bool
) -> ServiceResult:
    """The service's worker groups, each its own TorchTrainer, fitted side by side until
    the queue tells their workers to stop. ``own_ray``: the service started its Ray, which
    stops with it (as a fit's own: no placement-group cleaners, :func:`build_trainer`)."""
    import ray

    from raytrain_mnist.driver.trainer import build_trainer
    from raytrain_mnist.worker import serve_requests

    run = spec.run
    # Ray Train's own failure budget is unlimited: the queue keeps the service's (a
    # restart is charged to the request in flight, or to the service).
    run = dataclasses.replace(
        run,
        checkpoint=dataclasses.replace(run.checkpoint, keep_checkpoints=1),
        failure=dataclasses.replace(run.failure, max_failures=-1),
    )
    shared = ray.put(data)
    trainers = [
        build_trainer(
            run,
            serve_requests,
            {"data": shared, "queue": queue, "cpus_per_worker": cpus, "token": token, "group": g},
            cpus,
            spec.roots[0],
            f".service-{spec.name}" + (f"-group{g}" if g else ""),
            callbacks=filing_callbacks(queue, token, g),
            own_ray=own_ray,
        )
        for g in range(spec.groups)
    ]
    groups = f"{spec.groups} group(s) of " if spec.groups > 1 else ""
    emit(Phase(f"service '{spec.name}': starting {groups}{run.scaling.num_workers} worker(s)", 0))
    with _watching(lambda: ray.get(queue.info.remote(), timeout=30), emit, ready) as stopping:

        def stop(reason: str, running) -> None:
            stopping.set()  # a group that gets ready now is no service ready to serve
            emit(Stopping("stopping the service; the requests in flight stay resumable"))
            ray.get(queue.stop.remote("cancel"), timeout=30)

        try:
            outcome = relay(
                lambda: _fit_all(trainers, queue), stop, name="service", stop_wait_s=120
            )
        except ray.train.TrainingFailedError as exc:
            return ServiceResult("failed", _served(queue), cause_line(exc))
        finally:
            with contextlib.suppress(Exception):  # the queue ends with this driver either way
                ray.get(queue.closed.remote(token), timeout=30)
    last = _last_info(queue)
    if last.get("failed"):
        return ServiceResult("failed", last.get("served", 0), last["failed"])
    return ServiceResult("stopped", last.get("served", 0), interrupted=outcome.stopped is not None)


@contextlib.contextmanager
def _watching(info: Callable[[], dict], emit: EventSink, ready) -> Iterator[threading.Event]:
    """:func:`_watch_groups` on a thread for as long as the block runs; yields the event
    that ends it. Its last look ends before the block does, so before the Ray it looks
    through shuts down: a Ray call made after that would have Ray's auto-init join
    whatever other Ray runs on this machine."""
    stopping = threading.Event()
    watcher = threading.Thread(
        target=_watch_groups, args=(info, emit, ready, stopping), name="service-groups", daemon=True
    )
    watcher.start()
    try:
        yield stopping
    finally:
        stopping.set()
        watcher.join()


def _fit_all(trainers: list, queue) -> None:
    """Every group's ``fit()`` on a thread of its own; the first that raises stops the
    others (through the queue) and is raised once all have ended."""
    import ray

    errors: list[BaseException] = []

    def fit(trainer) -> None:
        try:
            trainer.fit()
        except BaseException as exc:
            errors.append(exc)
            with contextlib.suppress(Exception):
                ray.get(queue.stop.remote("cancel"), timeout=30)

    threads = [
        threading.Thread(target=fit, args=(t,), name=f"service-group{g}", daemon=True)
        for g, t in enumerate(trainers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _last_info(queue) -> dict:
    import ray

    try:
        return ray.get(queue.info.remote(), timeout=30)
    except Exception:  # the record is for people; the service has ended either way
        return {}


def _served(queue) -> int:

    return _last_info(queue).get("served", 0)


#: Seconds between two looks at the groups once the service is ready (a restart is said then).
GROUPS_CHECK_S = 1.0


def _watch_groups(
    info: Callable[[], dict], emit: EventSink, ready, stopping: threading.Event
) -> None:
    """Says when every group is ready, then each group restart as it is seen (its request
    resumes from its last filed checkpoint): the operator reads it in the service's output,
    as a plain fit's user reads theirs. ``info``: the queue's record. Ends once
    ``stopping`` is set (a service stopped before its groups were ready is never said to
    be ready) or the queue cannot be asked."""
    restarts: dict[int, int] | None = None  # group -> restarts said, once ready
    while not stopping.is_set():
        try:
            record = info()
        except Exception:
            return
        if stopping.is_set():
            return
        if restarts is None and record.get("ready"):
            groups = f"{record['groups']} group(s) of " if record["groups"] > 1 else ""
            emit(
                Note(f"ready: {groups}{record['workers']} worker(s) on {record['device']}, waiting")
            )
            if ready is not None:
                ready(record)
            restarts = {g["group"]: g["restarts"] for g in record["group_states"]}
        elif restarts is not None:
            for g in record["group_states"]:
                if g["restarts"] > restarts.get(g["group"], g["restarts"]):
                    resumes = f"; request '{g['request']}' resumes from its last filed checkpoint"
                    said = f"group {g['group']} restarted (restart {g['restarts']})"
                    emit(Note(said + (resumes if g["request"] else "")))
                restarts[g["group"]] = g["restarts"]
        stopping.wait(0.2 if restarts is None else GROUPS_CHECK_S)


# --------------------------------------------------------------------------- status, stop


@contextlib.contextmanager
def _connected(service: str, address: str | None) -> Iterator[Any]:
    """The queue of ``service``, on its cluster, for as long as the block runs."""
    import ray

    where = ServiceClient.address_of(service, address)
    with cluster.connect(where, cluster.Request(0, 1, False), dashboard=False):
        try:
            yield find_queue(service)
        finally:
            ray.shutdown()


def status(service: str, address: str | None = None) -> dict:
    """What ``service status`` shows: the queue's record of the service."""
    import ray

    with _connected(service, address) as queue:
        return ray.get(queue.info.remote(), timeout=60)


def stop(service: str, address: str | None = None, mode: str = "cancel") -> dict:
    """Ask the service to stop (``drain``: after its queue; ``cancel``: now) and wait until
    its driver has ended (its queue goes with it). Returns its last record."""
    import ray

    with _connected(service, address) as queue:
        ray.get(queue.stop.remote(mode), timeout=60)
        info = ray.get(queue.info.remote(), timeout=60)
        while True:
            try:
                info = ray.get(queue.info.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return info
            time.sleep(0.2)
