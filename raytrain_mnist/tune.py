"""Driver and CLI of ``python -m raytrain_mnist.tune``: a Ray Tune search over fit's trainer.

Every trial is a full ``TorchTrainer`` run of fit's worker loop (``trainer.build_trainer``),
built and fitted inside a Tune function trainable: Ray 2.60's Train V2 no longer accepts
``Tuner(TorchTrainer(...))``. ``TuneReportCallback`` hands every epoch to Tune, so ASHA can
stop bad trials early. Each trial's Train run is named after its trial id, so a retried or
restored trial resumes from its last checkpoint instead of starting over.

MNIST is loaded once, on the driver, and every trial hands the same object-store
reference to its workers. The experiment directory ``<storage-path>/<name>`` holds Tune's
state (re-running the command resumes it), ``runs/<trial id>/`` (each trial's Train run and
checkpoints), ``results.csv``, ``val_accuracy.png`` and ``best.json``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import math
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raytrain_mnist._cli import (
    ArgumentParser,
    Command,
    add_dataclass_args,
    command_line,
    dataclass_from_args,
    flags_of,
    invocation,
    setup_logging,
)
from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig
from raytrain_mnist.driver import cluster
from raytrain_mnist.driver.runs import (
    BEST_FILE,
    RUNS_DIR,
    SEARCH_FILE,
    Run,
    data_identity,
)
from raytrain_mnist.driver.search_space import (
    SearchSpace,
    TuneSettings,
    check_budget,
    experiment_identity,
    experiment_name,
    searchable,
)
from raytrain_mnist.errors import EXIT_USAGE, UserError, cause_line

RESULTS_FILE = "results.csv"
PLOT_FILE = "val_accuracy.png"
#: The trial actor only waits on its trainer; Tune refuses 0 CPUs, so it takes a sliver.
TRIAL_CPU = 0.01
#: A trial whose actor dies (its node, say) is retried once; its Train run resumes.
TRIAL_RETRIES = 1
_UNSET = object()


@dataclasses.dataclass(frozen=True)
class TuneCommand:
    """Everything one search needs, parsed and checked."""

    space: SearchSpace
    settings: TuneSettings
    train: TrainConfig  # the values of every field that is not searched; epochs per trial
    run: RunSettings
    argv: tuple[str, ...] = ()  # as given, for the resume command


# --------------------------------------------------------------------------- command line


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist tune",
        description="Search hyperparameters with Ray Tune; every trial is a data-parallel "
        "TorchTrainer run of fit's loop. Unsearched flags mean what they mean "
        "in fit.",
    )
    search = parser.add_argument_group("search space")
    search.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="fix a parameter for every trial, e.g. --set lr=0.05 (the same as --lr 0.05)",
    )
    search.add_argument(
        "--range",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="search a parameter over LOW:HIGH (floats; log-uniform for lr and weight_decay, "
        "uniform otherwise) or a list A,B,C, e.g. --range lr=1e-3:0.3 "
        "--range batch_size=64,128 --range schedule=onecycle,constant. Default space: "
        + _default_space_text(),
    )
    add_dataclass_args(parser, TuneSettings, "search")
    parser.add_argument_group("per trial").add_argument(
        "--max-epochs",
        dest="epochs",
        type=int,
        default=argparse.SUPPRESS,
        metavar="EPOCHS",
        help="epochs of every trial that is not stopped early (the same as --epochs)",
    )
    add_dataclass_args(parser, TrainConfig, "training (every trial, unless searched)")
    add_dataclass_args(parser, RunSettings, "run (as in fit; --name names the search)")
    return parser


def _default_space_text() -> str:
    from raytrain_mnist.driver.search_space import SEARCH_SPACE

    return "; ".join(f"{n} {p.describe()}" for n, p in SEARCH_SPACE.items())


def parse_command(argv: Sequence[str] | None = None) -> TuneCommand:
    # A searchable training flag given on the command line fixes that parameter; argparse
    # keeps a value already in the namespace, so the sentinel marks "not given".
    namespace = argparse.Namespace(**{name: _UNSET for name in searchable()})
    args = build_parser().parse_args(argv, namespace=namespace)
    defaults = TrainConfig()
    given = {n: getattr(args, n) for n in searchable() if getattr(args, n) is not _UNSET}
    for name in searchable():
        if getattr(args, name) is _UNSET:
            setattr(args, name, getattr(defaults, name))
    settings = dataclass_from_args(TuneSettings, args)
    train = dataclass_from_args(TrainConfig, args)
    run = dataclass_from_args(RunSettings, args)
    FitConfig(train, run)  # the rules that span training and run settings
    space = SearchSpace.from_cli(args.set, args.range, given)
    space.check(train, run)
    check_budget(settings, train)
    if settings.resume and run.fresh:
        raise UserError(
            "--resume continues a search and --fresh starts it again: keep one", EXIT_USAGE
        )
    return TuneCommand(space, settings, train, run, tuple(sys.argv[1:] if argv is None else argv))


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


def _printer(searched: list[str], epochs: int, metric: str, progress: str = "auto"):
    """A Tune callback that shows the trials as they start, report and end: a table
    redrawn in place on a terminal, else one line when a trial starts and one when it ends
    (``--progress``, as in fit)."""
    from ray import tune

    from raytrain_mnist.console import TrialsTable

    table = TrialsTable(progress, searched, epochs, metric)

    class Printer(tune.Callback):
        def on_trial_start(self, iteration, trials, trial, **info):
            values = trial.config.get("train_loop_config", {})
            table.start(
                trial.trial_id,
                values,
                f"trial {trial.trial_id} started: "
                + ", ".join(f"{n}={_fmt(values.get(n))}" for n in searched),
            )

        def on_trial_result(self, iteration, trials, trial, result, **info):
            if "epoch" in result:
                table.result(trial.trial_id, result)

        def on_trial_complete(self, iteration, trials, trial, **info):
            last = trial.last_result or {}
            epoch = last.get("epoch", 0)
            how = "finished" if epoch >= epochs else f"stopped early after epoch {epoch}"
            score = (
                f": {metric} {_fmt(last[metric])}"
                if isinstance(last.get(metric), (int, float))
                else ""
            )
            table.end(trial.trial_id, how, f"trial {trial.trial_id} {how}{score}")

        def on_trial_error(self, iteration, trials, trial, **info):
            table.end(
                trial.trial_id,
                "failed",
                f"trial {trial.trial_id} failed: see {trial.path}/error.txt",
            )

        def on_experiment_end(self, trials, **info):
            table.close()

    return Printer()


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


def search(cmd: TuneCommand) -> dict[str, Any]:
    """Run (or continue) the search; returns what ``best.json`` holds."""
    started = time.perf_counter()
    space, settings, train, run = cmd.space, cmd.settings, cmd.train, cmd.run
    settings_identity = experiment_identity(space, settings, train, run)
    experiment = Run(run.storage_path, experiment_name(settings_identity, run), record=SEARCH_FILE)

    from raytrain_mnist.data import load_mnist

    data = load_mnist(run.data_dir, run.dataset)
    space.check_data(train, run, data.train_size)  # every trial it can draw must train
    identity = {**settings_identity, "data": data_identity(data)}
    with experiment.claim(run.fresh, "search"):  # one search per directory at a time
        restoring = _check_experiment(experiment, identity, settings.resume)
        best, trials = _search(cmd, experiment, identity, data, restoring, started)
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
        experiment.write_json(BEST_FILE, best)
    print_report(best, trials, space.searched, settings.metric)
    if best["num_unfinished"]:
        print(
            f"search interrupted with {best['num_unfinished']} trial(s) unfinished; "
            f"resume with: {resume_command(cmd, experiment.name)}",
            file=sys.stderr,
        )
        raise KeyboardInterrupt
    if best["num_errors"]:
        raise UserError(
            f"{best['num_errors']} trial(s) failed (see the table); rerun the "
            f"same command to retry them: {resume_command(cmd, experiment.name)}"
        )
    return best


def _search(
    cmd: TuneCommand, experiment: Run, identity: dict, data, restoring: bool, started: float
) -> tuple[dict, list[dict]]:
    space, settings, train, run = cmd.space, cmd.settings, cmd.train, cmd.run
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
        print(
            f"{'resuming' if restoring else 'starting'} search '{experiment.name}': "
            f"{settings.num_samples} trial(s), {settings.scheduler} on {settings.metric} "
            f"({mode}), {concurrent} at a time, each {run.num_workers} worker(s) x "
            f"{cpus_per_worker} CPU{f', {run.gpus:g} GPU' if run.use_gpu else ''} for up to "
            f"{train.epochs} "
            f"epoch(s); {data.train_size} train / {data.test_size} test images from "
            f"{data.source}",
            flush=True,
        )
        print(f"search space: {space.describe()}", flush=True)
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
                    callbacks=[
                        _printer(space.searched, train.epochs, settings.metric, run.progress)
                    ],
                    verbose=0,
                ),
            )
        with PlacementGroupReaper():
            grid = tuner.fit()
        trials = collect_trials(grid, settings.metric, mode, train.epochs, runs_root)
    best = summarize(cmd, experiment, trials, time.perf_counter() - started)
    return best, trials


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
                if _number(row.get("epoch")) is not None:
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


def _number(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def fit_command(cmd: TuneCommand, config: dict) -> str:
    """The ``fit`` command that trains the best trial's configuration again."""
    train = dataclasses.replace(cmd.train, **config)
    return command_line([*invocation("fit"), *flags_of(train, cmd.run, skip=("name", "fresh"))])


