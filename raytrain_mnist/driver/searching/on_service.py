"""A search's trials as requests to a warm service (``tune --service NAME``).

Tune decides as in any search (the searcher, the scheduler, the stops); only the trial
changes. Instead of building a ``TorchTrainer``, a trial's actor sends its run to the
service (:class:`~raytrain_mnist.driver.service.ServiceClient`, as ``fit --service`` does),
hands each epoch the service commits to Tune as that trial's result, and cancels the
request when Tune stops the trial (its run keeps its committed checkpoints and resumes
like any cancelled request). The actor imports neither torch nor Ray Train: it waits on
the service's queue, and asks at most a sliver of a CPU (none where the service holds
every one).

Tune tells a trial it stops only between two of its steps; a search stopped mid-epoch
(Ctrl-C, a lost claim) kills its trials' actors instead. So every trial also registers
its request with the search (:class:`SearchRequests`), and the search cancels whatever is
left when its Tune run ends: nothing it sent trains on after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig
from raytrain_mnist.driver.runs import Run
from raytrain_mnist.driver.searching.plan import TRIAL_CPU, trial_config
from raytrain_mnist.errors import EXIT_USAGE, UserError

#: What a trial on a service asks of a cluster whose CPUs the service holds every one of
#: (a machine the service's size): no CPU, since its actor only waits on the queue, and a
#: token of memory, since Tune refuses a trial that asks for nothing. Where CPUs are free it
#: asks a sliver of one (TRIAL_CPU), as any trial does: never placed on a head that
#: declares none (KubeRay's, whose pod holds the autoscaler's permissions).
NO_CPU = {"CPU": 0, "memory": 64 * 2**20}
#: How often a trial asks the queue for its request's stream; each ask renews the
#: request's lease.
POLL_S = 0.2
#: How long a finished request's last epochs may trail its end (the controller files them
#: after the workers' end, as ``ServiceClient.follow`` waits for them).
LAST_EPOCH_S = 30.0
#: The keys of a committed epoch that are the stream's, not the epoch's report.
_STREAM_KEYS = ("checkpoint", "committed_at", "received")


@dataclass(frozen=True)
class ServiceTrialSetup:
    """What every trial on a service is handed besides its name."""

    service: str
    train: dict  # TrainConfig.to_dict(): every value that is not searched
    run: RunSettings  # fitted to the service (its workers, device and data), no progress
    runs_root: str
    plan: dict[str, dict]  # trial name -> the values it draws
    requests: Any = None  # the search's SearchRequests actor


# --------------------------------------------------------------------------- the driver


def fitted_run(client, train: TrainConfig, run: RunSettings, auto_workers: bool) -> RunSettings:
    """``run`` as the service trains it (its worker count, device and data), or one line
    saying what it cannot honour (the checks of ``fit --service``)."""
    cfg = client.fitted(FitConfig(train, run, auto_workers=auto_workers))
    return cfg.run


def concurrency(info: dict, wanted: int | None, pending: int) -> int:
    """Trials at once: ``--max-concurrent-trials``, else the service's free worker groups
    (a service that does not say has one); more than its groups is refused."""
    groups = _count(info.get("groups"), 1)
    if wanted and wanted > groups:
        raise UserError(
            f"--max-concurrent-trials {wanted}: service '{info.get('name')}' trains "
            f"{groups} request(s) at once; lower it, or start the service with more groups",
            EXIT_USAGE,
        )
    return max(1, min(wanted or _count(info.get("free_groups"), 1), pending))


def _count(value: Any, default: int) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return value if ok else default


class SearchRequests:
    """The requests a search's trials sent (an actor of the search): the ids its driver
    cancels when the Tune run ends, whatever ended it."""

    def __init__(self) -> None:
        self.ids: dict[str, str] = {}  # request id -> trial

    def add(self, request_id: str, trial: str) -> None:
        self.ids[request_id] = trial

    def sent(self) -> list[str]:
        return list(self.ids)


@contextlib.contextmanager
def requests_of_the_search(client) -> Iterator[Any]:
    """A :class:`SearchRequests` actor for the trials; on the way out every request they
    sent is cancelled (one that ended is left as it is) and the actor goes."""
    import ray

    requests = ray.remote(num_cpus=0)(SearchRequests).remote()
    try:
        yield requests
    finally:
        try:
            for request_id in ray.get(requests.sent.remote(), timeout=30):
                client.cancel(request_id, "its search stopped")
        finally:
            ray.kill(requests)


def trial_resources(free_cpus: float, concurrent: int) -> dict:
    """What each trial asks: a sliver of a CPU where the cluster has them free for every
    trial at once, else :data:`NO_CPU`."""
    return {"CPU": TRIAL_CPU} if free_cpus >= concurrent * TRIAL_CPU else dict(NO_CPU)


def service_trainable(setup: ServiceTrialSetup, resources: dict) -> Any:
    """The Tune trainable of every trial on the service."""
    from ray import tune

    return tune.with_resources(tune.with_parameters(_trial_class(), setup=setup), resources)


def _trial_class() -> type:
    """A Tune class trainable: Tune calls ``cleanup`` when it stops the trial (ASHA, the
    end of the search), where a function trainable gets no word of it before its actor
    is killed; ``reset_config`` when it hands the actor the next trial (the search reuses
    its actors: a new one costs a Python importing Ray Tune, seconds a trial on a service
    would otherwise pay). One ``step`` is one committed epoch."""
    from ray import tune

    class ServiceTrial(tune.Trainable):
        def setup(self, config: dict, setup: ServiceTrialSetup) -> None:
            self.search, self.request = setup, None
            self.request = TrialRequest.send(config["trial"], setup)

        def step(self) -> dict:
            return self.request.next_epoch()

        def reset_config(self, new_config: dict) -> bool:
            self.cleanup()  # the last trial's request (stopped, or ended) and its run
            self.request = TrialRequest.send(new_config["trial"], self.search)
            return True

        def cleanup(self) -> None:
            request, self.request = getattr(self, "request", None), None
            if request is not None:
                request.close("the search stopped its trial")

    return ServiceTrial


# --------------------------------------------------------------------------- the trial


class TrialRequest:
    """One trial's request, from its actor: sent while the actor holds the trial's run
    (one writer, as ``fit`` holds its run), followed epoch by epoch, cancelled unless it
    ended."""

    def __init__(self, client, request_id: str | None, epochs: int, held: contextlib.ExitStack):
        self.client, self.id, self.epochs, self._held = client, request_id, epochs, held
        self._stream = client.channel(request_id) if request_id else None
        self._handled = 0  # the stream's items handled (acknowledged at the next drain)
        self._epochs: list[dict] = []  # committed, not yet handed to Tune
        self._end: dict | None = None  # the request's end, once the stream says it
        self._ended_at = 0.0
        self._last_relayed = False  # its last epoch went to Tune: nothing to cancel

    @classmethod
    def send(cls, name: str, setup: ServiceTrialSetup) -> TrialRequest:
        import ray

        from raytrain_mnist.driver.service import ServiceClient

        train = trial_config(TrainConfig.from_dict(setup.train), setup.plan[name])
        cfg = FitConfig(train, setup.run)
        run = Run(setup.runs_root, name)
        held = contextlib.ExitStack()
        try:
            held.enter_context(run.claim())
            client = ServiceClient(setup.service)
            last = run.latest_metrics()
            if "progress" not in last and _epoch(last) >= train.epochs:
                # Its run committed every epoch (its search was stopped as it ended): the
                # last one is the trial's result, as a plain trial's run trains no more.
                trial = cls(client, None, train.epochs, held)
                trial._epochs.append({**last, "checkpoint": run.latest_checkpoint()})
                return trial
            request_id = client.submit(cfg, run, run.latest_checkpoint())
            if setup.requests is not None:
                ray.get(setup.requests.add.remote(request_id, name), timeout=60)
        except BaseException:
            held.close()
            raise
        return cls(client, request_id, train.epochs, held)

    def next_epoch(self) -> dict:
        """The next epoch the service committed, as Tune's result (``done`` at the last);
        waits for it. A request that ended without it raises: the trial failed."""
        import ray

        while not self._epochs:
            if self._end is not None:
                self._check_end()
            time.sleep(POLL_S)
            try:
                dropped, items = ray.get(self._stream.drain.remote(self._handled), timeout=60)
            except ray.exceptions.GetTimeoutError:  # a loaded machine: asked again
                continue
            except ray.exceptions.RayActorError:
                raise UserError(f"service '{self.client.name}' went away") from None
            for item in items[self._handled - dropped :]:
                self._take(item)
            self._handled = dropped + len(items)
        return self._result(self._epochs.pop(0))

    def _take(self, item: dict) -> None:
        kind = item.get("progress")
        if kind is None and isinstance(item.get("epoch"), int):  # a committed epoch
            self._epochs.append(item)
        elif kind == "request" and item.get("state") in ("finished", "failed", "cancelled"):
            self._end, self._ended_at = item, time.monotonic()

    def _check_end(self) -> None:
        """A failed or cancelled request fails the trial; a finished one, once its last
        epochs have had time to arrive."""
        end = self._end or {}
        if end.get("state") != "finished":
            error = end.get("error") or f"the request was {end.get('state')}"
            raise UserError(f"service '{self.client.name}': {error}")
        if time.monotonic() - self._ended_at > LAST_EPOCH_S:
            raise UserError(
                f"service '{self.client.name}': the request finished, but its epochs after "
                f"the last one relayed never arrived (of {self.epochs})"
            )

    def _result(self, item: dict) -> dict:
        """What Tune gets of an epoch: the epoch's report and its checkpoint's path, as
        Ray Train's ``TuneReportCallback`` relays it, and whether this process has torch
        (it never should: the tests read it)."""
        result = {k: v for k, v in item.items() if k not in _STREAM_KEYS}
        if item.get("checkpoint"):
            result["checkpoint_path"] = item["checkpoint"]
        result["trial_imported_torch"] = "torch" in sys.modules
        if item["epoch"] >= self.epochs:
            result["done"] = self._last_relayed = True
        return result

    def close(self, reason: str) -> None:
        """Cancel the request unless it ended, and let go of the run."""
        try:
            if self.id is not None and self._end is None and not self._last_relayed:
                self.client.cancel(self.id, reason)
        finally:
            self._held.close()


def _epoch(metrics: dict) -> int:
    epoch = metrics.get("epoch")
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else 0


def without_progress(run: RunSettings) -> RunSettings:
    """A trial's requests stream no steps: its actor relays epochs only."""
    return dataclasses.replace(run, output=dataclasses.replace(run.output, progress="off"))
