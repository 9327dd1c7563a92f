"""The Tune run of a search: each trial (fit's ``TorchTrainer`` in a Tune function trainable),
the scheduler and searcher, and the callbacks that hand what Tune sees to a :class:`Session`.
Tune's result objects, which unpickle a failed trial's ``error.pkl``, are never built.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig
from raytrain_mnist.driver.events import (
    EventSink,
    Stopping,
    TrialEnded,
    TrialReported,
    TrialStarted,
)
from raytrain_mnist.driver.relay import relay
from raytrain_mnist.driver.runs import Claim, Run
from raytrain_mnist.driver.searching.plan import TRIAL_CPU, trial_config
from raytrain_mnist.driver.searching.reaper import PlacementGroupReaper
from raytrain_mnist.driver.searching.records import (
    TRIAL_FILE,
    TRIAL_FINISHED,
    TRIAL_STOPPED,
    epoch_entry,
    trial_history,
    trial_record,
)
from raytrain_mnist.driver.searching.space import TuneSettings
from raytrain_mnist.errors import UserError

logger = logging.getLogger(__name__)

#: A trial whose actor dies (its node, say) is retried once; its Train run resumes.
TRIAL_RETRIES = 1


# --------------------------------------------------------------------------- a trial


@dataclass(frozen=True)
class TrialSetup:
    """What every trial is handed besides its name: the values of what is not searched,
    how it runs, and where its Train run lives (``runs_root/<trial>``)."""

    train: dict  # TrainConfig.to_dict(): every value that is not searched
    run: RunSettings
    cpus_per_worker: int
    runs_root: str
    plan: dict[str, dict]  # trial name -> the values it draws
    forwarded: dict[str, str]  # the command's trainer.FORWARDED variables, for the workers


def _trial(config: dict, setup: TrialSetup, data: list) -> None:
    """One Tune trial: fit's TorchTrainer with the trial's values, its Train run named after
    the trial (a trial run again resumes that run from its last checkpoint)."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from raytrain_mnist import compat
    from raytrain_mnist.driver.trainer import build_trainer
    from raytrain_mnist.worker import train_func_per_worker

    compat.tune_trial_relays_without_deadlock()  # before the Train run sends its first report
    name = config["trial"]
    train = TrainConfig.from_dict({**setup.train, **setup.plan[name]})
    cfg = FitConfig(train, setup.run)
    loop_config = {
        "train": cfg.train.to_dict(),
        "data": data[0],
        "cpus_per_worker": setup.cpus_per_worker,
        "compile": cfg.run.torch.compile,
        "cuda_graphs": cfg.run.torch.cuda_graphs,
    }
    trainer = build_trainer(
        cfg.run,
        train_func_per_worker,
        loop_config,
        setup.cpus_per_worker,
        setup.runs_root,
        name,
        callbacks=[TuneReportCallback()],
        forwarded=setup.forwarded,
    )
    # The search's reaper removes every group of a dead controller of its job, what Ray
    # Train's cleaner would remove and more, and the GCS the rest when the search's job ends:
    # a cleaner per trial would be one more process to start, guarding nothing.
    compat.without_cleaner(trainer)
    trainer.fit()  # raises when the run fails: Tune records the error and may retry


def trainable(setup: TrialSetup, data_ref: Any) -> Any:
    """The Tune trainable of every trial; ``data_ref``: MNIST in the object store, put once
    on the driver and handed to every trial's workers."""
    from ray import tune

    return tune.with_resources(
        tune.with_parameters(_trial, setup=setup, data=[data_ref]), {"CPU": TRIAL_CPU}
    )


def _trial_dirname(trial) -> str:
    return f"trial_{trial.config['trial']}"


# --------------------------------------------------------------------------- the session


