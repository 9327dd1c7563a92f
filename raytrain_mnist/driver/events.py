"""What a run tells its caller while it works: small frozen events handed to a sink.

Events are how the library talks. :func:`raytrain_mnist.driver.fitting.fit` (and the Tune
entry) never print: they hand each event to the ``on_event`` sink they are given. The CLI
renders them (:class:`raytrain_mnist.console.Renderer`); a notebook may pass its own sink
(any callable taking an :class:`Event`), or none, and :func:`log_event` logs them through
``logging``. A sink is called from the caller's thread and from the run's monitor thread,
never from two at once; it should return quickly (the bar is drawn from it).

Every event is an :class:`Event` with a ``text``, the one line that says it. New kinds
subclass :class:`Event` (Tune's trial events below do).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

logger = logging.getLogger("raytrain_mnist")

#: How a run or a search ended (``FitResult.status``, ``SearchResult.status``):
#: ``finished``, ``interrupted`` (stopped with Ctrl-C; it resumes) or ``failed`` (it
#: resumes too: a run from its checkpoint, a search by training its failed trials again).
Status = Literal["finished", "interrupted", "failed"]


@dataclass(frozen=True)
class Event:
    """Something a run tells its caller. Every kind has a ``text`` (a field or a property):
    the one line that says it."""


#: The moments of a fit's start-up, in the order they happen, and who spends the time that
#: leads up to each (summary.json's ``timeline["startup_s"]``: seconds from the command's
#: start). ``process_group_formed``, ``model_prepared`` and ``first_step`` are rank 0's own
#: stamps; ``controller_started`` and ``worker_group_started`` the Train controller's.
STARTUP = {
    "fit_called": "Python, imports, flags: fit() called",
    "data_loaded": "data loaded (driver)",
    "ray_starting": "run claimed, identity hashed, resume point read, ray imported",
    "ray_ready": "Ray started or connected (ray.init), placement checked",
    "trainer_started": "run.json, tracking, progress channel, data put: trainer.fit() called",
    "controller_started": "Train controller actor started",
    "worker_group_started": "worker actors up (placement group, processes, imports)",
    "process_group_formed": "process group formed (rank 0's train function starts)",
    "model_prepared": "data fetched, model built, prepare_model / prepare_data_loader",
    "first_step": "first optimizer step done",
}
#: The moments of its teardown, from the last epoch's report to the summary
#: (``timeline["teardown_s"]``), in the order a fit stops (:func:`~.fitting.on_trainer.train`).
TEARDOWN = {
    "last_report": "last epoch evaluated (rank 0): checkpoint saved, reported",
    "checkpoint_committed": "its checkpoint committed (controller)",
    "workers_finished": "train functions seen finished (controller's poll)",
    "worker_group_shut_down": "worker group shut down",
    "controller_finished": "controller finished",
    "fit_returned": "trainer.fit() returned (driver)",
    "summary_built": "progress drained, summary built",
    "ray_shut_down": "Ray shut down (a Ray fit started) or left (a cluster it connected to)",
    "files_written": "curves drawn, summary.json and training_curves.png written, tracking "
    "closed (on a thread, while Ray shut down)",
}


@dataclass(frozen=True)
class Phase(Event):
    """A start-up moment reached (:data:`STARTUP`; also "starting a local Ray", "workers
    starting"). ``elapsed_s``: seconds since the command started (since ``fit`` was called,
    from Python), at the moment it happened, not when the driver heard of it."""

    text: str
    elapsed_s: float


@dataclass(frozen=True)
class Note(Event):
    """A one-line message about the run: which run starts or resumes, from which
    checkpoint, a worker group restarted or resized."""

    text: str


@dataclass(frozen=True)
class Preempted(Note):
    """A node of the run is being preempted (a spot reclaim), or the run resumed after
    one: summary.json's ``preemptions`` holds the details."""


@dataclass(frozen=True)
class Stopping(Event):
    """The run is being stopped at the user's request (Ctrl-C): its workers stop, the last
    committed checkpoint stays. Sent from the thread that called ``fit``."""

    text: str = "Ctrl-C: stopping the workers; the last committed checkpoint is kept"


def format_epoch(m: dict[str, Any], epochs: int) -> str:
    """The one line of a committed epoch."""
    return (
        f"epoch {m['epoch']:>3}/{epochs}  train_loss {m['train_loss']:.4f}  "
        f"val_loss {m['val_loss']:.4f}  val_acc {100 * m['val_accuracy']:6.2f}%  "
        f"{m['images_per_s']:8.0f} img/s  {m['epoch_time_s']:6.1f} s"
    )


@dataclass(frozen=True)
class EpochCommitted(Event):
    """An epoch every rank reported, its checkpoint committed. ``metrics``: the epoch's
    report (``epoch``, ``train_loss``, ``val_loss``, ``val_accuracy``, ``images_per_s``,
    ``epoch_time_s``, ...); ``epochs``: how many the run trains."""

    metrics: dict[str, Any] = field(hash=False)
    epochs: int

    @property
    def epoch(self) -> int:
        return self.metrics["epoch"]

    @property
    def text(self) -> str:
        return format_epoch(self.metrics, self.epochs)


