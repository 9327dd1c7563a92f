"""The Tune search as a library call: :func:`search` returns a :class:`SearchResult`.

Every trial is a full ``TorchTrainer`` run of fit's worker loop (``trainer.build_trainer``),
built and fitted inside a Tune function trainable: Ray 2.60's Train V2 no longer accepts
``Tuner(TorchTrainer(...))``. ``TuneReportCallback`` hands every epoch to Tune, so ASHA can
stop bad trials early.

MNIST is loaded once, on the driver, and every trial hands the same object-store
reference to its workers. The experiment directory ``<storage-path>/<name>`` holds the
search's records (``search.json``: its identity; ``trials.json``: the trials it draws),
``runs/<trial>/`` (each trial's Train run, its checkpoints, and ``trial.json`` once the trial
ended), ``results.csv``, ``val_accuracy.png`` and ``best.json``
(:meth:`SearchResult.to_dict`), and the files Tune writes as it runs (``trial_<trial>/``,
``experiment_state-*.json`` and the like).

**Resuming trusts nothing executable from storage.** Searching again with the same settings
continues the search without Tune's saved state (``tuner.pkl``, the experiment state and the
searcher's and trials' pickles, which whoever can write the storage could replace with code):
it is never read. Instead the search is drawn again: Tune's own sampler, seeded with
``--search-seed``, draws the same trials with the same values every time
(:func:`draw_trials`), each named by its place in the search (``<5 hex>_<index>``), so each
trial's Train run is found again under ``runs/<trial>`` and resumes from its last committed
checkpoint (weights-only: ``torch.load(weights_only=True)``). A trial that ended (its epochs
all trained, or stopped early by ASHA) left ``runs/<trial>/trial.json``, a JSON record this
module wrote, read back like input (its trial, its values, its status and per-epoch metrics
checked) and never trained again; ASHA is given those trials' epochs again, so its rungs
rank the resumed trials as they would have been. Tune runs only the trials that had not
ended, as a fresh Tune run, and its results reach this module through callbacks in memory
(Tune's result objects, which unpickle a failed trial's ``error.pkl`` from storage, are
never built).

Library code: it never prints. What happens while it runs (the search starting, each trial
starting, reporting an epoch and ending) goes to the ``on_event`` sink as the events of
:mod:`raytrain_mnist.driver.events`; a Ctrl-C (or a SIGTERM the command turns into one)
stops the trials and returns a result whose ``status`` is ``"interrupted"``.
"""

from __future__ import annotations

import contextlib
import contextvars
import csv
import dataclasses
import io
import logging
import os
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from raytrain_mnist.config import (
    FitConfig,
    RunSettings,
    TrainConfig,
    command_line,
    finite_number,
    flags_of,
    settings_digest,
)
from raytrain_mnist.driver import cluster
from raytrain_mnist.driver.events import (
    EventSink,
    Note,
    SearchStarting,
    Stopping,
    TrialEnded,
    TrialReported,
    TrialStarted,
    log_event,
)
from raytrain_mnist.driver.fitting import default_invocation
from raytrain_mnist.driver.runs import BEST_FILE, RUNS_DIR, SEARCH_FILE, Claim, Run, data_identity
from raytrain_mnist.driver.search_space import (
    SearchSpace,
    TuneSettings,
    check_search,
    experiment_identity,
    experiment_name,
)
from raytrain_mnist.errors import EXIT_USAGE, UserError, first_line

logger = logging.getLogger(__name__)

RESULTS_FILE = "results.csv"
PLOT_FILE = "val_accuracy.png"
#: ``<experiment>/trials.json``: the trials the search draws (names and values), written when
#: it starts; a resume that draws others (another Tune's sampler) is refused.
PLAN_FILE = "trials.json"
#: ``runs/<trial>/trial.json``: a trial that ended (finished, or stopped early): its values,
#: its status and its per-epoch metrics. Such a trial is never trained again.
TRIAL_FILE = "trial.json"
#: What Tune's own restore would unpickle: a directory that holds it but no ``search.json``
#: is someone else's experiment.
TUNER_STATE = "tuner.pkl"
#: The trial actor only waits on its trainer; Tune refuses 0 CPUs, so it takes a sliver.
TRIAL_CPU = 0.01
#: A trial whose actor dies (its node, say) is retried once; its Train run resumes.
TRIAL_RETRIES = 1
#: What a search ended as (``SearchResult.status``).
SearchStatus = Literal["finished", "interrupted", "failed"]
FINISHED: SearchStatus = "finished"
INTERRUPTED: SearchStatus = "interrupted"
FAILED: SearchStatus = "failed"
#: How a trial ended, in its ``trial.json`` (the trials of a result also read "error" and
#: "unfinished": those are trained again by the next search).
TRIAL_FINISHED = "finished"
TRIAL_STOPPED = "stopped early"
ENDED = (TRIAL_FINISHED, TRIAL_STOPPED)


