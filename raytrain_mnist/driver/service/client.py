"""A ``fit --service`` command's side of a service: find it, check it can honour the run,
send the request and follow it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from raytrain_mnist.driver import cluster
from raytrain_mnist.driver.events import EventSink, Note
from raytrain_mnist.driver.service.queue import (
    ENDED,
    FAILED,
    FINISHED,
    LONG_POLL_S,
    WAITING,
    find_queue,
    registry_file,
)
from raytrain_mnist.driver.service.request import forget_claim, within_roots, write_claim
from raytrain_mnist.errors import EXIT_USAGE, UserError, cause_line
from raytrain_mnist.service_request import ServiceRequest

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- the requester


@dataclass(frozen=True)
class ServiceData:
    """What a requester needs to know of the data a service holds (it loads none)."""

    kind: str
    source: str
    train_size: int
    test_size: int
    identity: dict  # records.data_identity of the service's MnistData


class ServiceClient:
    """A ``fit --service`` command's side of a service, on a Ray it has connected to."""

    def __init__(self, service: str) -> None:
        import ray

        self.name = service
        self.queue = find_queue(service)
        try:
            self.info = ray.get(self.queue.info.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise UserError(f"service '{service}' does not answer: {cause_line(exc)}") from None
        d = self.info["data"]
        identity = {k: d[k] for k in ("kind", "train_size", "test_size", "sha1")}
        self.data = ServiceData(d["kind"], d["source"], d["train_size"], d["test_size"], identity)

    @staticmethod
    def address_of(service: str, address: str | None) -> str:
        """The Ray cluster to find ``service`` on: ``--address``, else ``RAY_ADDRESS``, else
        the address a service of that name started on this machine registered."""
        given = cluster.resolve_address(address)
        if given is not None:
            return given
        try:
            return json.loads(registry_file(service).read_text())["address"]
        except (OSError, ValueError, KeyError, TypeError):
            raise UserError(
                f"--service {service}: no service of that name runs on this machine; give "
                "the --address of the Ray cluster it runs on, or start it with "
                f"`raytrain-mnist service start --name {service}`"
            ) from None

    def fitted(self, cfg):
        """``cfg`` as this service trains it, or one line saying what it cannot honour:
        the worker count, GPUs and data set are the service's (a run that did not say
        takes them)."""
        info, scaling, data = self.info, cfg.run.scaling, cfg.run.data
        workers = info["num_workers"]
        if not cfg.auto_workers and scaling.num_workers != workers:
            raise UserError(
                f"--num-workers {scaling.num_workers}: service '{self.name}' runs {workers} "
                "worker(s); leave --num-workers out, or start a service of that size",
                EXIT_USAGE,
            )
        if scaling.use_gpu and not info["use_gpu"]:
            raise UserError(f"--use-gpu: service '{self.name}' trains on CPUs", EXIT_USAGE)
        theirs_dir = info.get("data_dir")
        for flag, mine, theirs in (
            ("--dataset", data.dataset, info["dataset"]),
            ("--data-dir", _resolved(data.data_dir), theirs_dir),
        ):
            if mine not in ("auto", None, theirs):
                raise UserError(
                    f"{flag} {mine}: service '{self.name}' holds its own data "
                    f"({self.data.kind}, {self.data.source}); leave {flag} out",
                    EXIT_USAGE,
                )
        run = dataclasses.replace(
            cfg.run,
            scaling=dataclasses.replace(scaling, num_workers=workers, use_gpu=info["use_gpu"]),
            # Where the service's data came from, recorded as a plain fit records it: the
            # run's evaluate, predict, export and resume need no --data-dir.
            data=dataclasses.replace(data, dataset=info["dataset"], data_dir=theirs_dir),
        )
        if not within_roots(run.storage.storage_path, info["storage_roots"]):
            raise UserError(
                f"--storage-path {run.storage.storage_path}: service '{self.name}' writes only "
                f"under {', '.join(info['storage_roots'])}",
                EXIT_USAGE,
            )
        return dataclasses.replace(cfg, run=run, auto_workers=False)

    def submit(self, cfg, run, resume_from: str | None) -> str:
        """Queue the run (``run``: a :class:`~raytrain_mnist.driver.runs.Run` this command
        holds the claim of); returns the request's id, or one line why the service refused."""
        import ray

        claim = secrets.token_hex(16)  # the queue trains only a run that holds it
        write_claim(run.files, claim)
        request = ServiceRequest(
            train=cfg.train,
            storage=run.storage,
            name=run.name,
            resume_from=resume_from,
            progress=cfg.run.output.progress != "off",
            compile=cfg.run.torch.compile,
            cuda_graphs=cfg.run.torch.cuda_graphs,
            keep=cfg.run.checkpoint.keep_checkpoints,
            claim=claim,
        )
        job = ray.get_runtime_context().get_job_id()  # the queue asks the GCS if it is alive
        answer = ray.get(self.queue.submit.remote(request.to_dict(), job), timeout=60)
        if "refused" in answer:
            forget_claim(run.files)  # a refused run is left as it was found
            raise UserError(f"service '{self.name}' refused the run: {answer['refused']}")
        return answer["id"]

    def channel(self, request_id: str):
        """The request's stream, as the run monitor drains a fit's channel."""
        return _Stream(self.queue, request_id)

    def follow(self, request_id: str, emit: EventSink, epochs: int) -> dict:
        """Wait for the request to end, saying its place while it waits; a finished one
        until its last epoch (``epochs``) is in its stream too: the controller puts it
        there after the workers' end. Returns its final state."""
        import ray

        place, deadline, state = None, None, None
        while True:
            asked = time.monotonic()
            try:
                state = ray.get(self.queue.state.remote(request_id, state, LONG_POLL_S), timeout=30)
            except ray.exceptions.RayActorError:
                return {"state": FAILED, "error": f"service '{self.name}' went away"}
            except ray.exceptions.GetTimeoutError:
                continue
            if state["state"] == WAITING and state["place"] != place:
                place = state["place"]
                emit(Note(f"waiting for service '{self.name}': number {place} in its queue"))
            if state["state"] == FINISHED and state["epoch"] < epochs:
                deadline = deadline or time.monotonic() + 30  # the last commit, on its way
                if time.monotonic() < deadline:
                    continue  # the commit changes the state: the long poll hears it
            if state["state"] in ENDED:
                return state
            if time.monotonic() - asked < 0.05:  # answered at once: the queue's polls are full
                time.sleep(0.2)

    def cancel(self, request_id: str, reason: str) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayActorError):
            ray.get(self.queue.cancel.remote(request_id, f"cancelled ({reason})"), timeout=30)


def _resolved(data_dir: str | None) -> str | None:
    return None if data_dir is None else str(Path(data_dir).expanduser().resolve())


class _Stream:
    """One request's stream through the service's queue, shaped like a fit's run channel
    for :class:`~raytrain_mnist.driver.monitor.RunMonitor` (``drain.remote(ack)``); rank 0
    fills it through its own end (``worker/service.py``)."""

    def __init__(self, queue, request_id: str) -> None:
        self._queue, self._id = queue, request_id
        self.drain = self

    def remote(self, acknowledged: int = 0):
        return self._queue.drain.remote(self._id, acknowledged)
