"""A service's queue (:class:`ServiceQueue`, a named actor): its requests, their
streams and states, and the checks a request passes before it is queued."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrain_mnist import compat
from raytrain_mnist.config import TrainConfig
from raytrain_mnist.driver.runs import LEASE_TTL_S, is_safe_name, storage_root
from raytrain_mnist.errors import UserError
from raytrain_mnist.run_settings import TorchSettings

logger = logging.getLogger(__name__)

#: The Ray namespace of every service's named queue.
NAMESPACE = "raytrain_mnist"
#: How long a request outlives its requester's silence (the requester asks every poll).
REQUEST_LEASE_S = float(os.environ.get("RAYTRAIN_MNIST_REQUEST_LEASE_S", LEASE_TTL_S))
#: Seconds a long poll (a requester's state, rank 0's cancel question) may wait for news.
LONG_POLL_S = 1.0
#: Threads of the queue's 32 that long polls may hold at once (:meth:`ServiceQueue._waited`).
MAX_WAITERS = 16
#: What a request's state can be; the last three end it.
WAITING, RUNNING, FINISHED, FAILED, CANCELLED = (
    "waiting",
    "running",
    "finished",
    "failed",
    "cancelled",
)
ENDED = (FINISHED, FAILED, CANCELLED)
#: What a request holds, and all it holds: the run's validated training settings
#: (``train``), where its run lives (``storage``, ``name``), the checkpoint it resumes from
#: (``resume_from``, inside that run, or None), its id, whether rank 0 streams progress,
#: torch.compile, ``--cuda-graphs``. Data, never code: the workers read nothing else.
REQUEST_KEYS = (
    "id", "train", "storage", "name", "resume_from", "progress", "compile", "cuda_graphs",
)  # fmt: skip


def queue_name(service: str) -> str:
    return f"service-{service}"


def registry_file(service: str) -> Path:
    """Where a service started on this machine writes its Ray's address, so that ``fit
    --service NAME`` here finds it without ``--address``."""
    from raytrain_mnist.paths import default_cache_dir

    return default_cache_dir() / "services" / f"{service}.json"


# --------------------------------------------------------------------------- the queue


class ServiceQueue:
    """The service's requests and their streams. Ray runs it threaded (:func:`start_queue`),
    so a rank 0 waiting in :meth:`take` never blocks a requester's :meth:`drain`."""

    def __init__(self, info: dict[str, Any]) -> None:
        self._info = dict(info)  # the service's settings, data, roots (ServiceSpec.info)
        self._cond = threading.Condition()
        self._waiting: list[str] = []
        self._requests: dict[str, dict[str, Any]] = {}
        self._in_flight: str | None = None
        self._stopping: str | None = None  # "drain" or "cancel"
        self._served = 0
        self._started = time.time()
        self._group: dict[str, Any] = {}
        self._jobs_asked = float("-inf")  # when _expire last asked the GCS about requesters
        self._waiters = 0  # threads in a long poll (_waited)

    # ------------------------------------------------------------ the service's side

    def info(self) -> dict[str, Any]:
        """The service's record, for ``service status`` and for a requester's checks."""
        with self._cond:
            self._expire()
            in_flight = self._requests.get(self._in_flight or "")
            return {
                **self._info,
                **self._group,
                "uptime_s": round(time.time() - self._started, 1),
                "queue": len(self._waiting),
                "in_flight": in_flight["request"]["name"] if in_flight else None,
                "served": self._served,
                "stopping": self._stopping,
            }

    def group_started(self, started_at: float, world_size: int, device: str) -> None:
        """Rank 0 of a (re)started worker group: it is ready for requests."""
        with self._cond:
            restarts = self._group.get("restarts", -1) + 1
            self._group = {"workers": world_size, "device": device, "restarts": restarts,
                           "group_started_at": started_at}  # fmt: skip
            self._cond.notify_all()

    def stop(self, mode: str) -> None:
        """``drain``: serve what is queued, then end; ``cancel``: end the request in flight
        (its run stays resumable) and refuse what waits."""
        with self._cond:
            self._stopping = mode
            if mode == "cancel":
                for request_id in list(self._waiting):
                    self._end(request_id, CANCELLED, "the service stopped")
                self._waiting.clear()
            self._cond.notify_all()

    # ------------------------------------------------------------ rank 0's side

    def take(self, wait_s: float) -> dict | str | None:
        """The next request for the workers (the one in flight again after a worker-group
        restart, from its latest filed checkpoint), ``"stop"``, or None after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                self._expire()
                if self._in_flight is not None:  # the group restarted under it
                    entry = self._requests[self._in_flight]
                    return {**entry["request"], "resume_from": entry["filed"]}
                if self._stopping == "cancel" or (self._stopping and not self._waiting):
                    return "stop"
                if self._waiting:
                    request_id = self._waiting.pop(0)
                    entry = self._requests[request_id]
                    entry["state"], self._in_flight = RUNNING, request_id
                    self._push(request_id, {"progress": "request", "state": RUNNING})
                    return {**entry["request"], "resume_from": entry["filed"]}
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def cancelled(self, request_id: str, wait_s: float = 0.0) -> bool:
        """Whether the request is to stop: at once when it is, else after up to ``wait_s``
        (rank 0 keeps one such question in flight: one call a second, not one a step)."""
        with self._cond:
            return self._waited(wait_s, lambda: self._is_cancelled(request_id), bool)

    def _is_cancelled(self, request_id: str) -> bool:
        self._expire()
        entry = self._requests.get(request_id)
        return entry is None or bool(entry["cancel"]) or self._stopping == "cancel"

    def _waited(self, wait_s: float, answer: Callable[[], Any], ready: Callable[[Any], bool]):
        """``answer()`` once ``ready`` of it or ``wait_s`` passed, in the lock. Long polls
        take at most :data:`MAX_WAITERS` of the actor's threads: past that, they answer at
        once (what rank 0 and the controller call never waits for a thread)."""
        deadline = time.monotonic() + min(max(float(wait_s), 0.0), 5.0)
        value = answer()
        if ready(value) or self._waiters >= MAX_WAITERS:
            return value
        self._waiters += 1
        try:
            while not ready(value) and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(min(left, 1.0))  # the lease of silent requesters, each second
                value = answer()
        finally:
            self._waiters -= 1
        return value

    def done(self, request_id: str, status: str, error: str | None = None) -> None:
        """Rank 0: the request ended on every rank."""
        with self._cond:
            if self._in_flight == request_id:
                self._in_flight = None
            self._served += 1
            entry = self._requests.get(request_id)
            if entry is not None and entry["cancel"] and status == CANCELLED:
                error = entry["cancel"]
            self._end(request_id, status, error)
            self._cond.notify_all()

    def put(self, request_id: str, item: dict) -> None:
        """Rank 0's progress and the controller's committed epochs, for the requester."""
        with self._cond:
            self._push(request_id, item)

    def filed(self, request_id: str, path: str) -> None:
        """The controller filed a checkpoint of the request into its run."""
        with self._cond:
            entry = self._requests.get(request_id)
            if entry is not None:
                entry["filed"] = path

    def run_of(self, request_id: str) -> dict | None:
        """Where the request's run lives and what it keeps (the controller's filing)."""
        with self._cond:
            entry = self._requests.get(request_id)
            if entry is None:
                return None
            r = entry["request"]
            return {"storage": r["storage"], "name": r["name"], "keep": entry["keep"]}

    # ------------------------------------------------------------ the requester's side

    def submit(self, request: dict, keep: int, requester: str | None = None) -> dict:
        """Queue ``request`` (:data:`REQUEST_KEYS`, checked
        here again: the queue trusts no client); returns its id and place, or the one-line
        reason it is refused. ``requester``: the requesting driver's Ray job id (hex),
        which tells a requester that is gone from one that is slow to ask."""
        try:
            request = _checked_request(request, self._info["storage_roots"])
        except (UserError, ValueError, TypeError, KeyError) as exc:
            return {"refused": str(exc)}
        with self._cond:
            self._expire()
            if self._stopping:
                return {"refused": f"service '{self._info['name']}' is stopping"}
            busy = [e for e in self._requests.values() if e["state"] in (WAITING, RUNNING)]
            if any(_same_run(e["request"], request) for e in busy):
                return {"refused": f"run '{request['name']}' is already queued or training"}
            request_id = uuid.uuid4().hex[:12]
            self._requests[request_id] = {
                "request": {**request, "id": request_id},
                "state": WAITING,
                "items": [],
                "dropped": 0,
                "seen": time.monotonic(),
                "cancel": None,
                "filed": request.get("resume_from"),
                "keep": int(keep),
                "error": None,
                "epoch": 0,
                "requester": requester if isinstance(requester, str) else None,
            }
            self._waiting.append(request_id)
            self._cond.notify_all()
            return {"id": request_id, "place": len(self._waiting)}

    def drain(self, request_id: str, acknowledged: int = 0) -> tuple[int, list[dict]]:
        """As a run channel's ``drain`` (its requester's monitor calls it every poll):
        the items not yet acknowledged. Each call renews the request's lease."""
        with self._cond:
            entry = self._requests.get(request_id)
            if entry is None:
                return acknowledged, []
            entry["seen"] = time.monotonic()
            if acknowledged > entry["dropped"]:
                del entry["items"][: acknowledged - entry["dropped"]]
                entry["dropped"] = acknowledged
            return entry["dropped"], list(entry["items"])

    def state(self, request_id: str, known: dict | None = None, wait_s: float = 0.0) -> dict:
        """The request's state, its place in the queue (1 = next), its error and the last
        epoch committed (the controller's stream, which trails the workers' end). Given the
        state the requester ``known``, waits up to ``wait_s`` for another (a long poll:
        the requester hears of a change at once, without asking 20 times a second)."""
        with self._cond:
            return self._waited(wait_s, lambda: self._state(request_id), lambda s: s != known)

    def _state(self, request_id: str) -> dict:
        entry = self._requests.get(request_id)
        if entry is None:
            return {"state": CANCELLED, "place": None, "error": "unknown request"}
        entry["seen"] = time.monotonic()
        place = self._waiting.index(request_id) + 1 if request_id in self._waiting else None
        return {"state": entry["state"], "place": place, "error": entry["error"],
                "epoch": entry["epoch"]}  # fmt: skip

    def cancel(self, request_id: str, reason: str = "cancelled by its requester") -> None:
        with self._cond:
            self._cancel(request_id, reason)
            self._cond.notify_all()

    # ------------------------------------------------------------ inside the lock

    def _cancel(self, request_id: str, reason: str) -> None:
        entry = self._requests.get(request_id)
        if entry is None or entry["state"] in ENDED:
            return
        entry["cancel"] = reason
        if request_id in self._waiting:
            self._waiting.remove(request_id)
            self._end(request_id, CANCELLED, reason)
        self._cond.notify_all()

    def _end(self, request_id: str, status: str, error: str | None) -> None:
        entry = self._requests.get(request_id)
        if entry is None:
            return
        entry["state"], entry["error"] = status, error
        self._push(request_id, {"progress": "request", "state": status, "error": error})

    def _push(self, request_id: str, item: dict) -> None:
        entry = self._requests.get(request_id)
        if entry is not None:
            entry["items"].append({**item, "received": time.time()})
            if "progress" not in item:  # a committed epoch (the controller's)
                entry["epoch"] = max(entry["epoch"], int(item.get("epoch") or 0))
            self._cond.notify_all()  # the long polls (a state, an epoch, an end)

    def _expire(self) -> None:
        """Cancel what nobody asks about any more, and forget what ended long ago. A
        request silent past its lease is cancelled once its requester's job is dead (or
        cannot be asked about): a requester on a loaded machine may be slow, not gone."""
        now = time.monotonic()
        silent = {}
        for request_id, entry in list(self._requests.items()):
            quiet = now - entry["seen"]
            if entry["state"] in ENDED:
                if quiet > 10 * REQUEST_LEASE_S:
                    del self._requests[request_id]
            elif quiet > REQUEST_LEASE_S:
                silent[request_id] = entry["requester"]
        if not silent or now - self._jobs_asked < 1.0:  # the GCS, at most once a second
            return
        self._jobs_asked = now
        dead = compat.dead_jobs({job for job in silent.values() if job})
        for request_id, job in silent.items():
            if dead is None or job is None or job in dead:
                self._cancel(request_id, "its requester went silent (its lease lapsed)")