@dataclass(frozen=True)
class StepProgress(Event):
    """Rank 0's progress within an epoch, a few times a second: ``item`` holds ``epoch``,
    ``images`` (done), ``total``, ``seconds`` (since the epoch began) and ``loss`` (running
    mean); ``epochs``: how many the run trains."""

    item: dict[str, Any] = field(hash=False)
    epochs: int

    @property
    def text(self) -> str:
        i = self.item
        return (
            f"epoch {i.get('epoch')}/{self.epochs}: {i.get('images')}/{i.get('total')} images, "
            f"loss {i.get('loss', float('nan')):.4f}"
        )


#: Where a run sends its events.
EventSink = Callable[[Event], None]


def log_event(event: Event) -> None:
    """The default sink: each event as one log line of the ``raytrain_mnist`` logger, at
    INFO (steps at DEBUG, a stop at WARNING)."""
    if isinstance(event, StepProgress):
        level = logging.DEBUG
    elif isinstance(event, Stopping):
        level = logging.WARNING
    else:
        level = logging.INFO
    logger.log(level, "%s", getattr(event, "text", event))


# --------------------------------------------------------------------------- Tune's search
#
# What :func:`raytrain_mnist.driver.searching.search` tells its caller: the search starting
# (then a Note with the search space), and each trial starting, reporting an epoch and
# ending. The tune command renders them with :class:`raytrain_mnist.console.TrialsTable`.


def format_value(value: Any) -> str:
    """A hyperparameter or metric as a trial's line shows it: floats to 4 significant digits."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class SearchStarting(Event):
    """A search starts, or resumes (``resuming``) the trials it had not finished: how many
    trials, how they are scheduled and ranked, how many run at once and what each takes."""

    name: str
    resuming: bool
    num_samples: int
    scheduler: str
    metric: str
    mode: str
    concurrent: int  # trials at once
    num_workers: int  # per trial
    cpus_per_worker: int
    gpus_per_worker: float  # 0 on CPUs
    max_epochs: int
    train_size: int
    test_size: int
    data_source: str

    @property
    def text(self) -> str:
        gpus = f", {self.gpus_per_worker:g} GPU" if self.gpus_per_worker else ""
        return (
            f"{'resuming' if self.resuming else 'starting'} search '{self.name}': "
            f"{self.num_samples} trial(s), {self.scheduler} on {self.metric} ({self.mode}), "
            f"{self.concurrent} at a time, each {self.num_workers} worker(s) x "
            f"{self.cpus_per_worker} CPU{gpus} for up to {self.max_epochs} epoch(s); "
            f"{self.train_size} train / {self.test_size} test images from {self.data_source}"
        )


@dataclass(frozen=True)
class TrialStarted(Event):
    """A trial started (or restarted); ``config``: the training values it drew, ``searched``:
    the names of those that are searched."""

    trial_id: str
    config: dict[str, Any] = field(hash=False)
    searched: tuple[str, ...]

    @property
    def text(self) -> str:
        drawn = ", ".join(f"{n}={format_value(self.config.get(n))}" for n in self.searched)
        return f"trial {self.trial_id} started: {drawn}"


@dataclass(frozen=True)
class TrialReported(Event):
    """A trial's epoch committed: ``result`` is what it reported to Tune (``epoch``,
    ``val_accuracy``, ``val_loss``, ...); ``epochs``: the most a trial trains."""

    trial_id: str
    result: dict[str, Any] = field(hash=False)
    epochs: int

    @property
    def epoch(self) -> int:
        return self.result.get("epoch", 0)

    @property
    def text(self) -> str:
        loss, acc = self.result.get("val_loss"), self.result.get("val_accuracy")
        shown = [
            *([] if not isinstance(loss, float) else [f"val_loss {loss:.4f}"]),
            *([] if not isinstance(acc, float) else [f"val_acc {100 * acc:.2f}%"]),
        ]
        return f"trial {self.trial_id} epoch {self.epoch}/{self.epochs}: {', '.join(shown)}"


@dataclass(frozen=True)
class TrialEnded(Event):
    """A trial ended: ``outcome`` is "finished" (all its epochs), "stopped early" (by the
    scheduler, after ``epoch``) or "failed" (``error_file`` holds Tune's record of it);
    ``value``: its last ``metric``, when it reported one."""

    trial_id: str
    outcome: str
    epoch: int
    metric: str
    value: float | None = None
    error_file: str | None = None

    @property
    def how(self) -> str:
        """The outcome as the trial's status reads: "stopped early after epoch N"."""
        if self.outcome == "stopped early":
            return f"stopped early after epoch {self.epoch}"
        return self.outcome

    @property
    def text(self) -> str:
        if self.outcome == "failed":
            return f"trial {self.trial_id} failed: see {self.error_file}"
        score = "" if self.value is None else f": {self.metric} {format_value(self.value)}"
        return f"trial {self.trial_id} {self.how}{score}"
