"""The Tune search as a library call: :func:`search` returns a :class:`SearchResult`.

Every trial is a full ``TorchTrainer`` run of fit's worker loop (``trainer.build_trainer``),
built and fitted inside a Tune function trainable: Ray 2.60's Train V2 no longer accepts
``Tuner(TorchTrainer(...))``. ``TuneReportCallback`` hands every epoch to Tune, so ASHA can
stop bad trials early. Each trial's Train run is named after its trial id, so a retried or
restored trial resumes from its last checkpoint instead of starting over.

MNIST is loaded once, on the driver, and every trial hands the same object-store
reference to its workers. The experiment directory ``<storage-path>/<name>`` holds Tune's
state (searching again with the same settings resumes it), ``runs/<trial id>/`` (each
trial's Train run and checkpoints), ``results.csv``, ``val_accuracy.png`` and ``best.json``
(:meth:`SearchResult.to_dict`).

Library code: it never prints. What happens while it runs (the search starting, each trial
starting, reporting an epoch and ending) goes to the ``on_event`` sink as the events of
:mod:`raytrain_mnist.driver.events`; a Ctrl-C that Tune turns into a graceful stop returns
a result whose ``status`` is ``"interrupted"``.
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from raytrain_mnist.config import (
    FitConfig,
    RunSettings,
    TrainConfig,
    command_line,
    finite_number,
    flags_of,
)
from raytrain_mnist.driver import cluster
from raytrain_mnist.driver.events import (
    EventSink,
    Note,
    SearchStarting,
    TrialEnded,
    TrialReported,
    TrialStarted,
    log_event,
)
from raytrain_mnist.driver.fitting import default_invocation
from raytrain_mnist.driver.runs import BEST_FILE, RUNS_DIR, SEARCH_FILE, Run, data_identity
from raytrain_mnist.driver.search_space import (
    SearchSpace,
    TuneSettings,
    check_search,
    experiment_identity,
    experiment_name,
)
from raytrain_mnist.errors import EXIT_USAGE, UserError, cause_line

logger = logging.getLogger(__name__)

RESULTS_FILE = "results.csv"
PLOT_FILE = "val_accuracy.png"
#: The trial actor only waits on its trainer; Tune refuses 0 CPUs, so it takes a sliver.
TRIAL_CPU = 0.01
#: A trial whose actor dies (its node, say) is retried once; its Train run resumes.
TRIAL_RETRIES = 1
#: What a search ended as (``SearchResult.status``).
SearchStatus = Literal["finished", "interrupted", "failed"]
FINISHED: SearchStatus = "finished"
INTERRUPTED: SearchStatus = "interrupted"
FAILED: SearchStatus = "failed"


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
    default it is derived from the settings, and the same settings resume the same search).
    ``on_event`` receives the search's events (default: :func:`~events.log_event`);
    ``fit_invocation`` the words that start ``fit`` in ``fit_command`` (default:
    :func:`~raytrain_mnist.driver.fitting.default_invocation`). Bad settings raise :class:`ConfigError` or :class:`UserError`
    before anything starts.
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
    with experiment.claim(run.fresh, "search"):  # one search per directory at a time
        restoring = _check_experiment(experiment, identity, settings.resume)
        trials = _tune(space, settings, train, run, experiment, identity, data, restoring, sink)
        result = _result(space, settings, train, run, experiment, trials, fit_words, started)
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


# --------------------------------------------------------------------------- the trial


def _trial(config: dict, setup: dict, data: list) -> None:
    """One Tune trial: fit's TorchTrainer with the sampled values, named by the trial id."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from raytrain_mnist.driver.trainer import build_trainer
    from raytrain_mnist.worker.loop import train_func_per_worker

    train = TrainConfig.from_dict({**setup["train"], **config["train_loop_config"]})
    cfg = FitConfig(train, RunSettings(**setup["run"]))
    loop_config = {
        "train": cfg.train.to_dict(),
        "data": data[0],
        "cpus_per_worker": setup["cpus_per_worker"],
    }
    trainer = build_trainer(
        cfg.run,
        train_func_per_worker,
        loop_config,
        setup["cpus_per_worker"],
        setup["runs_root"],
        tune.get_context().get_trial_id(),
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
    return f"trial_{trial.trial_id}"


#: The sink of the search running in this context. Tune pickles its callbacks with the
#: experiment and restores them from there: a callback holds no sink, it finds this one.
_SINK: contextvars.ContextVar[EventSink] = contextvars.ContextVar("search_sink", default=log_event)


def _emit(event) -> None:
    _SINK.get()(event)


def _trial_events(searched: list[str], epochs: int, metric: str):
    """A Tune callback that turns trial starts, epochs and ends into events (:func:`_emit`)."""
    from ray import tune

    class TrialEvents(tune.Callback):
        def on_trial_start(self, iteration, trials, trial, **info):
            values = dict(trial.config.get("train_loop_config", {}))
            _emit(TrialStarted(trial.trial_id, values, tuple(searched)))

        def on_trial_result(self, iteration, trials, trial, result, **info):
            if "epoch" in result:
                _emit(TrialReported(trial.trial_id, dict(result), epochs))

        def on_trial_complete(self, iteration, trials, trial, **info):
            last = trial.last_result or {}
            epoch = last.get("epoch", 0)
            outcome = "finished" if epoch >= epochs else "stopped early"
            _emit(
                TrialEnded(trial.trial_id, outcome, epoch, metric, finite_number(last.get(metric)))
            )

        def on_trial_error(self, iteration, trials, trial, **info):
            last = trial.last_result or {}
            _emit(
                TrialEnded(
                    trial.trial_id,
                    "failed",
                    last.get("epoch", 0),
                    metric,
                    error_file=f"{trial.path}/error.txt",
                )
            )

    return TrialEvents()


# --------------------------------------------------------------------------- the search


def _check_experiment(experiment: Run, identity: dict, resume: bool) -> bool:
    """True when ``experiment`` holds a search to continue; refuses a conflicting one.

    Restoring unpickles Tune's state (``tuner.pkl``, the trials'), which can run code: only
    a search this project wrote, under the same identity record, is ever restored, and on a
    local disk only one the current user owns.
    """
    from ray import tune

    experiment.check_identity(identity, "search")
    restorable = tune.Tuner.can_restore(experiment.dir)
    if restorable and experiment.identity() is None:
        raise UserError(
            f"{experiment.dir} holds a Tune experiment that this command did not "
            f"start (no {SEARCH_FILE}); it is never restored. Pick another --name",
            EXIT_USAGE,
        )
    if restorable and experiment.local:
        _check_owned(Path(experiment.dir))
    if resume and not restorable:
        raise UserError(
            f"--resume: no search to continue in {experiment.dir}; drop --resume to start it",
            EXIT_USAGE,
        )
    return restorable


def _check_owned(exp_dir: Path) -> None:
    """Tune state someone else could have written is not ours to unpickle."""
    me = os.getuid()
    for path in [
        exp_dir,
        *exp_dir.glob("*.pkl"),
        *exp_dir.glob("*.json"),
        *exp_dir.glob("*/*.pkl"),
    ]:
        stat = path.lstat()
        if stat.st_uid != me or (stat.st_mode & 0o002 and not path.is_dir()):
            raise UserError(
                f"{path} is not owned by you (or others may write it): the search "
                "in it is not restored. Pick another --name",
                EXIT_USAGE,
            )


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
    identity: dict,
    data,
    restoring: bool,
    sink: EventSink,
) -> list[dict]:
    """Connect, start (or restore) the Tuner, fit it; the trials, ranked."""
    address = cluster.resolve_address(run.address)
    import ray
    from ray import tune

    local = address is None and not ray.is_initialized()
    concurrent, cpus_per_worker = _plan(settings, run, local)
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
        concurrent = max(1, min(concurrent, holds, settings.num_samples))
        mode = settings.resolved_mode
        sink(
            SearchStarting(
                name=experiment.name,
                resuming=restoring,
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
        )
        sink(Note(f"search space: {space.describe()}"))
        experiment.write_json(SEARCH_FILE, identity)

        runs_root = f"{experiment.dir}/{RUNS_DIR}"
        setup = {
            "train": train.to_dict(),
            "run": dataclasses.asdict(run),
            "cpus_per_worker": cpus_per_worker,
            "runs_root": runs_root,
        }
        trainable = tune.with_resources(
            tune.with_parameters(_trial, setup=setup, data=[ray.put(data)]), {"CPU": TRIAL_CPU}
        )
        if restoring:
            # The callbacks are those saved with the experiment (they find this sink).
            tuner = tune.Tuner.restore(
                experiment.dir, trainable, resume_errored=True, param_space=space.param_space()
            )
        else:
            tuner = tune.Tuner(
                trainable,
                param_space=space.param_space(),
                tune_config=tune.TuneConfig(
                    metric=settings.metric,
                    mode=mode,
                    num_samples=settings.num_samples,
                    scheduler=_scheduler(settings, train.epochs),
                    # The limit goes to the searcher: Tune ignores max_concurrent_trials
                    # next to a BasicVariantGenerator instance.
                    search_alg=_searcher(settings.search_seed, concurrent),
                    trial_dirname_creator=_trial_dirname,
                ),
                run_config=tune.RunConfig(
                    name=experiment.name,
                    storage_path=experiment.storage,
                    failure_config=tune.FailureConfig(max_failures=TRIAL_RETRIES),
                    callbacks=[_trial_events(space.searched, train.epochs, settings.metric)],
                    verbose=0,
                ),
            )
        token = _SINK.set(sink)
        try:
            with PlacementGroupReaper(), _tune_output_off():
                grid = tuner.fit()
        finally:
            _SINK.reset(token)
        return collect_trials(grid, settings.metric, mode, train.epochs, runs_root)


@contextlib.contextmanager
def _tune_output_off() -> Iterator[None]:
    """Tune prints nothing while it fits. Its new output engine prints the experiment's
    configuration box and "View detailed results here" to stdout even with ``verbose=0``;
    its legacy engine (``RAY_AIR_NEW_OUTPUT=0``, Ray's documented switch) is silent then.
    The variable is read when the fit starts, in this process only."""
    before = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = before


def _scheduler(settings: TuneSettings, epochs: int):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if settings.scheduler == "fifo":
        return FIFOScheduler()
    # Rungs count epochs (reported by the loop), not Tune iterations: a resumed trial
    # restarts Tune's iteration counter but not its epochs.
    return ASHAScheduler(
        time_attr="epoch",
        max_t=epochs,
        grace_period=settings.grace_period,
        reduction_factor=settings.reduction_factor,
    )


def _searcher(seed: int, concurrent: int):
    from ray.tune.search.basic_variant import BasicVariantGenerator

    return BasicVariantGenerator(random_state=seed, max_concurrent=concurrent)


# --------------------------------------------------------------------------- results


def collect_trials(grid, metric: str, mode: str, epochs: int, runs_root: str) -> list[dict]:
    """One dict per trial, ranked best first by the best ``metric`` over its epochs."""
    statuses = _trial_statuses(grid)
    trials = []
    for result in grid:
        frame = result.metrics_dataframe
        by_epoch: dict[int, dict] = {}
        if frame is not None and "epoch" in frame:
            for row in frame.to_dict("records"):
                if finite_number(row.get("epoch")) is not None:
                    by_epoch[int(row["epoch"])] = row  # a resumed trial may repeat an epoch
        history = [
            {
                "epoch": e,
                "val_accuracy": r["val_accuracy"],
                "val_loss": r["val_loss"],
                metric: r[metric],
            }
            for e, r in sorted(by_epoch.items())
        ]
        trial_id = result.metrics.get("trial_id") or Path(result.path).name.removeprefix("trial_")
        status = statuses.get(trial_id)
        epochs_run = history[-1]["epoch"] if history else 0
        if result.error is not None:
            state = "error"
        elif epochs_run >= epochs:
            state = "finished"
        elif status in (None, "TERMINATED") and (history or status == "TERMINATED"):
            state = "stopped early"
        else:
            state = "unfinished"
        best_row = None
        if history:
            pick = max if mode == "max" else min
            best_row = pick(history, key=lambda h: h[metric])
        trials.append(
            {
                "trial_id": trial_id,
                "config": dict(result.config.get("train_loop_config", {})),
                "status": state,
                "stopped_early": state == "stopped early",
                "epochs_run": epochs_run,
                "best_epoch": best_row["epoch"] if best_row else None,
                f"best_{metric}": best_row[metric] if best_row else None,
                "best_val_accuracy": max((h["val_accuracy"] for h in history), default=None),
                # The trial's Train run knows what it kept: the best of those by the metric.
                "best_checkpoint": Run(runs_root, trial_id).best_checkpoint(metric, mode),
                "history": history,
                "error": None if result.error is None else cause_line(result.error),
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


def _trial_statuses(grid) -> dict[str, str]:
    """Tune's status per trial (TERMINATED, ERROR, RUNNING, PENDING...), as saved in the
    experiment directory: after a Ctrl-C the trials in memory all read TERMINATED, while
    the saved state keeps the interrupted ones RUNNING or PENDING, to resume them."""
    from ray.tune import ExperimentAnalysis

    try:
        return {t.trial_id: t.status for t in ExperimentAnalysis(grid.experiment_path).trials}
    except Exception:  # unreadable state: trials short of the budget count as stopped
        return {}


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
