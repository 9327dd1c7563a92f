"""A warm training service's worker loop: one Ray Train worker group that trains request
after request (the driver's side, the queue and the filing of checkpoints, is
:mod:`raytrain_mnist.driver.service`).

Rank 0 takes the next request from the service's queue (an actor) and hands it to the
other ranks over the process group; every rank then trains it with the very loop ``fit``
runs (:func:`~.loop.train_run`): a fresh model, optimizer, scaler and RNG from the
request's seed, the same reports with the same checkpoints, every epoch. What is
expensive and shared is built once per worker-group start: the processes, the process
group, the data on the device. A request is data (a
:class:`~raytrain_mnist.service_request.ServiceRequest`'s dict), never code. Every
call to the queue carries the token the service gave its own worker groups: the queue
answers no other caller.

A request ends in one of three ways, each on every rank at the same step: it finishes,
its requester cancels it (rank 0 asks the queue every :data:`CANCEL_EVERY` steps and
broadcasts the answer), or its loss stops being a number (:class:`~.loop.Diverged`, the
sums are all-reduced). Anything else (a worker lost) is Ray Train's to handle: the group
restarts, and the queue hands the request in flight out again, to resume from the last
checkpoint filed into its run.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
import ray.train
import torch
import torch.distributed as dist

from raytrain_mnist import compat
from raytrain_mnist.data import MnistData
from raytrain_mnist.nn import checkpoint as ckpt
from raytrain_mnist.service_request import ServiceRequest
from raytrain_mnist.worker.endpoll import SLOW_POLL_S
from raytrain_mnist.worker.loop import Diverged, WorkerSetup, to_device, train_run

logger = logging.getLogger(__name__)

#: What rank 0 hands the other ranks when the service stops.
STOP = "stop"
#: Seconds rank 0 waits for a request before it asks again (the ranks meet between asks).
IDLE_WAIT_S = 1.0
#: Steps between two looks at whether the request was cancelled (a broadcast of one
#: number; far below a second at any step time this model has).
CANCEL_EVERY = 8
#: How long the queue may hold rank 0's question before it answers "not cancelled" (it
#: answers a cancel at once): one call a second instead of one every few steps.
CANCEL_WAIT_S = 1.0


class Service:
    """This worker's handle on its service: the queue, the token that opens the workers'
    methods of it, and which of the service's worker groups this worker is in."""

    def __init__(self, queue, token: str, group: int) -> None:
        self.queue, self.token, self.group = queue, token, group

    def call(self, method: str, *args):
        """``queue.method(token, *args)``, as an ObjectRef."""
        return getattr(self.queue, method).remote(self.token, *args)


class RequestChannel:
    """Rank 0's end of one request's stream through the service's queue, shaped like a
    fit's run channel for :class:`~.feed.ProgressFeed` (``put.remote(item)``)."""

    def __init__(self, service: Service, request_id: str) -> None:
        self._service, self._id = service, request_id
        self.put = self

    def remote(self, item: dict):
        return self._service.call("put", self._id, item)


class Cancelled(Exception):
    """The request's requester cancelled it (Ctrl-C, SIGTERM, its lease lapsed)."""


class CancelCheck:
    """The per-step hook that ends a request on every rank at the same step once its
    requester cancelled it: rank 0 keeps one question to the queue in flight and, every
    :data:`CANCEL_EVERY` steps, broadcasts what it last heard."""

    def __init__(self, service: Service, request_id: str, worker: WorkerSetup) -> None:
        self._service, self._id, self._worker = service, request_id, worker
        self._asked = None
        self._flag = torch.zeros(1, dtype=torch.int32, device=worker.device)

    def on_step(self, steps: int, sums=None) -> None:
        if steps % CANCEL_EVERY == 0:
            self.check()

    def check(self) -> None:
        """Raise :class:`Cancelled` on every rank once rank 0 has heard so."""
        if self._worker.rank == 0:
            if self._asked is None:  # answered at once on a cancel, else after a second
                self._asked = self._service.call("cancelled", self._id, CANCEL_WAIT_S)
            ready, _ = ray.wait([self._asked], timeout=0)
            if ready:
                self._flag.fill_(int(ray.get(self._asked)))
                self._asked = None
        if self._worker.world_size > 1:
            dist.broadcast(self._flag, src=0)
        if self._flag.item():
            raise Cancelled(self._id)


def serve_requests(config: dict[str, Any]) -> None:
    """The service's Ray Train entry point. ``config``: ``data`` (ObjectRef of
    :class:`MnistData`), ``queue`` (the service's queue actor), ``token`` (its workers'
    secret), ``group`` (which of its worker groups this is), ``cpus_per_worker``."""
    started_at = time.time()
    worker = WorkerSetup.start(config["cpus_per_worker"], started_at)
    data: MnistData = to_device(ray.get(config["data"]), worker.device)
    service = Service(config["queue"], config["token"], config["group"])
    if worker.rank == 0:
        device = worker.device.type
        ray.get(service.call("group_started", service.group, started_at, worker.world_size, device))
    while True:
        request = _next_request(service, worker)
        if request == STOP:
            return
        if request is not None:
            _serve(ServiceRequest.from_dict(request), data, worker, service)


def _next_request(service: Service, worker: WorkerSetup) -> dict | str | None:
    """Rank 0 asks the queue (waiting up to :data:`IDLE_WAIT_S`); every rank gets its
    answer: a request, :data:`STOP`, or None (ask again)."""
    answer = None
    if worker.rank == 0:
        answer = ray.get(service.call("take", service.group, IDLE_WAIT_S))
    if worker.world_size > 1:
        box = [answer]
        dist.broadcast_object_list(box, src=0, device=_object_device(worker))
        answer = box[0]
    return answer


def _object_device(worker: WorkerSetup) -> torch.device | None:
    # NCCL moves pickled objects through the device; Gloo through the host.
    return worker.device if dist.get_backend() == "nccl" else None


def _serve(request: ServiceRequest, data: MnistData, worker: WorkerSetup, service) -> None:
    """Train one request on every rank; rank 0 tells the queue how it ended."""
    request_id = request.id
    cancel = CancelCheck(service, request_id, worker)
    status, error = "finished", None
    # The controller polls at Ray's interval while the request trains (every poll costs
    # training throughput: 0.5 s all along cost the 2026-12-04 burst 8 %), then fast for its
    # last moments, as a fit's run (train_run's EndPoll).
    try:
        state = _resume_state(request.resume_from)
        cancel.check()  # cancelled while it waited for its turn
        train_run(
            request.train,
            data,
            worker,
            state,
            progress=RequestChannel(service, request_id) if request.progress else None,
            compile=request.compile,
            cuda_graphs=request.cuda_graphs,
            tags={"request_id": request_id},
            on_step=cancel.on_step,
        )
    except Cancelled:
        status = "cancelled"
    except (Diverged, ckpt.CheckpointError) as exc:
        status, error = "failed", str(exc)
    finally:
        # The next request starts at Ray's interval again, not the last one's fast polls.
        compat.poll_workers_every(SLOW_POLL_S, exact=True)
    if worker.rank == 0:
        logger.info("request %s %s", request_id, status)
        ray.get(service.call("done", service.group, request_id, status, error))


def _resume_state(path: str | None) -> dict[str, Any] | None:
    """The state of the checkpoint a request resumes from (a path or URI inside its run,
    checked by the queue: a request never holds another), read by every rank."""
    if path is None:
        return None
    with ray.train.Checkpoint(path).as_directory() as directory:
        return ckpt.load(directory)