def resume_command(cmd: TuneCommand, name: str) -> str:
    """The command that continues this search, as this process was started."""
    args = [a for a in cmd.argv if a != "--fresh"]
    if not cmd.run.name:
        args += ["--name", name]
    return command_line([*invocation("tune"), *args])


def summarize(
    cmd: TuneCommand, experiment: Run, trials: list[dict], wall_s: float
) -> dict[str, Any]:
    metric = cmd.settings.metric
    ranked = [t for t in trials if t[f"best_{metric}"] is not None]
    best = ranked[0] if ranked else None
    best_config = None
    if best is not None:
        best_config = dataclasses.replace(cmd.train, **best["config"]).to_dict()
    return {
        "name": experiment.name,
        "experiment_dir": experiment.dir,
        "metric": metric,
        "mode": cmd.settings.resolved_mode,
        "best_trial": best["trial_id"] if best else None,
        f"best_{metric}": best[f"best_{metric}"] if best else None,
        "best_val_accuracy": best["best_val_accuracy"] if best else None,
        "best_epoch": best["best_epoch"] if best else None,
        "best_config": best_config,
        "best_checkpoint": best["best_checkpoint"] if best else None,
        "fit_command": fit_command(cmd, best["config"]) if best else None,
        "num_trials": len(trials),
        "num_finished": sum(t["status"] == "finished" for t in trials),
        "num_stopped_early": sum(t["stopped_early"] for t in trials),
        "num_errors": sum(t["status"] == "error" for t in trials),
        "num_unfinished": sum(t["status"] == "unfinished" for t in trials),
        "search_space": cmd.space.to_dict(),
        "scheduler": cmd.settings.scheduler,
        "max_epochs": cmd.train.epochs,
        "num_workers": cmd.run.num_workers,
        "wall_time_s": round(wall_s, 2),
        "trials": [{k: v for k, v in t.items() if k != "history"} for t in trials],
    }


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


