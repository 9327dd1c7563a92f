"""A service's queue (:class:`ServiceQueue`, a named actor): its requests, their streams and
states, and its worker groups. A plain class: Ray runs it as a threaded actor
(:func:`start_queue`), and the tests call it directly.

Who may call what: any Ray driver on the cluster can call a named actor, so every method
checks its caller. A requester's request is checked in one place
(:func:`~.request.check_request`); a request's id is a capability (random, 128 bits: only
its requester learns it); the workers' and the controller's methods (``take``, ``put``,
``filed``, ``done``...) answer only a caller holding the token the service handed its own
worker groups when it started them.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrain_mnist import compat
from raytrain_mnist.driver.runs import LEASE_TTL_S
from raytrain_mnist.driver.service.request import (
    RequestError,
    ServiceRequest,
    check_request,
    checkpoint_inside,
)
from raytrain_mnist.errors import UserError

logger = logging.getLogger(__name__)

#: The Ray namespace of every service's named queue.
NAMESPACE = "raytrain_mnist"
#: How long a request outlives its requester's silence (the requester asks every poll).
REQUEST_LEASE_S = float(os.environ.get("RAYTRAIN_MNIST_REQUEST_LEASE_S", LEASE_TTL_S))
#: Seconds a long poll (a requester's state, rank 0's cancel question) may wait for news.
LONG_POLL_S = 1.0
#: The actor's threads, and how many of them long polls may hold at once (:meth:`_waited`):
#: the rest stay free for the workers, the controller and the requesters' other calls.
THREADS, MAX_WAITERS = 32, 16
#: Requests that may wait at once; past it a submit is refused ("service S is full").
MAX_WAITING = int(os.environ.get("RAYTRAIN_MNIST_SERVICE_MAX_WAITING", "64"))
#: A request that has failed its worker group this many times fails alone: one bad
#: request never spends the service's own budget of restarts.
MAX_REQUEST_FAILURES = 2
#: Items a request's stream holds undrained (a requester that never drains drops the oldest).
MAX_ITEMS = 10_000
#: What a request's state can be; the last three end it.
WAITING, RUNNING, FINISHED, FAILED, CANCELLED = (
    "waiting",
    "running",
    "finished",
    "failed",
    "cancelled",
)
ENDED = (FINISHED, FAILED, CANCELLED)


def queue_name(service: str) -> str:
    return f"service-{service}"


def registry_file(service: str) -> Path:
    """Where a service started on this machine writes its Ray's address, so that ``fit
    --service NAME`` here finds it without ``--address``."""
    from raytrain_mnist.paths import default_cache_dir

    return default_cache_dir() / "services" / f"{service}.json"


class NotAWorker(PermissionError):
    """A caller of a worker's method that does not hold the service's token."""


class ServiceQueue:
    """The service's requests, their streams and its worker groups.

    ``info``: the service's record (name, ``groups``, ``num_workers``, data,
    ``storage_roots``, ``max_failures``...); ``token``: the secret of its worker groups;
    ``dead_jobs``: which of a set of Ray job ids are gone or unknown (the GCS's answer,
    None when it cannot be asked)."""

    def __init__(
        self,
        info: dict[str, Any],
        token: str = "",
        dead_jobs: Callable[[set[str]], set[str] | None] = compat.dead_jobs,
    ) -> None:
        self._info = dict(info)
        self._token = token
        self._dead_jobs = dead_jobs
        self._cond = threading.Condition()
        self._waiting: list[str] = []
        self._requests: dict[str, dict[str, Any]] = {}
        self._groups: dict[int, dict[str, Any]] = {}
        self._stopping: str | None = None  # "drain" or "cancel"
        self._failed: str | None = None  # the service's own budget spent: why
        self._failures = 0  # group restarts charged to the service, not to a request
        self._served = 0
        self._started = time.time()
        self._jobs_asked = float("-inf")  # when _expire last asked the GCS about requesters
        self._waiters = 0  # threads in a long poll (_waited)
        self._snapshot: dict[str, Any] = {}
        self._publish()

    # ------------------------------------------------------------ the service's side

    def info(self) -> dict[str, Any]:
        """The service's record, for ``service status`` and a requester's checks. It
        takes no lock (a snapshot made at every change), and Ray gives it threads of its
        own: it answers at once however many long polls wait."""
        return {**self._snapshot, "uptime_s": round(time.time() - self._started, 1)}

    def stop(self, mode: str) -> None:
        """``drain``: serve what is queued, then end; ``cancel``: end the requests in flight
        (their runs stay resumable) and refuse what waits."""
        if mode not in ("drain", "cancel"):
            raise ValueError(f"stop mode {mode!r}: drain or cancel")
        with self._cond:
            self._stop(mode)

    def _stop(self, mode: str) -> None:
        self._stopping = mode if self._stopping != "cancel" else "cancel"
        if mode == "cancel":
            for request_id in list(self._waiting):
                self._end(request_id, CANCELLED, "the service stopped")
            self._waiting.clear()
        self._changed()

    def _publish(self) -> None:
        """The snapshot :meth:`info` returns, made in the lock after every change."""
        groups = [
            {
                "group": g,
                **{k: v for k, v in state.items() if k not in ("in_flight", "error")},
                "request": self._name_of(state["in_flight"]),
            }
            for g, state in sorted(self._groups.items())
        ]
        ready = len(groups) >= int(self._info.get("groups", 1))
        first = groups[0] if groups else {}
        self._snapshot = {
            **self._info,
            "group_states": groups,
            "ready": ready,
            "workers": first.get("workers"),
            "device": first.get("device"),
            "restarts": sum(g["restarts"] for g in groups),
            "free_groups": sum(1 for g in groups if g["request"] is None) if ready else 0,
            "queue": len(self._waiting),
            "in_flight": [g["request"] for g in groups if g["request"] is not None],
            "served": self._served,
            "stopping": self._stopping,
            "failed": self._failed,
        }

    def _name_of(self, request_id: str | None) -> str | None:
        entry = self._requests.get(request_id or "")
        return entry["request"].name if entry else None

    def _changed(self) -> None:
        self._publish()
        self._cond.notify_all()  # the long polls (a state, an epoch, an end) and take

    # ------------------------------------------------------------ the workers' side

    def _check_worker(self, token: Any) -> None:
        mine = self._token.encode()
        given = token.encode("utf-8", "replace") if isinstance(token, str) else b""
        if not (mine and hmac.compare_digest(given, mine)):  # in constant time
            raise NotAWorker("only the service's own workers may call this")

    def group_started(
        self, token: str, group: int, started_at: float, world_size: int, device: str
    ) -> None:
        """Rank 0 of a (re)started worker group: it is ready for requests. A restart is
        charged to the request the group had in flight (which fails alone at
        :data:`MAX_REQUEST_FAILURES`), else to the service's own budget."""
        self._check_worker(token)
        with self._cond:
            state = self._groups.get(group)
            if state is not None:
                self._charge(group, state)
            self._groups[group] = {
                "workers": int(world_size),
                "device": str(device),
                "restarts": state["restarts"] + 1 if state else 0,
                "served": state["served"] if state else 0,
                "started_at": float(started_at),
                "in_flight": state["in_flight"] if state else None,
                "error": None,
            }
            self._changed()

    def _charge(self, group: int, state: dict) -> None:
        error = state.get("error") or "a worker was lost"
        entry = self._requests.get(state["in_flight"] or "")
        if entry is not None and entry["state"] == RUNNING:
            entry["failures"] += 1
            if entry["failures"] >= MAX_REQUEST_FAILURES:
                state["in_flight"] = None
                self._end(
                    entry["request"].id,
                    FAILED,
                    f"the request failed its worker group {entry['failures']} times; "
                    f"the last time: {error}",
                )
            return
        state["in_flight"] = None
        self._failures += 1
        budget = int(self._info.get("max_failures", -1))
        if 0 <= budget < self._failures:
            self._failed = (
                f"its worker groups failed {self._failures} times with no request to "
                f"blame (--max-failures {budget}); the last time: {error}"
            )
            self._stop("cancel")

    def group_failed(self, token: str, group: int, error: str) -> None:
        """The controller of ``group``: its workers raised (the group restarts next)."""
        self._check_worker(token)
        with self._cond:
            if group in self._groups:
                self._groups[group]["error"] = str(error)[:500]

    def take(self, token: str, group: int, wait_s: float) -> dict | str | None:
        """The next request for ``group``'s workers (the one it had in flight again after
        a restart, from its latest filed checkpoint), ``"stop"``, or None after ``wait_s``."""
        self._check_worker(token)
        deadline = time.monotonic() + min(max(float(wait_s), 0.0), 5.0)
        with self._cond:
            while True:
                self._expire()
                state = self._groups.get(group)
                if state is None:
                    raise ValueError(f"group {group} has not started")
                if state["in_flight"] is not None and self._stopping == "cancel":
                    self._end(state["in_flight"], CANCELLED, "the service stopped")
                    state["in_flight"] = None  # restarted as the service stops: it ends
                if state["in_flight"] is not None:  # the group restarted under it
                    return self._handed(state["in_flight"])
                if self._stopping == "cancel" or (self._stopping and not self._waiting):
                    return "stop"
                if self._waiting:
                    request_id = self._waiting.pop(0)
                    self._requests[request_id]["state"] = RUNNING
                    state["in_flight"] = request_id
                    self._push(request_id, {"progress": "request", "state": RUNNING})
                    self._changed()
                    return self._handed(request_id)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def _handed(self, request_id: str) -> dict:
        entry = self._requests[request_id]
        return {**entry["request"].to_dict(), "resume_from": entry["filed"]}

    def cancelled(self, token: str, request_id: str, wait_s: float = 0.0) -> bool:
        """Whether the request is to stop: at once when it is, else after up to ``wait_s``
        (rank 0 keeps one such question in flight: one call a second, not one a step)."""
        self._check_worker(token)
        with self._cond:
            return self._waited(wait_s, lambda: self._is_cancelled(request_id), bool)

    def _is_cancelled(self, request_id: str) -> bool:
        self._expire()
        entry = self._requests.get(request_id)
        ended = entry is None or bool(entry["cancel"]) or entry["state"] in ENDED
        return ended or self._stopping == "cancel"

    def done(
        self, token: str, group: int, request_id: str, status: str, error: str | None = None
    ) -> None:
        """Rank 0 of ``group``: the request ended on every rank."""
        self._check_worker(token)
        if status not in ENDED:
            raise ValueError(f"a request ends {', '.join(ENDED)}, not {status!r}")
        with self._cond:
            state = self._groups.get(group)
            if state is not None and state["in_flight"] == request_id:
                state["in_flight"] = None
                state["served"] += 1
            entry = self._requests.get(request_id)
            if entry is None or entry["state"] in ENDED:
                self._changed()
                return
            self._served += 1
            if entry["cancel"] and status == CANCELLED:
                error = entry["cancel"]
            if self._stopping == "cancel":  # its last epochs may still be on their way
                entry["pending"] = (status, error or "the service stopped")
                self._changed()
                return
            self._end(request_id, status, error)

    def closed(self, token: str) -> None:
        """The service's driver: every group's ``fit()`` has returned, so their controllers
        have filed every epoch their workers reported. The requests the stop ended end now:
        a requester's summary is never behind the checkpoint filed last."""
        self._check_worker(token)
        with self._cond:
            for request_id, entry in self._requests.items():
                if entry.get("pending") and entry["state"] not in ENDED:
                    self._end(request_id, *entry.pop("pending"))
            self._changed()

    def put(self, token: str, request_id: str, item: dict) -> None:
        """Rank 0's progress and the controller's committed epochs, for the requester."""
        self._check_worker(token)
        if not isinstance(item, dict):
            raise ValueError("an item is a dict")
        with self._cond:
            self._push(request_id, item)

    def filed(self, token: str, request_id: str, path: str) -> None:
        """The controller filed a checkpoint of the request into its run: the one it
        resumes from after a restart, once it is known to lie inside that run."""
        self._check_worker(token)
        with self._cond:
            entry = self._requests.get(request_id)
            if entry is None:
                return
            inside = checkpoint_inside(entry["request"].run_dir, path)
            if inside is None:
                raise ValueError(f"{path!r} is not a checkpoint of run '{entry['request'].name}'")
            entry["filed"] = inside

    def run_of(self, token: str, request_id: str) -> dict | None:
        """Where the request's run lives and what it keeps (the controller's filing)."""
        self._check_worker(token)
        with self._cond:
            entry = self._requests.get(request_id)
            if entry is None:
                return None
            r = entry["request"]
            return {"storage": r.storage, "name": r.name, "keep": r.keep}

    # ------------------------------------------------------------ the requester's side

    def submit(self, request: dict, requester: str | None = None) -> dict:
        """Queue ``request`` (a :class:`~.request.ServiceRequest`'s dict, checked here
        whoever sends it); returns its id and place, or the one-line reason it is
        refused. ``requester``: the requesting driver's Ray job id (hex), a live job."""
        try:
            checked = check_request(request, self._snapshot)
        except (RequestError, UserError) as exc:
            return {"refused": str(exc)}
        if not isinstance(requester, str) or requester in (self._dead_jobs({requester}) or ()):
            return {"refused": f"requester {requester!r} is no live Ray job on this cluster"}
        with self._cond:
            self._expire()
            if self._stopping or self._failed:
                return {"refused": f"service '{self._info['name']}' is stopping"}
            if len(self._waiting) >= MAX_WAITING:
                return {
                    "refused": f"service {self._info['name']} is full: "
                    f"{len(self._waiting)} requests waiting"
                }
            busy = [e for e in self._requests.values() if e["state"] in (WAITING, RUNNING)]
            if any(e["request"].run_dir == checked.run_dir for e in busy):
                return {"refused": f"run '{checked.name}' is already queued or training"}
            request_id = uuid.uuid4().hex
            self._requests[request_id] = {
                "request": _with_id(checked, request_id),
                "state": WAITING,
                "items": [],
                "dropped": 0,
                "seen": time.monotonic(),
                "cancel": None,
                "filed": checked.resume_from,
                "error": None,
                "epoch": 0,
                "failures": 0,
                "requester": requester,
            }
            self._waiting.append(request_id)
            self._changed()
            return {"id": request_id, "place": len(self._waiting)}

    def drain(self, request_id: str, acknowledged: int = 0) -> tuple[int, list[dict]]:
        """As a run channel's ``drain`` (its requester's monitor calls it every poll):
        the items not yet acknowledged. Each call renews the request's lease."""
        with self._cond:
            entry = self._requests.get(request_id)
            if entry is None or not isinstance(acknowledged, int):
                return 0, []
            entry["seen"] = time.monotonic()
            if acknowledged > entry["dropped"]:
                gone = min(acknowledged - entry["dropped"], len(entry["items"]))
                del entry["items"][:gone]
                entry["dropped"] += gone
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
        return {
            "state": entry["state"],
            "place": place,
            "error": entry["error"],
            "epoch": entry["epoch"],
        }

    def cancel(self, request_id: str, reason: str = "cancelled by its requester") -> None:
        with self._cond:
            self._cancel(request_id, str(reason)[:200])
            self._changed()

    # ------------------------------------------------------------ inside the lock

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

    def _cancel(self, request_id: str, reason: str) -> None:
        entry = self._requests.get(request_id)
        if entry is None or entry["state"] in ENDED:
            return
        entry["cancel"] = reason
        if request_id in self._waiting:
            self._waiting.remove(request_id)
            self._end(request_id, CANCELLED, reason)

    def _end(self, request_id: str, status: str, error: str | None) -> None:
        entry = self._requests.get(request_id)
        if entry is None:
            return
        entry["state"], entry["error"] = status, error
        self._push(request_id, {"progress": "request", "state": status, "error": error})

    def _push(self, request_id: str, item: dict) -> None:
        entry = self._requests.get(request_id)
        if entry is None:
            return
        entry["items"].append({**item, "received": time.time()})
        if len(entry["items"]) > MAX_ITEMS:  # a requester that never drains
            del entry["items"][0]
            entry["dropped"] += 1
        if "progress" not in item:  # a committed epoch (the controller's)
            epoch = item.get("epoch")
            if isinstance(epoch, int) and not isinstance(epoch, bool):
                entry["epoch"] = max(entry["epoch"], epoch)
        self._changed()

    def _expire(self) -> None:
        """Cancel what nobody asks about any more, and forget what ended long ago. A
        request silent past its lease is cancelled once its requester's job is dead or
        unknown (or the GCS cannot be asked): a requester on a loaded machine may be slow,
        not gone."""
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
        dead = self._dead_jobs(set(silent.values()))
        gone = [r for r, job in silent.items() if dead is None or job in dead]
        for request_id in gone:
            self._cancel(request_id, "its requester went silent (its lease lapsed)")
        if gone:
            self._changed()


def _with_id(request: ServiceRequest, request_id: str) -> ServiceRequest:
    import dataclasses

    return dataclasses.replace(request, id=request_id)


def start_queue(info: dict[str, Any], token: str):
    """The service's :class:`ServiceQueue`, named after it, on this (the driver's) node.
    ``info()`` has threads of its own: ``service status`` answers under any load."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(num_cpus=0, max_concurrency=THREADS, concurrency_groups={"status": 2})

    class Queue(ServiceQueue):
        @ray.method(concurrency_group="status")
        def info(self) -> dict[str, Any]:
            return super().info()

    return (
        actor(Queue)
        .options(
            name=queue_name(info["name"]),
            namespace=NAMESPACE,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False
            ),
        )
        .remote(info, token)
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
