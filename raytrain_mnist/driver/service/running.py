"""The service's driver (:func:`run_service`): the data, the queue, the trainer whose
controller files every checkpoint into its request's run; and ``service status|stop``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from raytrain_mnist.config import RunSettings
from raytrain_mnist.driver import cluster
from raytrain_mnist.driver.events import EventSink, Note, Phase, Stopping, log_event
from raytrain_mnist.driver.relay import relay
from raytrain_mnist.driver.runs import RunStorage, is_safe_name, storage_root
from raytrain_mnist.driver.service.client import ServiceClient
from raytrain_mnist.driver.service.queue import (
    find_queue,
    registry_file,
    start_queue,
)
from raytrain_mnist.errors import EXIT_USAGE, UserError, cause_line

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- filing


def filing_callbacks(queue) -> list:
    """The service's controller callback: every committed checkpoint is filed into its
    request's run (the run's record rewritten as Ray's own), then the epoch goes to the
    request's stream with the filed path, as a ``fit``'s controller sends it."""
    import ray
    from ray.train import UserCallback

    class FileCheckpoints(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            report = metrics[0]
            request_id = report.get("request_id")
            where = ray.get(queue.run_of.remote(request_id)) if request_id else None
            if where is None:
                return
            path = None
            if checkpoint is not None:
                path = _file(where, checkpoint, report)
                if path is not None:
                    queue.filed.remote(request_id, path)
            item = {**report, "checkpoint": path, "committed_at": time.time()}
            queue.put.remote(request_id, item)

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
    where its Train run lives), and the storage roots requests may write under."""

    name: str
    run: RunSettings = field(default_factory=RunSettings)
    storage_roots: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not is_safe_name(self.name):
            raise UserError(f"--name {self.name!r}: a service name is a plain name", EXIT_USAGE)
        if self.run.scaling.elastic:
            raise UserError(
                "a service runs a fixed number of workers: give --num-workers N", EXIT_USAGE
            )

    @property
    def roots(self) -> list[str]:
        roots = self.storage_roots or (self.run.storage.storage_path,)
        return [storage_root(r) for r in roots]


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
    (or start) Ray, start the queue and the trainer, call ``ready(info)`` once its workers
    wait for requests. Ctrl-C cancels the request in flight (its run stays resumable)."""
    emit = on_event or log_event
    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.driver.runs.records import data_identity

    run = spec.run
    data = load_mnist(run.data.data_dir, run.data.dataset)
    emit(Note(f"data loaded: {data.train_size} train / {data.test_size} test ({data.kind})"))
    address = cluster.resolve_address(run.address)
    cpus = run.scaling.cpus_per_worker or cluster.default_cpus_per_worker(
        run.scaling.num_workers, address is None
    )
    request = cluster.Request.for_run(run, cpus)
    with cluster.connect(address, request, dashboard=False):
        import ray

        info = {
            "name": spec.name,
            "num_workers": run.scaling.num_workers,
            "use_gpu": run.scaling.use_gpu,
            "cpus_per_worker": cpus,
            "backend": run.resolved_backend,
            "dataset": run.data.dataset,
            "data": {**data_identity(data), "source": data.source},
            "storage_roots": spec.roots,
            "address": ray.get_runtime_context().gcs_address,
            "pid": os.getpid(),
            "logs": cluster.worker_logs_dir(),  # on the service's node
        }
        try:
            queue = start_queue(info)
            ray.get(queue.info.remote())
        except ValueError:
            raise UserError(f"a service named '{spec.name}' already runs on this cluster") from None
        with _registered(spec.name, info):
            return _serve(spec, queue, data, cpus, emit, ready)


@contextlib.contextmanager
def _registered(service: str, info: dict) -> Iterator[None]:
    path = registry_file(service)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"address": info["address"], "pid": info["pid"]}
    path.write_text(json.dumps(record))
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if json.loads(path.read_text()) == record:
                path.unlink()


def _serve(spec, queue, data, cpus: int, emit: EventSink, ready) -> ServiceResult:
    import ray

    from raytrain_mnist.driver.trainer import build_trainer
    from raytrain_mnist.worker.service import serve_requests

    run = spec.run
    trainer = build_trainer(
        dataclasses.replace(
            run, checkpoint=dataclasses.replace(run.checkpoint, keep_checkpoints=1)
        ),
        serve_requests,
        {"data": ray.put(data), "queue": queue, "cpus_per_worker": cpus},
        cpus,
        spec.roots[0],
        f".service-{spec.name}",
        callbacks=filing_callbacks(queue),
    )
    emit(Phase(f"service '{spec.name}': starting {run.scaling.num_workers} worker(s)", 0.0))
    watcher = threading.Thread(
        target=_announce_ready, args=(queue, emit, ready), name="service-ready", daemon=True
    )
    watcher.start()

    def stop(reason: str, running) -> None:
        emit(Stopping("stopping the service; the request in flight stays resumable"))
        ray.get(queue.stop.remote("cancel"), timeout=30)

    try:
        outcome = relay(trainer.fit, stop, name="service", stop_wait_s=120.0)
    except ray.train.TrainingFailedError as exc:
        return ServiceResult("failed", _served(queue), cause_line(exc))
    return ServiceResult("stopped", _served(queue), interrupted=outcome.stopped is not None)


def _served(queue) -> int:
    import ray

    try:
        return ray.get(queue.info.remote(), timeout=30)["served"]
    except Exception:  # the count is for people; the service has ended either way
        return 0


def _announce_ready(queue, emit: EventSink, ready) -> None:
    import ray

    while True:
        try:
            info = ray.get(queue.info.remote(), timeout=30)
        except Exception:
            return
        if "workers" in info:
            emit(Note(f"ready: {info['workers']} worker(s) on {info['device']}, waiting"))
            if ready is not None:
                ready(info)
            return
        time.sleep(0.2)


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