@dataclass
class Session:
    """What one search knows while Tune runs its trials (Tune's callbacks fill it in)."""

    sink: EventSink
    plan: dict[str, dict]  # name -> the values it draws
    searched: list[str]
    train: TrainConfig  # every value that is not searched; epochs: the budget
    metric: str
    runs_root: str
    ended: dict[str, dict]  # name -> its trial.json record (before this search, and in it)
    seen: dict[str, dict[int, dict]] = field(default_factory=dict)  # name -> epoch -> entry
    stopped: set[str] = field(default_factory=set)  # stopped early by the scheduler
    errors: dict[str, str] = field(default_factory=dict)  # name -> the error's line
    stop: threading.Event = field(default_factory=threading.Event)  # Ctrl-C: stop the trials
    claim: Claim | None = None  # the experiment's hold: when it is lost, the trials stop too
    stalled: str | None = None  # why a trial's workers could not be placed: the search stops

    def train_of(self, name: str) -> dict:
        return trial_config(self.train, self.plan[name]).to_dict()

    def history(self, name: str) -> list[dict]:
        return trial_history(
            self.runs_root, name, self.train_of(name), self.seen.get(name, {}), self.metric
        )

    def trial_ended(self, name: str) -> None:
        """Tune ended trial ``name``: record it when it ended for good (all its epochs, or
        the scheduler stopped it); one stopped with the search resumes instead."""
        epochs = self.train.epochs
        history = self.history(name)
        if (history[-1]["epoch"] if history else 0) < epochs and name not in self.stopped:
            # Tune can end a trial without its last report (seen after a preemption: the Train
            # run committed epoch 8, Tune's results stop at 7; the controller hands reports to
            # the trial over a queue of its own). A trial that ended on its own: its Train
            # run's record of what it committed is the one that counts.
            history = trial_history(
                self.runs_root,
                name,
                self.train_of(name),
                self.seen.get(name, {}),
                self.metric,
                through_run=True,
            )
        last = history[-1]["epoch"] if history else 0
        if last >= epochs:
            status = TRIAL_FINISHED
        elif name in self.stopped and history:
            status = TRIAL_STOPPED
        else:
            return
        record = trial_record(name, self.plan[name], status, history)
        try:
            Run(self.runs_root, name).write_json(TRIAL_FILE, record)
        except UserError as exc:  # the next search trains it again (its run resumes)
            logger.warning("trial %s: %s", name, exc)
            return
        self.ended[name] = record
        self.errors.pop(name, None)
        self.sink(TrialEnded(name, status, last, self.metric, history[-1][self.metric]))

    @property
    def interrupted(self) -> bool:
        """A Ctrl-C or a lost claim stopped the search: its unfinished trials resume."""
        return self.stop.is_set() or (self.claim is not None and self.claim.lost.is_set())

    def stop_trials(self) -> None:
        """Ctrl-C: Tune stops the trials at its next step; their committed checkpoints stay."""
        self.sink(Stopping("stopping the trials; each keeps its last committed checkpoint"))
        self.stop.set()


#: The search running in this context. Tune's callbacks and stopper find it through
#: :func:`current_session`: Tune pickles them into its experiment state, so they hold
#: nothing, and name nothing but module-level functions (pickled by reference).
SESSION: contextvars.ContextVar[Session] = contextvars.ContextVar("search_session")


def current_session() -> Session:
    return SESSION.get()


# --------------------------------------------------------------------------- Tune's callbacks


def quiet_progress():
    """Tune's trial progress callback, printing nothing (Tune adds its own unless given one).
    Even with ``verbose=0`` it prints "Trial ... completed. Last result: ..." to stdout when a
    trial ends with the result it last showed, which here is none: a stray line in a search
    whose library call prints nothing (seen in the notebook's search, 2026-12-04)."""
    from ray.tune.progress_reporter import TrialProgressCallback

    class QuietTrialProgress(TrialProgressCallback):
        def _print(self, msg: str) -> None:
            logger.debug("%s", msg)

    return QuietTrialProgress()


def trial_events():
    """A Tune callback that turns trial starts, epochs and ends into the session's events
    and records (:class:`Session`)."""
    from ray import tune

    class TrialEvents(tune.Callback):
        def on_trial_start(self, iteration, trials, trial, **info):
            session, name = current_session(), trial.config["trial"]
            session.sink(TrialStarted(name, dict(session.plan[name]), tuple(session.searched)))

        def on_trial_result(self, iteration, trials, trial, result, **info):
            session, name = current_session(), trial.config["trial"]
            entry = epoch_entry(result, session.metric)
            if entry is None:
                return
            session.seen.setdefault(name, {})[entry["epoch"]] = entry
            session.sink(TrialReported(name, dict(result), session.train.epochs))
            # Tune marks the result the scheduler stops the trial at as done.
            if result.get("done") and entry["epoch"] < session.train.epochs:
                session.stopped.add(name)

        def on_trial_complete(self, iteration, trials, trial, **info):
            current_session().trial_ended(trial.config["trial"])

        def on_trial_error(self, iteration, trials, trial, **info):
            session, name = current_session(), trial.config["trial"]
            session.errors[name] = _error_line(trial.error_file)
            epoch = max(session.seen.get(name, {}), default=0)
            session.sink(
                TrialEnded(
                    name,
                    "failed",
                    epoch,
                    session.metric,
                    error_file=f"{trial.path}/error.txt",
                )
            )

    return TrialEvents()


def search_stop():
    """A Tune stopper that ends the whole search once the session's ``stop`` is set (Tune
    then stops the trials; their committed checkpoints stay)."""
    from ray import tune

    class SearchStop(tune.Stopper):
        def __call__(self, trial_id, result):
            return False

        def stop_all(self):
            session = current_session()
            return session.interrupted or session.stalled is not None

    return SearchStop()


