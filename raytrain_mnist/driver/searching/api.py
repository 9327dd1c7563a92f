""":func:`search`, in named stages that share one :class:`_Search`: prepare (settings, data,
the trials drawn), open (the experiment's records), size, connect, build (the Tune run),
monitor (until it ends or Ctrl-C stops it) and summarize (the result and its files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytrain_mnist.config import RunSettings, TrainConfig
from raytrain_mnist.driver import cluster
from raytrain_mnist.driver.events import EventSink, Note, SearchStarting, log_event
from raytrain_mnist.driver.fitting import default_invocation
from raytrain_mnist.driver.runs import (
    BEST_FILE,
    DATA_DIR_KEY,
    RUNS_DIR,
    SEARCH_FILE,
    Run,
    data_identity,
)
from raytrain_mnist.driver.searching import on_service
from raytrain_mnist.driver.searching.plan import (
    PLAN_FILE,
    TRIAL_CPU,
    Plan,
    check_experiment,
    concurrency,
    draw_trials,
    plan_record,
    trials_the_cluster_holds,
)
from raytrain_mnist.driver.searching.records import read_ended_trials
from raytrain_mnist.driver.searching.result import (
    FAILED,
    FINISHED,
    INTERRUPTED,
    PLOT_FILE,
    RESULTS_FILE,
    SearchResult,
    collect_trials,
    fit_command,
    results_csv,
)
from raytrain_mnist.driver.searching.run import (
    Session,
    TrialSetup,
    TuneRun,
    run_trials,
    scheduler,
    trainable,
)
from raytrain_mnist.driver.searching.space import (
    SearchSpace,
    TuneSettings,
    check_search,
    experiment_identity,
    experiment_name,
)
from raytrain_mnist.driver.trainer import forwarded_env
from raytrain_mnist.errors import EXIT_USAGE, UserError


def search(  # noqa: PLR0913 -- the library's call: a search's four parts and its options
    space: SearchSpace,
    settings: TuneSettings,
    train: TrainConfig,
    run: RunSettings,
    *,
    on_event: EventSink | None = None,
    fit_invocation: Sequence[str] | None = None,
    auto_workers: bool = False,
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

    With ``run.scaling.service`` (``--service``) every trial is a request to that warm
    service (:mod:`.on_service`): the same search, trained by the service's workers, with
    its data; ``auto_workers``: ``run`` did not choose a worker count, take the service's.
    """
    words = default_invocation() if fit_invocation is None else fit_invocation
    ctx = _Search(space, settings, train, run, on_event or log_event, list(words))
    with _on_service(ctx, auto_workers):
        _prepare(ctx)
        with ctx.experiment.claim(run.storage.fresh, "search"):  # one search per directory
            ctx.experiment.held.handled = True  # a lost claim stops the search, with one line
            _open(ctx)
            _size(ctx)
            if ctx.pending:
                with _connect(ctx):
                    _monitor(ctx, _build(ctx))
            else:  # nothing to run: no Ray is started
                _announce(ctx, min(ctx.concurrent, settings.num_samples))
            return _summarize(ctx)


@dataclass
class _Search:
    """One search as its stages hand it on: what it was asked, then what each stage found
    (each field after ``started`` is set by the stage its comment names)."""

    space: SearchSpace
    settings: TuneSettings
    train: TrainConfig  # the values of every field that is not searched; epochs per trial
    run: RunSettings
    sink: EventSink
    fit_words: list[str]
    started: float = field(default_factory=time.perf_counter)
    experiment: Run = field(init=False)  # _prepare
    data: Any = field(init=False)  # _prepare: the MNIST every trial trains on
    identity: dict = field(init=False)  # _prepare: what search.json holds
    plan: Plan = field(init=False)  # _prepare
    resuming: bool = field(init=False)  # _open
    session: Session = field(init=False)  # _open
    pending: list[str] = field(init=False)  # _open: the trials that had not ended, in order
    address: str | None = field(init=False)  # _size
    local: bool = field(init=False)  # _size: this search starts its own Ray
    concurrent: int = field(init=False)  # _size, then _connect: trials at once
    cpus_per_worker: int = field(init=False)  # _size
    client: Any = None  # _on_service: the service every trial is a request to, if any
    requests: Any = None  # _connect, on a service: the SearchRequests of its trials


@contextlib.contextmanager
def _on_service(ctx: _Search, auto_workers: bool) -> Iterator[None]:
    """With ``--service``: connect to the service's Ray for the whole search (its data
    names the search) and fit the run settings to the service, as ``fit --service`` does."""
    service = ctx.run.scaling.service
    if service is None:
        yield
        return
    import ray

    from raytrain_mnist.driver.service import ServiceClient

    ctx.address = ServiceClient.address_of(service, ctx.run.address)
    ours = not ray.is_initialized()  # a notebook's Ray stays connected
    try:
        with cluster.connect(ctx.address, cluster.Request(0, 1, False), dashboard=False):
            ctx.client = ServiceClient(service)
            ctx.run = on_service.fitted_run(ctx.client, ctx.train, ctx.run, auto_workers)
            yield
    finally:
        if ours and ray.is_initialized():
            ray.shutdown()