@dataclass(frozen=True)
class SearchResult:
    """A search that ended: its trials ranked, the best one, and where it all lies.

    ``status``: ``"finished"`` (every trial ended), ``"interrupted"`` (a Ctrl-C stopped it;
    the same search resumes the ``num_unfinished`` trials) or ``"failed"`` (``num_errors``
    trials failed; searching again retries them). The other fields are what ``best.json``
    holds (:meth:`to_dict`); ``best_metric`` is the best trial's best ``metric``, ``trials``
    each trial (ranked, best first), with its per-epoch ``history``.
    """

    status: SearchStatus
    name: str
    experiment_dir: str
    metric: str
    mode: str
    best_trial: str | None
    best_metric: float | None
    best_val_accuracy: float | None
    best_epoch: int | None
    best_config: dict | None  # every TrainConfig field of the best trial
    best_checkpoint: str | None
    fit_command: str | None  # the fit command that trains the best trial's config again
    num_trials: int
    num_finished: int
    num_stopped_early: int
    num_errors: int
    num_unfinished: int
    search_space: dict
    scheduler: str
    max_epochs: int
    num_workers: int
    wall_time_s: float
    trials: list[dict]

    @property
    def files(self) -> tuple[str, ...]:
        """What the search wrote into ``experiment_dir`` besides Tune's state and the runs."""
        return tuple(f"{self.experiment_dir}/{f}" for f in (RESULTS_FILE, PLOT_FILE, BEST_FILE))

    def to_dict(self) -> dict[str, Any]:
        """What ``best.json`` holds: the fields but ``status``, ``best_metric`` named
        ``best_<metric>``, and the trials without their history."""
        record: dict[str, Any] = {
            "name": self.name,
            "experiment_dir": self.experiment_dir,
            "metric": self.metric,
            "mode": self.mode,
            "best_trial": self.best_trial,
            f"best_{self.metric}": self.best_metric,
            "best_val_accuracy": self.best_val_accuracy,
        }
        skip = {"status", "best_metric", "trials", *record}
        record.update(
            {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        )
        record["trials"] = [{k: v for k, v in t.items() if k != "history"} for t in self.trials]
        return record


def search(
    space: SearchSpace,
    settings: TuneSettings,
    train: TrainConfig,
    run: RunSettings,
    *,
    on_event: EventSink | None = None,
    fit_invocation: Sequence[str] | None = None,
) -> SearchResult:
    """Run (or continue) the search of ``space`` over fit's trainer.

    ``train`` holds the values of every field that is not searched (``epochs``: the most a
    trial trains), ``run`` how and where each trial runs (``name`` names the search; by
    default it is derived from the settings, and the same settings resume the same search:
    the trials that ended are not run again, the others resume from their checkpoints).
    ``on_event`` receives the search's events (default: :func:`~events.log_event`);
    ``fit_invocation`` the words that start ``fit`` in ``fit_command`` (default:
    :func:`~raytrain_mnist.driver.fitting.default_invocation`). Bad settings raise
    :class:`ConfigError` or :class:`UserError` before anything starts.
    """
    started = time.perf_counter()
    check_search(space, settings, train, run)
    settings_identity = experiment_identity(space, settings, train, run)
    experiment = Run(run.storage_path, experiment_name(settings_identity, run), record=SEARCH_FILE)

    from raytrain_mnist.data import load_mnist

    data = load_mnist(run.data_dir, run.dataset)
    space.check_data(train, run, data.train_size)  # every trial it can draw must train
    identity = {**settings_identity, "data": data_identity(data)}
    sink = on_event or log_event
    fit_words = list(default_invocation() if fit_invocation is None else fit_invocation)
    plan = draw_trials(space, settings, identity)
    with experiment.claim(run.fresh, "search"):  # one search per directory at a time
        experiment.held.handled = True  # a lost claim stops the search, with one line
        resuming = _check_experiment(experiment, identity, plan, settings.resume)
        experiment.write_json(SEARCH_FILE, identity)
        experiment.write_json(PLAN_FILE, _plan_record(plan))
        ended = read_ended_trials(experiment, plan, train, settings.metric)
        session = _Session(
            sink=sink,
            plan=dict(plan),
            searched=space.searched,
            train=train,
            metric=settings.metric,
            runs_root=f"{experiment.dir}/{RUNS_DIR}",
            ended=ended,
            claim=experiment.held,
        )
        _tune(space, settings, train, run, experiment, data, resuming, session)
        trials = collect_trials(plan, session, settings.resolved_mode)
        result = _result(space, settings, train, run, experiment, trials, fit_words, started)
        if experiment.held.lost.is_set():
            # Another command may hold the experiment now: nothing more is written into it.
            sink(
                Note(f"{experiment.held.reason}: the search stopped; its trials' checkpoints stay")
            )
            return result
        # Still claimed: a second command never reads a half-written result.
        experiment.write_bytes(RESULTS_FILE, results_csv(trials, space.searched, settings.metric))
        from raytrain_mnist.driver.tune_plots import trials_png

        experiment.write_bytes(
            PLOT_FILE,
            trials_png(
                trials,
                f"{experiment.name}: validation accuracy per trial ({run.num_workers} "
                f"worker(s), {data.kind})",
            ),
        )
        experiment.write_json(BEST_FILE, result.to_dict())
    return result


# --------------------------------------------------------------------------- the trials


def draw_trials(
    space: SearchSpace, settings: TuneSettings, identity: dict
) -> list[tuple[str, dict]]:
    """The search's trials in order: (name, the training values it draws).

    Tune's own sampler draws them, seeded with ``settings.search_seed``, value for value as
    Tune's ``BasicVariantGenerator(random_state=seed)`` draws its trials: the same settings
    draw the same trials every time, which is what lets a search resume with nothing of
    Tune's saved state. A trial is named ``<5 hex of the identity>_<index>``: its Train run
    is ``runs/<name>``."""
    import numpy as np
    from ray.tune.search.variant_generator import generate_variants

    rng = np.random.default_rng(settings.search_seed)
    spec = {"config": space.param_space()}
    prefix = settings_digest(identity)[:5]
    trials = []
    for index in range(settings.num_samples):
        _, resolved = next(generate_variants(spec, random_state=rng))
        values = resolved["config"]["train_loop_config"]
        trials.append((f"{prefix}_{index:05d}", {k: _plain(v) for k, v in values.items()}))
    return trials


def _plain(value: Any) -> Any:
    """A NumPy scalar as the Python number it holds (JSON writes it, == compares it)."""
    return value.item() if hasattr(value, "item") else value


def _plan_record(plan: list[tuple[str, dict]]) -> dict:
    return {"trials": [{"trial_id": name, "config": values} for name, values in plan]}


def _trial_config(train: TrainConfig, values: dict) -> TrainConfig:
    return TrainConfig.from_dict({**train.to_dict(), **values})


def _trial(config: dict, setup: dict, data: list) -> None:
    """One Tune trial: fit's TorchTrainer with the trial's values, its Train run named after
    the trial (a trial run again resumes that run from its last checkpoint)."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from raytrain_mnist.driver.trainer import build_trainer
    from raytrain_mnist.worker.loop import train_func_per_worker

    name = config["trial"]
    train = TrainConfig.from_dict({**setup["train"], **setup["plan"][name]})
    cfg = FitConfig(train, RunSettings(**setup["run"]))
    loop_config = {
        "train": cfg.train.to_dict(),
        "data": data[0],
        "cpus_per_worker": setup["cpus_per_worker"],
        "compile": cfg.run.compile,
    }
    trainer = build_trainer(
        cfg.run,
        train_func_per_worker,
        loop_config,
        setup["cpus_per_worker"],
        setup["runs_root"],
        name,
        callbacks=[TuneReportCallback()],
    )
    trainer.fit()  # raises when the run fails: Tune records the error and may retry


class PlacementGroupReaper:
    """Removes the worker placement groups that ended trials leave behind, from a thread of
    the driver while the search runs.

    When a trial ends (ASHA stops it, or it finishes), Tune kills its actor and the Train
    controller with it; the workers' placement group outlives them (ray-project/ray#54305).
    Train's own cleaner finds it through the State API, but finds the cluster by address
    discovery, which fails wherever one machine runs two Ray instances: the group then holds
    its CPUs forever and later trials never start. The driver knows its cluster, so it
    checks too: a placement group of this job whose Train workers are all dead is removed.
    A group whose workers are starting or running is never touched.
    """

    def __init__(self, every_s: float = 3.0) -> None:
        self.every_s = every_s
        self.removed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PlacementGroupReaper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.removed += self.reap()
            except Exception:  # no State API (no dashboard): Ray's own cleaner is all there is
                pass

    @staticmethod
    def reap() -> list[str]:
        import ray
        from ray.util.placement_group import PlacementGroup
        from ray.util.state import list_actors

        context = ray.get_runtime_context()
        actors = list_actors(
            address=context.gcs_address,
            detail=True,
            limit=10_000,
            filters=[("class_name", "=", "RayTrainWorker"), ("job_id", "=", context.get_job_id())],
            raise_on_missing_output=False,
        )
        dead: dict[str, bool] = {}
        for actor in actors:
            if actor.placement_group_id:
                dead[actor.placement_group_id] = (
                    dead.get(actor.placement_group_id, True) and actor.state == "DEAD"
                )
        removed = []
        for pg_id, info in ray.util.placement_group_table().items():
            if info.get("state") == "CREATED" and dead.get(pg_id):
                ray.util.remove_placement_group(
                    PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id)))
                )
                removed.append(pg_id)
        return removed


def _trial_dirname(trial) -> str:
    return f"trial_{trial.config['trial']}"


# --------------------------------------------------------------------------- trial records


def _epoch_entry(result: dict, metric: str) -> dict | None:
    """One epoch of a trial's history, as its record keeps it: the epoch, ``val_accuracy``,
    ``val_loss`` and ``metric`` (None where the number is not finite: a diverged trial)."""
    epoch = result.get("epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
        return None
    keys = dict.fromkeys(("val_accuracy", "val_loss", metric))
    return {"epoch": epoch, **{k: finite_number(result.get(k)) for k in keys}}


def record_problem(record: Any, name: str, values: dict, epochs: int, metric: str) -> str | None:
    """What is wrong with ``record`` as the ``trial.json`` of trial ``name`` (its values
    ``values``, at most ``epochs`` epochs), or None: it is read like input."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("trial_id") != name:
        return f"it names trial {record.get('trial_id')!r}"
    if record.get("config") != values:
        return "its values are not the ones this search draws for the trial"
    status = record.get("status")
    if status not in ENDED:
        return f"status {status!r} is not one of {', '.join(ENDED)}"
    history = record.get("history")
    if not isinstance(history, list) or not history or len(history) > epochs:
        return f"its history is not a list of 1 to {epochs} epochs"
    keys = {"epoch", "val_accuracy", "val_loss", metric}
    for number, entry in enumerate(history, 1):
        if not isinstance(entry, dict) or set(entry) != keys:
            return f"epoch record {number} does not hold exactly {', '.join(sorted(keys))}"
        epoch = entry["epoch"]
        if isinstance(epoch, bool) or epoch != number:
            return f"epoch record {number} is of epoch {epoch!r}"
        for key in keys - {"epoch"}:
            value = entry[key]
            if value is not None and finite_number(value) is None:
                return f"epoch {number}: {key} {value!r} is not a finite number"
        accuracy = entry["val_accuracy"]
        if accuracy is not None and not 0 <= accuracy <= 1:
            return f"epoch {number}: val_accuracy {accuracy!r} is not an accuracy"
    if (status == TRIAL_FINISHED) != (len(history) == epochs):
        return f"{status!r} after {len(history)} of {epochs} epochs"
    return None


def read_ended_trials(
    experiment: Run, plan: list[tuple[str, dict]], train: TrainConfig, metric: str
) -> dict[str, dict]:
    """The ``trial.json`` records of the trials of ``plan`` that ended, by name. A record
    that is not one this search wrote for that trial is one line (:class:`UserError`)."""
    ended = {}
    for name, values in plan:
        trial_run = Run(f"{experiment.dir}/{RUNS_DIR}", name)
        record = trial_run.read_json(TRIAL_FILE)
        if record is None:
            continue
        problem = record_problem(record, name, values, train.epochs, metric)
        if problem:
            raise UserError(
                f"{trial_run.dir}/{TRIAL_FILE} is not a record of this search's trial "
                f"{name} ({problem}); move it away to train the trial again, or add --fresh",
                EXIT_USAGE,
            )
        ended[name] = record
    return ended


def _checkpoint_history(runs_root: str, name: str, train: dict, metric: str) -> list[dict]:
    """The per-epoch history that trial ``name``'s latest committed checkpoint holds (loaded
    weights-only), [] when it has none or it is not the trial's (``train``: its config)."""
    from raytrain_mnist.nn import checkpoint as ckpt

    trial_run = Run(runs_root, name)
    try:
        latest = trial_run.latest_checkpoint()
        if latest is None:
            return []
        with trial_run.local_copy(latest) as directory:
            state = ckpt.load(directory)
    except (UserError, OSError) as exc:
        logger.warning("trial %s: its checkpoint is unreadable (%s)", name, first_line(exc))
        return []
    history = state.get("history")
    if state.get("config") != train or not isinstance(history, list):
        logger.warning("trial %s: its latest checkpoint is not of this trial", name)
        return []
    entries = [_epoch_entry(h, metric) for h in history if isinstance(h, dict)]
    return [e for e in entries if e is not None]


def trial_history(
    runs_root: str, name: str, train: dict, seen: dict[int, dict], metric: str
) -> list[dict]:
    """Trial ``name``'s epochs: those Tune reported in this search (``seen``, by epoch), after
    those its checkpoint holds when it resumed (its first epoch here was not epoch 1); up to
    the last epoch reported here. Epochs 1 to N, or [] when they do not join up."""
    reported = sorted(seen)
    if reported == list(range(1, len(reported) + 1)) and reported:
        return [seen[e] for e in reported]
    merged = {e["epoch"]: e for e in _checkpoint_history(runs_root, name, train, metric)}
    merged.update(seen)
    last = reported[-1] if reported else max(merged, default=0)
    history = [merged[e] for e in sorted(merged) if e <= last]
    if [e["epoch"] for e in history] != list(range(1, len(history) + 1)):
        logger.warning("trial %s: its epochs do not join up (%s)", name, sorted(merged))
        return []
    return history


# --------------------------------------------------------------------------- Tune's side


@dataclass
class _Session:
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

    def train_of(self, name: str) -> dict:
        return _trial_config(self.train, self.plan[name]).to_dict()

    def history(self, name: str) -> list[dict]:
        return trial_history(
            self.runs_root, name, self.train_of(name), self.seen.get(name, {}), self.metric
        )

    def trial_ended(self, name: str) -> None:
        """Tune ended trial ``name``: record it when it ended for good (all its epochs, or
        the scheduler stopped it); one stopped with the search resumes instead."""
        epochs = self.train.epochs
        history = self.history(name)
        last = history[-1]["epoch"] if history else 0
        if last >= epochs:
            status = TRIAL_FINISHED
        elif name in self.stopped and history:
            status = TRIAL_STOPPED
        else:
            return
        record = {
            "trial_id": name,
            "config": self.plan[name],
            "status": status,
            "history": history,
        }
        try:
            Run(self.runs_root, name).write_json(TRIAL_FILE, record)
        except UserError as exc:  # the next search trains it again (its run resumes)
            logger.warning("trial %s: %s", name, exc)
            return
        self.ended[name] = record
        self.errors.pop(name, None)
        self.sink(TrialEnded(name, status, last, self.metric, history[-1][self.metric]))


#: The search running in this context. Tune's callbacks and stopper find it through
#: :func:`_session`: Tune pickles them into its experiment state, so they hold nothing, and
#: name nothing but module-level functions (pickled by reference).
_SESSION: contextvars.ContextVar[_Session] = contextvars.ContextVar("search_session")


def _session() -> _Session:
    return _SESSION.get()


def _trial_events():
    """A Tune callback that turns trial starts, epochs and ends into the session's events
    and records (:class:`_Session`)."""
    from ray import tune

    class TrialEvents(tune.Callback):
        def on_trial_start(self, iteration, trials, trial, **info):
            session, name = _session(), trial.config["trial"]
            session.sink(TrialStarted(name, dict(session.plan[name]), tuple(session.searched)))

        def on_trial_result(self, iteration, trials, trial, result, **info):
            session, name = _session(), trial.config["trial"]
            entry = _epoch_entry(result, session.metric)
            if entry is None:
                return
            session.seen.setdefault(name, {})[entry["epoch"]] = entry
            session.sink(TrialReported(name, dict(result), session.train.epochs))
            # Tune marks the result the scheduler stops the trial at as done.
            if result.get("done") and entry["epoch"] < session.train.epochs:
                session.stopped.add(name)

        def on_trial_complete(self, iteration, trials, trial, **info):
            _session().trial_ended(trial.config["trial"])

        def on_trial_error(self, iteration, trials, trial, **info):
            session, name = _session(), trial.config["trial"]
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


def _search_stop():
    """A Tune stopper that ends the whole search once the session's ``stop`` is set (Tune
    then stops the trials; their committed checkpoints stay)."""
    from ray import tune

    class SearchStop(tune.Stopper):
        def __call__(self, trial_id, result):
            return False

        def stop_all(self):
            session = _session()
            lost = session.claim is not None and session.claim.lost.is_set()
            return session.stop.is_set() or lost

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


# --------------------------------------------------------------------------- the search


def _check_experiment(
    experiment: Run, identity: dict, plan: list[tuple[str, dict]], resume: bool
) -> bool:
    """True when ``experiment`` holds a search to continue; refuses a conflicting one.

    Nothing of Tune's saved state is read: only this module's JSON records. A directory
    with Tune's state (``tuner.pkl``) but no ``search.json`` is someone else's experiment,
    and is not mixed into; a search whose recorded trials differ from the ones drawn now
    (a Tune whose sampler draws otherwise) is not continued with other values."""
    experiment.check_identity(identity, "search")
    known = experiment.identity() is not None
    if not known and experiment.is_file(TUNER_STATE):
        raise UserError(
            f"{experiment.dir} holds a Tune experiment that this command did not "
            f"start (no {SEARCH_FILE}); it is never restored or resumed. Pick another --name",
            EXIT_USAGE,
        )
    if resume and not known:
        raise UserError(
            f"--resume: no search to continue in {experiment.dir}; drop --resume to start it",
            EXIT_USAGE,
        )
    recorded = experiment.read_json(PLAN_FILE) if known else None
    if recorded is not None and recorded != _plan_record(plan):
        raise UserError(
            f"{experiment.dir}/{PLAN_FILE}: the search drew other trials than this command "
            "draws now (another version of Ray Tune's sampler?); add --fresh to start it "
            "again, or pick another --name",
            EXIT_USAGE,
        )
    return known


def _plan(settings: TuneSettings, run: RunSettings, local: bool) -> tuple[int, int]:
    """(trials at once, CPUs per worker) before connecting. A local Ray is sized for them."""
    cores = os.cpu_count() or 1
    wanted = settings.max_concurrent_trials
    if not local:
        return wanted or settings.num_samples, run.cpus_per_worker or 1
    if run.cpus_per_worker:
        per_trial = run.num_workers * run.cpus_per_worker
        return wanted or max(1, min(settings.num_samples, cores // per_trial)), run.cpus_per_worker
    # Share the machine's cores between the trials that run at once.
    concurrent = wanted or max(1, min(settings.num_samples, cores // run.num_workers))
    return concurrent, max(1, cores // (run.num_workers * concurrent))


def trials_the_cluster_holds(run: RunSettings, cpus_per_worker: int) -> int:
    """Trials that run at once without starving each other: each needs its trial actor
    (a sliver of a CPU), its workers (their own placement group, outside Tune's
    accounting) and a Train controller (no CPU)."""
    import ray

    total = ray.cluster_resources()
    per_trial = run.num_workers * cpus_per_worker + TRIAL_CPU
    holds = int(total.get("CPU", 0) // per_trial)
    if run.use_gpu:
        holds = min(holds, int(total.get("GPU", 0) // run.num_workers))
    return holds


def _tune(
    space: SearchSpace,
    settings: TuneSettings,
    train: TrainConfig,
    run: RunSettings,
    experiment: Run,
    data,
    resuming: bool,
    session: _Session,
) -> None:
    """Connect and run, as a fresh Tune run, the trials of ``session`` that had not ended;
    Tune's callbacks fill ``session`` in. Nothing to run: no Ray is started."""
    address = cluster.resolve_address(run.address)
    import ray

    local = address is None and not ray.is_initialized()
    concurrent, cpus_per_worker = _plan(settings, run, local)
    pending = [name for name in session.plan if name not in session.ended]
    mode = settings.resolved_mode

    def starting(concurrent: int) -> SearchStarting:
        return SearchStarting(
            name=experiment.name,
            resuming=resuming,
            num_samples=settings.num_samples,
            scheduler=settings.scheduler,
            metric=settings.metric,
            mode=mode,
            concurrent=concurrent,
            num_workers=run.num_workers,
            cpus_per_worker=cpus_per_worker,
            gpus_per_worker=run.gpus,
            max_epochs=train.epochs,
            train_size=data.train_size,
            test_size=data.test_size,
            data_source=data.source,
        )

    before = len(session.ended)
    ended_note = Note(
        f"{before} of {settings.num_samples} trial(s) ended before; "
        + ("nothing to train" if not pending else "they are not trained again")
    )
    if not pending:
        session.sink(starting(min(concurrent, settings.num_samples)))
        session.sink(Note(f"search space: {space.describe()}"))
        session.sink(ended_note)
        return
    sized_for = concurrent if local else 1
    request = dataclasses.replace(
        cluster.Request.for_run(run, cpus_per_worker),
        num_workers=run.num_workers * sized_for,
        extra_cpus=sized_for * TRIAL_CPU,
    )
    with cluster.connect(address, request):
        holds = trials_the_cluster_holds(run, cpus_per_worker)
        if settings.max_concurrent_trials and settings.max_concurrent_trials > holds:
            raise UserError(
                f"--max-concurrent-trials {settings.max_concurrent_trials}: the cluster holds "
                f"{holds} trial(s) of {run.num_workers} worker(s) x {cpus_per_worker} CPU at once; "
                "lower it, or --num-workers / --cpus-per-worker",
                EXIT_USAGE,
            )
        concurrent = max(1, min(concurrent, holds, len(pending)))
        session.sink(starting(concurrent))
        session.sink(Note(f"search space: {space.describe()}"))
        if before:
            session.sink(ended_note)

        from ray import tune

        setup = {
            "train": train.to_dict(),
            "run": dataclasses.asdict(run),
            "cpus_per_worker": cpus_per_worker,
            "runs_root": session.runs_root,
            "plan": session.plan,
        }
        trainable = tune.with_resources(
            tune.with_parameters(_trial, setup=setup, data=[ray.put(data)]), {"CPU": TRIAL_CPU}
        )

        def run_trials() -> None:
            # tune.run, not a Tuner: a Tuner's results load a failed trial's pickled error
            # back from storage. Its value (an analysis of the trials) is not used either.
            tune.run(
                trainable,
                name=experiment.name,
                storage_path=experiment.storage,
                # The trials that had not ended, in the search's order, by name.
                config={"trial": tune.grid_search(pending)},
                scheduler=_scheduler(settings, train.epochs, session.ended.values()),
                # The limit goes to the searcher: Tune ignores max_concurrent_trials next to
                # a BasicVariantGenerator instance.
                search_alg=_searcher(concurrent),
                stop=_search_stop(),
                trial_dirname_creator=_trial_dirname,
                max_failures=TRIAL_RETRIES,
                callbacks=[_trial_events()],
                raise_on_failed_trial=False,
                verbose=0,
            )

        token = _SESSION.set(session)
        try:
            with PlacementGroupReaper(), _tune_output_off():
                _run_interruptibly(run_trials, session)
        finally:
            _SESSION.reset(token)


def _run_interruptibly(run_trials: Callable[[], None], session: _Session) -> None:
    """``run_trials`` (Tune's run) on a helper thread, so that Ctrl-C reaches this (main)
    thread, as ``fit`` does: Tune installs no signal handler off the main thread (its own
    turns a Ctrl-C that comes before the first trial exists into an analysis loaded from
    the experiment directory, with pickles). A Ctrl-C sets ``session.stop``: Tune stops
    the trials at its next step and returns; a second one stops waiting for it."""
    outcome: dict[str, BaseException] = {}
    context = contextvars.copy_context()  # the session, for Tune's callbacks on that thread

    def target() -> None:
        try:
            context.run(run_trials)
        except BaseException as exc:  # handed to the main thread as is
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="tune.run", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        session.sink(Stopping("stopping the trials; each keeps its last committed checkpoint"))
        session.stop.set()
        while thread.is_alive():
            thread.join(0.5)
    if "error" in outcome:
        raise outcome["error"]


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


def _scheduler(settings: TuneSettings, epochs: int, ended: Iterable[dict] = ()):
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
        results = [
            {"epoch": h["epoch"], settings.metric: h[settings.metric]}
            for h in record["history"]
            if h[settings.metric] is not None
        ]
        trial = types.SimpleNamespace(trial_id=record["trial_id"])  # all ASHA reads of one
        asha.on_trial_add(None, trial)
        for result in results:
            asha.on_trial_result(None, trial, result)
        if results:
            asha.on_trial_complete(None, trial, results[-1])
        else:
            asha.on_trial_remove(None, trial)
    return asha


def _searcher(concurrent: int):
    from ray.tune.search.basic_variant import BasicVariantGenerator

    return BasicVariantGenerator(max_concurrent=concurrent)


# --------------------------------------------------------------------------- results


def collect_trials(plan: list[tuple[str, dict]], session: _Session, mode: str) -> list[dict]:
    """One dict per trial of ``plan``, ranked best first by the best ``metric`` over its
    epochs: an ended trial as its record says, the others as far as they got."""
    metric = session.metric
    trials = []
    for name, values in plan:
        record = session.ended.get(name)
        if record is not None:
            state, history = record["status"], record["history"]
        else:
            state = "error" if name in session.errors else "unfinished"
            history = session.history(name)
        scored = [h for h in history if h[metric] is not None]
        best_row = None
        if scored:
            pick = max if mode == "max" else min
            best_row = pick(scored, key=lambda h: h[metric])
        accuracies = [h["val_accuracy"] for h in history if h["val_accuracy"] is not None]
        trials.append(
            {
                "trial_id": name,
                "config": dict(values),
                "status": state,
                "stopped_early": state == TRIAL_STOPPED,
                "epochs_run": history[-1]["epoch"] if history else 0,
                "best_epoch": best_row["epoch"] if best_row else None,
                f"best_{metric}": best_row[metric] if best_row else None,
                "best_val_accuracy": max(accuracies, default=None),
                # The trial's Train run knows what it kept: the best of those by the metric.
                "best_checkpoint": Run(session.runs_root, name).best_checkpoint(metric, mode),
                "history": history,
                "error": session.errors.get(name) if state == "error" else None,
            }
        )
    sign = -1 if mode == "max" else 1
    trials.sort(
        key=lambda t: (
            t[f"best_{metric}"] is None,
            sign * (t[f"best_{metric}"] or 0),
            t["trial_id"],
        )
    )
    for rank, trial in enumerate(trials, 1):
        trial["rank"] = rank
    return trials


def _result(
    space: SearchSpace,
    settings: TuneSettings,
    train: TrainConfig,
    run: RunSettings,
    experiment: Run,
    trials: list[dict],
    fit_words: list[str],
    started: float,
) -> SearchResult:
    metric = settings.metric
    ranked = [t for t in trials if t[f"best_{metric}"] is not None]
    best = ranked[0] if ranked else None
    num_errors = sum(t["status"] == "error" for t in trials)
    num_unfinished = sum(t["status"] == "unfinished" for t in trials)
    return SearchResult(
        status=INTERRUPTED if num_unfinished else FAILED if num_errors else FINISHED,
        name=experiment.name,
        experiment_dir=experiment.dir,
        metric=metric,
        mode=settings.resolved_mode,
        best_trial=best["trial_id"] if best else None,
        best_metric=best[f"best_{metric}"] if best else None,
        best_val_accuracy=best["best_val_accuracy"] if best else None,
        best_epoch=best["best_epoch"] if best else None,
        best_config=dataclasses.replace(train, **best["config"]).to_dict() if best else None,
        best_checkpoint=best["best_checkpoint"] if best else None,
        fit_command=fit_command(fit_words, train, run, best["config"]) if best else None,
        num_trials=len(trials),
        num_finished=sum(t["status"] == "finished" for t in trials),
        num_stopped_early=sum(t["stopped_early"] for t in trials),
        num_errors=num_errors,
        num_unfinished=num_unfinished,
        search_space=space.to_dict(),
        scheduler=settings.scheduler,
        max_epochs=train.epochs,
        num_workers=run.num_workers,
        wall_time_s=round(time.perf_counter() - started, 2),
        trials=trials,
    )


def fit_command(
    fit_words: Sequence[str], train: TrainConfig, run: RunSettings, config: dict
) -> str:
    """The ``fit`` command (``fit_words`` and flags) that trains ``config`` again."""
    trained = dataclasses.replace(train, **config)
    return command_line([*fit_words, *flags_of(trained, run, skip=("name", "fresh"))])


def results_csv(trials: list[dict], searched: list[str], metric: str) -> bytes:
    columns = ["rank", "trial_id", *searched, "best_val_accuracy"]
    if metric != "val_accuracy":
        columns.append(f"best_{metric}")
    columns += [
        "best_epoch",
        "epochs_run",
        "stopped_early",
        "status",
        "best_checkpoint",
        "val_accuracy_per_epoch",
    ]
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for t in trials:
        writer.writerow(
            {
                **t,
                **{n: t["config"].get(n) for n in searched},
                "val_accuracy_per_epoch": " ".join(
                    f"{h['val_accuracy']:.6f}" for h in t["history"]
                ),
            }
        )
    return out.getvalue().encode()