def print_report(best: dict, trials: list[dict], searched: list[str], metric: str) -> None:
    header = (
        f"\n{'rank':>4}  {'trial':<11}"
        + "".join(f" {n:>12}" for n in searched)
        + f" {'best_acc':>9}"
        + (f" {'best_' + metric:>16}" if metric != "val_accuracy" else "")
        + f" {'epochs':>6}  status"
    )
    print(header)
    for t in trials:
        acc = t["best_val_accuracy"]
        line = (
            f"{t['rank']:>4}  {t['trial_id']:<11}"
            + "".join(f" {_fmt(t['config'].get(n)):>12}" for n in searched)
            + (f" {100 * acc:>8.2f}%" if acc is not None else f" {'-':>9}")
        )
        if metric != "val_accuracy":
            value = t[f"best_{metric}"]
            line += f" {value:>16.4f}" if value is not None else f" {'-':>16}"
        print(f"{line} {t['epochs_run']:>6}  {t['status']}")
    if best["best_trial"] is None:
        print("\nno trial reported a result")
    else:
        print(
            f"\nbest trial {best['best_trial']}: {metric} {best[f'best_{metric}']:.4f} "
            f"at epoch {best['best_epoch']}; {best['num_trials']} trial(s), "
            f"{best['num_stopped_early']} stopped early, {best['wall_time_s']:.0f} s wall"
        )
        print(
            "best config:     "
            + ", ".join(f"{k}={_fmt(v)}" for k, v in best["best_config"].items())
        )
        print(f"best checkpoint: {best['best_checkpoint']}")
        print(f"reproduce with:  {best['fit_command']}")
    print(f"experiment:      {best['experiment_dir']}  ({RESULTS_FILE}, {PLOT_FILE}, {BEST_FILE})")


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def run(cmd: TuneCommand) -> int:
    setup_logging()
    search(cmd)
    return 0


COMMAND = Command("tune", build_parser, parse_command, run)
cli = COMMAND.main


if __name__ == "__main__":
    sys.exit(COMMAND.main())