def _prepare(ctx: _Search) -> None:
    """Check the settings, load MNIST (once, on the driver) and draw the trials."""
    space, settings, train, run = ctx.space, ctx.settings, ctx.train, ctx.run
    check_search(space, settings, train, run)
    settings_identity = experiment_identity(space, settings, train, run)
    name = experiment_name(settings_identity, run)
    ctx.experiment = Run(run.storage.storage_path, name, record=SEARCH_FILE)
    if ctx.client is not None:  # the service's data: the same identity as loaded here
        ctx.data = ctx.client.data
        data = ctx.data.identity
    else:
        from raytrain_mnist.data import load_mnist

        ctx.data = load_mnist(run.data.data_dir, run.data.dataset)
        data = data_identity(ctx.data)
    space.check_data(train, run, ctx.data.train_size)  # every trial it can draw must train
    ctx.identity = {**settings_identity, "data": data}
    ctx.plan = draw_trials(space, settings, ctx.identity)


def _open(ctx: _Search) -> None:
    """Check what the experiment holds, record the search, and read the trials that ended."""
    experiment = ctx.experiment
    ctx.resuming = check_experiment(experiment, ctx.identity, ctx.plan, ctx.settings.resume)
    # Where the trials' data came from (a service's own), for evaluate and serve of them.
    data_dir = ctx.run.data.data_dir
    where = None if data_dir is None else str(Path(data_dir).expanduser().resolve())
    experiment.write_json(SEARCH_FILE, {**ctx.identity, DATA_DIR_KEY: where})
    experiment.write_json(PLAN_FILE, plan_record(ctx.plan))
    ended = read_ended_trials(experiment, ctx.plan, ctx.train, ctx.settings.metric)
    ctx.session = Session(
        sink=ctx.sink,
        plan=dict(ctx.plan),
        searched=ctx.space.searched,
        train=ctx.train,
        metric=ctx.settings.metric,
        runs_root=f"{experiment.dir}/{RUNS_DIR}",
        ended=ended,
        claim=experiment.held,
    )
    ctx.pending = [name for name in ctx.session.plan if name not in ended]


def _size(ctx: _Search) -> None:
    """Where the trials run, how many at once and with how many CPUs per worker."""
    if ctx.client is not None:
        info = ctx.client.info
        ctx.local, ctx.cpus_per_worker = False, info["cpus_per_worker"]
        wanted = ctx.settings.max_concurrent_trials
        ctx.concurrent = on_service.concurrency(
            info, wanted, len(ctx.pending) or ctx.settings.num_samples
        )
        return
    ctx.address = cluster.resolve_address(ctx.run.address)
    import ray

    ctx.local = ctx.address is None and not ray.is_initialized()
    ctx.concurrent, ctx.cpus_per_worker = concurrency(ctx.settings, ctx.run, ctx.local)


@contextlib.contextmanager
def _connect(ctx: _Search) -> Iterator[None]:
    """Connect to the cluster (or start a local Ray sized for the trials at once), check
    that it holds the trials asked to run at once, and say that the search starts."""
    if ctx.client is not None:  # connected to the service's Ray since _on_service
        # Whatever ends the Tune run, no request of its trials trains on after it.
        with on_service.requests_of_the_search(ctx.client) as ctx.requests:
            _announce(ctx, ctx.concurrent)
            yield
        return
    scaling = ctx.run.scaling
    sized_for = ctx.concurrent if ctx.local else 1
    request = dataclasses.replace(
        cluster.Request.for_run(ctx.run, ctx.cpus_per_worker),
        num_workers=scaling.num_workers * sized_for,
        extra_cpus=sized_for * TRIAL_CPU,
    )
    with cluster.connect(ctx.address, request):
        holds = trials_the_cluster_holds(ctx.run, ctx.cpus_per_worker)
        wanted = ctx.settings.max_concurrent_trials
        if wanted and wanted > holds:
            raise UserError(
                f"--max-concurrent-trials {wanted}: the cluster holds {holds} trial(s) of "
                f"{scaling.num_workers} worker(s) x {ctx.cpus_per_worker} CPU at once; "
                "lower it, or --num-workers / --cpus-per-worker",
                EXIT_USAGE,
            )
        ctx.concurrent = max(1, min(ctx.concurrent, holds, len(ctx.pending)))
        _announce(ctx, ctx.concurrent)
        yield


def _announce(ctx: _Search, concurrent: int) -> None:
    """The search's first events: it starts (or resumes), its space, what ended before."""
    settings, scaling, data = ctx.settings, ctx.run.scaling, ctx.data
    ctx.sink(
        SearchStarting(
            name=ctx.experiment.name,
            resuming=ctx.resuming,
            num_samples=settings.num_samples,
            scheduler=settings.scheduler,
            metric=settings.metric,
            mode=settings.resolved_mode,
            concurrent=concurrent,
            num_workers=scaling.num_workers,
            cpus_per_worker=ctx.cpus_per_worker,
            gpus_per_worker=scaling.gpus,
            max_epochs=ctx.train.epochs,
            train_size=data.train_size,
            test_size=data.test_size,
            data_source=data.source,
        )
    )
    ctx.sink(Note(f"search space: {ctx.space.describe()}"))
    before = len(ctx.session.ended)
    if before or not ctx.pending:
        ctx.sink(
            Note(
                f"{before} of {settings.num_samples} trial(s) ended before; "
                + ("they are not trained again" if ctx.pending else "nothing to train")
            )
        )