def _error_line(error_file: str | None) -> str:
    """The last line of the error text Tune wrote for a trial on this machine (the
    exception's), else a placeholder. Text only: Tune's pickled error is never loaded."""
    try:
        with open(error_file or "", encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        lines = []
    return lines[-1][:300] if lines else "the trial failed (see its error.txt)"


# --------------------------------------------------------------------------- the run


def scheduler(settings: TuneSettings, epochs: int, ended: Iterable[dict] = ()):
    """FIFO, or ASHA that has seen the epochs of the trials that ``ended`` before (their
    ``trial.json`` records): its rungs hold them, as in a search never interrupted."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if settings.scheduler == "fifo":
        return FIFOScheduler()
    # Rungs count epochs (reported by the loop), not Tune iterations: a resumed trial
    # restarts Tune's iteration counter but not its epochs. The metric and mode are the
    # scheduler's own, so that the ended trials can be replayed into it before Tune starts.
    asha = ASHAScheduler(
        time_attr="epoch",
        metric=settings.metric,
        mode=settings.resolved_mode,
        max_t=epochs,
        grace_period=settings.grace_period,
        reduction_factor=settings.reduction_factor,
    )
    for record in ended:
        _replay(asha, record, settings.metric)
    return asha


def _replay(asha, record: dict, metric: str) -> None:
    """Hand ASHA the epochs of a trial that ended before, as Tune would have."""
    results = [
        {"epoch": h["epoch"], metric: h[metric]} for h in record["history"] if h[metric] is not None
    ]
    trial = types.SimpleNamespace(trial_id=record["trial_id"])  # all ASHA reads of one
    asha.on_trial_add(None, trial)
    for result in results:
        asha.on_trial_result(None, trial, result)
    if results:
        asha.on_trial_complete(None, trial, results[-1])
    else:
        asha.on_trial_remove(None, trial)


@dataclass(frozen=True)
class TuneRun:
    """One Tune run of the trials that had not ended (``pending``, in the search's order),
    as a fresh run: Tune's saved state of an earlier run is never restored."""

    trainable: Any
    name: str  # the experiment's
    storage: str
    pending: list[str]
    scheduler: Any
    concurrent: int  # trials at once
    #: A trainable that resets between trials (a service's trial: on_service) keeps its
    #: actor for the next trial.
    reuse_actors: bool = False

    def __call__(self) -> None:
        # tune.run, not a Tuner: a Tuner's results load a failed trial's pickled error
        # back from storage. Its value (an analysis of the trials) is not used either.
        from ray import tune
        from ray.tune.search.basic_variant import BasicVariantGenerator

        tune.run(
            self.trainable,
            name=self.name,
            storage_path=self.storage,
            config={"trial": tune.grid_search(self.pending)},  # the trials, by name
            scheduler=self.scheduler,
            # The limit goes to the searcher: Tune ignores max_concurrent_trials next to
            # a BasicVariantGenerator instance.
            search_alg=BasicVariantGenerator(max_concurrent=self.concurrent),
            stop=search_stop(),
            trial_dirname_creator=_trial_dirname,
            max_failures=TRIAL_RETRIES,
            callbacks=[trial_events(), quiet_progress()],
            raise_on_failed_trial=False,
            verbose=0,
            # Fit's trials: a new actor per trial. Tune reuses one only if the last trial's
            # thread ends within 2 s of its stop (TUNE_FUNCTION_THREAD_TIMEOUT_S); a trial
            # the scheduler stops is still inside its Train run's epoch then, so the next
            # trial on that actor failed to reset and never ran (a search "interrupted" by
            # nobody).
            reuse_actors=self.reuse_actors,
        )


def run_trials(tune_run: TuneRun, session: Session) -> None:
    """Run ``tune_run``, its callbacks filling ``session`` in, until it ends or a Ctrl-C
    stops it (:meth:`Session.stop_trials`; a second one stops waiting for it), removing the
    placement groups ended trials leave behind; a trial whose workers cannot be placed
    within the reaper's bound stops the search with a :class:`UserError` that says what
    holds the cluster.

    Tune runs on a helper thread (:func:`~raytrain_mnist.driver.relay.relay`, in a copy of
    this context: the callbacks find the session), so that Ctrl-C reaches this (main)
    thread, as in ``fit``: Tune installs no signal handler off the main thread (its own
    turns a Ctrl-C that comes before the first trial exists into an analysis loaded from
    the experiment directory, with pickles)."""
    token = SESSION.set(session)

    def stalled(line: str) -> None:  # from the reaper's thread: Tune's stopper reads it
        session.stalled = line

    try:
        with PlacementGroupReaper(on_stalled=stalled), _tune_output_off():
            outcome = relay(tune_run, lambda *_: session.stop_trials(), name="tune.run")
    finally:
        SESSION.reset(token)
    if outcome.error is not None:  # Tune's own failure, even after a Ctrl-C: not a result
        raise outcome.error
    if session.stalled is not None and not session.interrupted:
        raise UserError(session.stalled)


@contextlib.contextmanager
def _tune_output_off() -> Iterator[None]:
    """Tune prints nothing while it runs. Its new output engine prints the experiment's
    configuration box and "View detailed results here" to stdout even with ``verbose=0``;
    its legacy engine (``RAY_AIR_NEW_OUTPUT=0``, Ray's documented switch) is silent then.
    The variable is read when the run starts, in this process only. Its TensorBoard logger
    warns that it cannot log the per-worker placement each epoch reports (a list): quiet."""
    before = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    tensorboard = logging.getLogger("ray.tune.logger.tensorboardx")
    level = tensorboard.level
    tensorboard.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tensorboard.setLevel(level)
        if before is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = before