def _same_run(a: dict, b: dict) -> bool:
    return (a["storage"], a["name"]) == (b["storage"], b["name"])


def _checked_request(request: dict, roots: list[str]) -> dict:
    """A request as the service accepts it: exactly its keys, the training settings valid,
    the run a plain name under one of the service's storage roots, and the checkpoint it
    resumes from inside that run."""
    keys = set(REQUEST_KEYS) - {"id"}
    if set(request) != keys:
        raise ValueError(f"a request holds {sorted(keys)}, not {sorted(request)}")
    train = TrainConfig.from_dict(request["train"]).to_dict()
    name, storage = request["name"], request["storage"]
    if not isinstance(name, str) or not is_safe_name(name):
        raise ValueError(f"run name {name!r} is not a plain name")
    if not isinstance(storage, str) or not within_roots(storage, roots):
        raise ValueError(
            f"--storage-path {storage!r} is outside the service's storage roots "
            f"({', '.join(roots)}); start the service with --storage-root for it"
        )
    resume = request["resume_from"]
    run_dir = f"{storage_root(storage).rstrip('/')}/{name}"
    if resume is not None and (
        not isinstance(resume, str)
        or resume.rsplit("/", 1)[0] != run_dir
        or not is_safe_name(resume.rsplit("/", 1)[-1])
    ):
        raise ValueError(f"the checkpoint to resume from is not one of run '{name}''s")
    return {
        "train": train,
        "storage": storage_root(storage),
        "name": name,
        "resume_from": resume,
        "progress": bool(request["progress"]),
        "compile": bool(request["compile"]),
        "cuda_graphs": TorchSettings(cuda_graphs=request["cuda_graphs"]).cuda_graphs,
    }


def within_roots(storage: str, roots: list[str]) -> bool:
    """Whether the storage path ``storage`` lies under one of ``roots`` (paths resolved,
    URIs compared by prefix)."""
    where = storage_root(storage).rstrip("/")
    if ".." in where.split("/"):  # a URI is not resolved: no way up out of a root
        return False
    return any(where == r.rstrip("/") or where.startswith(r.rstrip("/") + "/") for r in roots)


def start_queue(info: dict[str, Any]):
    """The service's :class:`ServiceQueue`, named after it, on this (the driver's) node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return (
        ray.remote(num_cpus=0, max_concurrency=32)(ServiceQueue)
        .options(
            name=queue_name(info["name"]),
            namespace=NAMESPACE,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False
            ),
        )
        .remote(info)
    )


def find_queue(service: str):
    """The running service's queue, or one line saying there is none."""
    import ray

    try:
        return ray.get_actor(queue_name(service), namespace=NAMESPACE)
    except ValueError:
        raise UserError(
            f"no service '{service}' on this Ray cluster; start one with "
            f"`raytrain-mnist service start --name {service}`"
        ) from None