def _build(ctx: _Search) -> TuneRun:
    """The Tune run of the pending trials, MNIST put in the object store once for all
    (on a service: the service's requests, its data)."""
    return TuneRun(
        trainable=_trainable(ctx),
        name=ctx.experiment.name,
        storage=ctx.experiment.storage,
        pending=ctx.pending,
        scheduler=scheduler(ctx.settings, ctx.train.epochs, ctx.session.ended.values()),
        concurrent=ctx.concurrent,
        reuse_actors=ctx.client is not None,  # a service's trials reset between trials
    )


def _trainable(ctx: _Search) -> Any:
    import ray

    if ctx.client is not None:
        return on_service.service_trainable(
            on_service.ServiceTrialSetup(
                service=ctx.client.name,
                train=ctx.train.to_dict(),
                run=on_service.without_progress(ctx.run),
                runs_root=ctx.session.runs_root,
                plan=ctx.session.plan,
                requests=ctx.requests,
            ),
            on_service.trial_resources(ray.available_resources().get("CPU", 0), ctx.concurrent),
        )
    setup = TrialSetup(
        train=ctx.train.to_dict(),
        run=ctx.run,
        cpus_per_worker=ctx.cpus_per_worker,
        runs_root=ctx.session.runs_root,
        plan=ctx.session.plan,
        forwarded=forwarded_env(),
    )
    return trainable(setup, ray.put(ctx.data))


def _monitor(ctx: _Search, tune_run: TuneRun) -> None:
    """Run the trials until they end, or Ctrl-C (or a lost claim) stops them."""
    run_trials(tune_run, ctx.session)


def _summarize(ctx: _Search) -> SearchResult:
    """The trials ranked and the result; its files, while the experiment is still ours."""
    trials = collect_trials(ctx.plan, ctx.session, ctx.settings.resolved_mode)
    result = _result(ctx, trials)
    held = ctx.experiment.held
    if held.lost.is_set():
        # Another command may hold the experiment now: nothing more is written into it.
        ctx.sink(Note(f"{held.reason}: the search stopped; its trials' checkpoints stay"))
        return result
    # Still claimed: a second command never reads a half-written result.
    _write(ctx, result)
    return result


def _result(ctx: _Search, trials: list[dict]) -> SearchResult:
    settings, train, run = ctx.settings, ctx.train, ctx.run
    metric = settings.metric
    ranked = [t for t in trials if t[f"best_{metric}"] is not None]
    best = ranked[0] if ranked else None
    num_errors = sum(t["status"] == "error" for t in trials)
    num_unfinished = sum(t["status"] == "unfinished" for t in trials)
    return SearchResult(
        status=INTERRUPTED if num_unfinished else FAILED if num_errors else FINISHED,
        name=ctx.experiment.name,
        experiment_dir=ctx.experiment.dir,
        metric=metric,
        mode=settings.resolved_mode,
        best_trial=best["trial_id"] if best else None,
        best_metric=best[f"best_{metric}"] if best else None,
        best_val_accuracy=best["best_val_accuracy"] if best else None,
        best_epoch=best["best_epoch"] if best else None,
        best_config=dataclasses.replace(train, **best["config"]).to_dict() if best else None,
        best_checkpoint=best["best_checkpoint"] if best else None,
        fit_command=fit_command(ctx.fit_words, train, run, best["config"]) if best else None,
        num_trials=len(trials),
        num_finished=sum(t["status"] == "finished" for t in trials),
        num_stopped_early=sum(t["stopped_early"] for t in trials),
        num_errors=num_errors,
        num_unfinished=num_unfinished,
        search_space=ctx.space.to_dict(),
        scheduler=settings.scheduler,
        max_epochs=train.epochs,
        num_workers=run.scaling.num_workers,
        wall_time_s=round(time.perf_counter() - ctx.started, 2),
        trials=trials,
    )


def _write(ctx: _Search, result: SearchResult) -> None:
    """``results.csv``, ``val_accuracy.png`` and ``best.json`` (last: it says the result)."""
    from raytrain_mnist.driver.searching.plots import trials_png

    experiment, trials = ctx.experiment, result.trials
    csv = results_csv(trials, ctx.space.searched, ctx.settings.metric)
    experiment.write_bytes(RESULTS_FILE, csv)
    title = (
        f"{experiment.name}: validation accuracy per trial ({ctx.run.scaling.num_workers} "
        f"worker(s), {ctx.data.kind})"
    )
    experiment.write_bytes(PLOT_FILE, trials_png(trials, title))
    experiment.write_json(BEST_FILE, result.to_dict())
