"""One training run from the driver: ``fit(cfg) -> FitResult``. Library code: it never prints.

``fit`` loads MNIST once and puts it in the object store, claims the run directory
``<storage-path>/<name>``, connects to (or starts) Ray, then builds and fits a
``TorchTrainer`` and writes ``summary.json`` and ``training_curves.png``. It never touches
a tensor itself. It is a row of named stages over one :class:`_Fit`: *prepare*, *open*,
*connect*, *build*, *monitor*, *summarize*, then *write* while Ray shuts down (:func:`_train`
alone orders the stop, whatever stopped the run). What happens on the way reaches the caller as
:mod:`~raytrain_mnist.driver.events` (the CLI renders them; a notebook passes its own sink
or reads the log), and the outcome as a :class:`FitResult`::

    from raytrain_mnist.driver import fit

    result = fit(FitConfig(TrainConfig(epochs=3), RunSettings.from_flags(num_workers=2)))
    result.status, result.best_checkpoint

Errors a user can cause (bad data, a run of other settings under the name, a cluster that
cannot place the run) raise :class:`~raytrain_mnist.errors.UserError` before training; a
run that fails or is stopped with Ctrl-C returns its result with that status.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from raytrain_mnist.config import (
    DEFAULT_RECIPE,
    RECIPES,
    FitConfig,
    check_data_fits,
    epochs_for,
    flags_of,
)
from raytrain_mnist.driver import cluster, runs
from raytrain_mnist.driver.events import Event, EventSink, Note, Phase, Status, Stopping, log_event
from raytrain_mnist.driver.monitor import (
    RunMonitor,
    Timeline,
    abort_run,
    controller_callbacks,
    start_channel,
)
from raytrain_mnist.driver.relay import INTERRUPTED, on_a_thread, relay
from raytrain_mnist.driver.runs import CURVES_FILE, RUN_FILE, SUMMARY_FILE, Run
from raytrain_mnist.errors import UserError, cause_line
from raytrain_mnist.shell import command_line, python_command

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FitResult:
    """What :func:`fit` did."""

    #: ``finished``, ``interrupted`` or ``failed``.
    status: Status
    #: What ``summary.json`` holds (a run that had already finished: its summary then).
    summary: dict[str, Any] = field(hash=False)
    run_dir: str
    best_checkpoint: str | None
    #: The one-line cause of a failure, else None.
    error: str | None = None
    #: The command that continues the run (interrupted or failed), else None.
    resume_command: str | None = None
    #: The run had finished before this call: nothing was trained.
    already_finished: bool = False
    #: Where the workers' logs are, when the run failed.
    worker_logs: str | None = None


def default_invocation() -> list[str]:
    """How a resume command starts when the caller does not say: ``python -m raytrain_mnist
    fit`` (the interpreter's full path when ``python`` is another one)."""
    return [python_command(), "-m", "raytrain_mnist", "fit"]


def resume_command(cfg: FitConfig, name: str, invocation: Sequence[str] | None = None) -> str:
    """The command that continues run ``name`` of ``cfg`` (never ``--fresh``), started by the
    words ``invocation`` (default: :func:`default_invocation`)."""
    start = default_invocation() if invocation is None else list(invocation)
    recipe = [] if cfg.recipe == DEFAULT_RECIPE else ["--recipe", cfg.recipe]
    flags = flags_of(cfg.train, cfg.run, skip=("fresh", "name"), defaults=RECIPES[cfg.recipe])
    return command_line([*start, *recipe, *flags, "--name", name])


class _Serialized:
    """A sink called by one thread at a time (the caller's and the monitor's both send)."""

    def __init__(self, sink: EventSink) -> None:
        self._sink, self._lock = sink, threading.Lock()

    def __call__(self, event: Event) -> None:
        with self._lock:
            self._sink(event)


def process_started_at() -> float | None:
    """When this process started (unix time, to 10 ms), from ``/proc/self/stat``: a command
    passes it to :func:`fit` as ``started_at``, so the timeline counts Python's start and the
    imports too. None where there is no ``/proc``."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age


def fit(
    cfg: FitConfig,
    on_event: EventSink | None = None,
    *,
    invocation: Sequence[str] | None = None,
    poll_s: float = 0.5,
    started_at: float | None = None,
) -> FitResult:
    """Train as ``cfg`` says, or report the run of that name as it finished before.

    ``on_event`` receives the run's :mod:`~raytrain_mnist.driver.events` (default:
    :func:`~raytrain_mnist.driver.events.log_event`). ``invocation`` is how the resume
    command starts (the CLI passes the words that started it; default
    :func:`default_invocation`). ``poll_s``: how often the driver collects the run's
    progress (a redrawn bar wants it sooner). Ctrl-C while training stops the run's workers
    and returns an ``interrupted`` result; the committed checkpoints stay.

    ``started_at``: when the command started (unix time; the CLI passes
    :func:`process_started_at`): the phases' seconds and ``summary.json``'s ``timeline``
    count from it. Default: this call.
    """
    ctx = _prepare(cfg, _Serialized(on_event or log_event), poll_s, started_at)
    with ctx.run.claim(ctx.cfg.run.storage.fresh):
        ctx.run.held.handled = True  # a lost claim stops the run, with one line (Stopping)
        finished = _open(ctx)
        if finished is not None:
            return finished
        _train(ctx)
        _record(ctx)
    return _result(ctx, invocation)


@dataclass
class _Fit:
    """One fit as its stages hand it on: what it was asked, then what each stage found
    (each field after ``timeline`` is set by the stage its comment names)."""

    cfg: FitConfig  # _prepare sizes its epochs for the data
    emit: EventSink
    poll_s: float
    started: float  # perf_counter at the call: the summary's wall time
    timeline: Timeline
    data: Any = None  # _prepare
    run: Run = field(init=False)  # _prepare
    identity: dict = field(init=False)  # _prepare: what run.json holds
    prior: list[dict] = field(default_factory=list)  # _open: the history a resume continues
    address: str | None = None  # _size
    local: bool = False  # _size: this fit starts its own Ray
    disconnects: bool = False  # _size: this fit connects to a cluster (and so disconnects)
    cpus_per_worker: int = 0  # _size
    tracker: Any = None  # _build: TensorBoard, MLflow
    channel: Any = None  # _build: the progress channel's actor
    trainer: Any = None  # _build
    plotting: _Plotting | None = None  # _build
    monitor: RunMonitor = field(init=False)  # _monitor
    result: Any = None  # _monitor: Ray Train's Result (a run that was not stopped)
    error: BaseException | None = None  # _monitor: the failure; dropped once summarized
    trainer_ended: bool = False  # _monitor: trainer.fit() returned (no thread of it in Ray)
    logs: str | None = None  # _monitor: the worker logs of a failed run
    summary: dict = field(default_factory=dict)  # _summarize
    lost: str | None = None  # _write: why the claim was lost (nothing more is written)

    def phase(self, text: str, key: str | None = None) -> None:
        elapsed = time.time() - self.timeline.t0 if key is None else self.timeline.mark(key)
        self.emit(Phase(text, elapsed))


def _prepare(cfg: FitConfig, emit: EventSink, poll_s: float, started_at: float | None) -> _Fit:
    """Start the timeline, load MNIST (once, on the driver), size the run for it, name it."""
    started, called = time.perf_counter(), time.time()
    timeline = (
        Timeline(started_at, "process start")
        if started_at is not None and started_at <= called
        else Timeline(called, "fit() called")
    )
    timeline.mark("fit_called", called)
    from raytrain_mnist.data import load_mnist

    data = load_mnist(cfg.run.data.data_dir, cfg.run.data.dataset)
    # The epochs are part of the run's name and identity: decided before either.
    cfg = _sized_for_data(cfg, data.train_size)
    check_data_fits(cfg.train, cfg.run, data.train_size)
    ctx = _Fit(cfg, emit, poll_s, started, timeline, data)
    ctx.run = Run(cfg.run.storage.storage_path, runs.default_name(cfg))
    ctx.phase(
        f"data loaded: {data.train_size} train / {data.test_size} test images ({data.kind})",
        "data_loaded",
    )
    ctx.identity = runs.fit_identity(cfg, data)
    return ctx


def _open(ctx: _Fit) -> FitResult | None:
    """Inside the claim (no other command can be writing what this reads): check the
    run's identity, and return the result of a run that had finished; else read where a
    resume continues from."""
    run = ctx.run
    run.check_identity(ctx.identity)
    finished = run.finished()
    if finished is not None:
        logger.debug("run '%s' already finished; see %s/%s", run.name, run.dir, SUMMARY_FILE)
        best = finished.get("best_checkpoint")
        return FitResult("finished", finished, run.dir, best, already_finished=True)
    ctx.prior = _resume_point(run, ctx.cfg)
    return None


def _train(ctx: _Fit) -> None:
    """Connect, build, monitor, summarize; then the files are written while Ray shuts down.
    The one owner of the order in which a fit stops, whatever stopped it (the end, Ctrl-C,
    SIGTERM, a lost claim, a failure): the trainer has ended and the progress is drained
    (:func:`_monitor`); the files are written on a thread of their own (:func:`_write`:
    curves, summary.json, tracking, none of which touches Ray); nothing of this fit holds
    Ray any more (:func:`_let_go_of_ray`) and no thread collects garbage (``gc.disable``);
    then :func:`cluster.connect` shuts down a Ray this fit started (or this fit disconnects
    from the cluster it connected to), and the files are waited for. Nothing touches Ray
    after: what follows (:func:`_record`, the claim's release) is files only."""
    request = _size(ctx)
    collecting = gc.isenabled()
    try:
        # A single run needs no dashboard: without it its own Ray starts seconds sooner.
        with cluster.connect(ctx.address, request, dashboard=False) as started:
            try:
                ctx.phase("Ray ready", "ray_ready")
                _build(ctx)
                _monitor(ctx)
                _summarize(ctx)
                files = on_a_thread(lambda: _write(ctx), name="files")
            finally:
                _let_go_of_ray(ctx)
                # No thread collects while Ray shuts down: none frees a Ray object then.
                gc.disable()
            leaves = ctx.disconnects and ctx.trainer_ended
            if leaves:
                import ray

                ray.shutdown()  # the cluster lives on; this driver's part in it ends here
    finally:
        if collecting:
            gc.enable()
    shut_down = time.time()
    files()
    if started or leaves:
        ctx.timeline.mark("ray_shut_down", shut_down)
    ctx.timeline.mark("files_written")


def _size(ctx: _Fit) -> cluster.Request:
    """Where the run trains and what it asks of the cluster."""
    import ray

    ctx.address = cluster.resolve_address(ctx.cfg.run.address)
    ctx.local = ctx.address is None and not ray.is_initialized()
    ctx.disconnects = ctx.address is not None and not ray.is_initialized()
    scaling = ctx.cfg.run.scaling
    # Sized for the most workers the run may have; placed once the fewest fit.
    ctx.cpus_per_worker = scaling.cpus_per_worker or cluster.default_cpus_per_worker(
        scaling.max_workers, ctx.local
    )
    ctx.phase(
        "starting a local Ray"
        if ctx.local
        else f"connecting to Ray at {ctx.address}"
        if ctx.address
        else "using the connected Ray",
        "ray_starting",
    )
    return cluster.Request.for_run(ctx.cfg.run, ctx.cpus_per_worker)


def _build(ctx: _Fit) -> None:
    """Say what starts, write run.json, open tracking and the progress channel, and build
    the trainer (the data goes into the object store once, for every worker)."""
    import ray

    cfg, data, run = ctx.cfg, ctx.data, ctx.run
    full_epochs = RECIPES[cfg.recipe]["epochs"]
    sized = (
        f"; {cfg.train.epochs} epochs, as many steps as "
        f"{full_epochs} on full MNIST (--epochs sets them)"
        if cfg.auto_epochs and cfg.train.epochs != full_epochs
        else ""
    )
    ctx.emit(
        Note(
            f"{'resuming' if ctx.prior else 'starting'} run '{run.name}': "
            f"{_workers_text(cfg)} x {ctx.cpus_per_worker} CPU{_gpu_text(cfg)}, "
            f"{data.train_size} train / {data.test_size} test images from {data.source}{sized}"
        )
    )
    run.write_json(RUN_FILE, ctx.identity)
    from raytrain_mnist.driver.tracking import EpochLog
    from raytrain_mnist.driver.trainer import build_trainer
    from raytrain_mnist.worker.loop import train_func_per_worker

    ctx.tracker = EpochLog(run.dir, cfg)  # a bad --mlflow-uri fails here, before training
    ctx.channel = start_channel()
    ctx.plotting = _Plotting()
    # --progress off: no stream from rank 0 at all (the epochs still arrive).
    loop_config = {
        "train": cfg.train.to_dict(),
        "data": ray.put(data),
        "cpus_per_worker": ctx.cpus_per_worker,
        "progress": None if cfg.run.output.progress == "off" else ctx.channel,
        "compile": cfg.run.torch.compile,
        "cuda_graphs": cfg.run.torch.cuda_graphs,
    }
    ctx.trainer = build_trainer(
        cfg.run,
        train_func_per_worker,
        loop_config,
        ctx.cpus_per_worker,
        run.storage,
        run.name,
        callbacks=controller_callbacks(ctx.channel),
        own_ray=ctx.local,
    )


def _monitor(ctx: _Fit) -> None:
    """Fit on a helper thread (:func:`relay`: Ctrl-C reaches this one) while the monitor
    drains the progress, until the run ends, fails, or is stopped: by Ctrl-C (SIGTERM is
    one) or by the claim being lost. Returns once ``trainer.fit()`` has returned and the
    monitor's thread has ended, with what is left in the channel drained."""
    import ray

    held = ctx.run.held

    def on_epoch(metrics: dict) -> None:
        ctx.tracker.log(metrics)
        ctx.plotting.start()  # matplotlib is imported while the run trains, not at its end

    ctx.phase("workers starting", "trainer_started")
    ctx.monitor = RunMonitor(
        ctx.channel,
        ctx.cfg.train.epochs,
        ctx.prior,
        ctx.emit,
        ctx.timeline,
        on_epoch=on_epoch,
        poll_s=ctx.poll_s,
    )
    with ctx.monitor:
        try:
            outcome = relay(
                ctx.trainer.fit,
                lambda reason, running: _stop(ctx, reason, running),
                name="trainer.fit",
                watch=lambda: held.reason if held is not None and held.lost.is_set() else None,
                stop_wait_s=_STOP_WAIT_S,
            )
            ctx.result = outcome.value if outcome.stopped is None else None
            ctx.trainer_ended = outcome.finished
            if not outcome.finished:
                logger.warning(
                    "trainer.fit() had not returned %.0f s after the run was stopped",
                    _STOP_WAIT_S,
                )
        except ray.train.TrainingFailedError as exc:
            ctx.trainer_ended = True
            ctx.error, ctx.logs = exc, cluster.worker_logs_dir()
            logger.debug("training failed: %s (worker logs: %s)", cause_line(exc), ctx.logs)
        finally:
            ctx.timeline.mark("fit_returned")


#: How long a stopped run's ``trainer.fit()`` may take to return once its controller was
#: aborted (it returns within seconds; a loaded machine takes longer).
_STOP_WAIT_S = 120.0


def _stop(ctx: _Fit, reason: str, running: Callable[[], bool]) -> None:
    """Stop the run as Ray's own SIGINT handler would: abort its controller. Its workers
    stop, the committed checkpoints stay, a Ray that is not ours lives on."""
    if reason == INTERRUPTED:
        ctx.emit(Stopping())
    else:  # the claim was lost
        ctx.emit(Stopping(f"{reason}: stopping the workers; the last committed checkpoint is kept"))
    abort_run(ctx.channel, running)


def _summarize(ctx: _Fit) -> None:
    """The summary, from the result (or the last epoch the monitor saw, or Ray's record)."""
    metrics = (
        ctx.result.metrics
        if ctx.result is not None
        else (ctx.monitor.seen[-1] if ctx.monitor.seen else ctx.run.latest_metrics())
    )
    ctx.summary = _summary(ctx, metrics, time.perf_counter() - ctx.started)
    ctx.error = None  # its traceback holds the trainer's frames: Ray's objects
    ctx.timeline.mark("summary_built")


def _write(ctx: _Fit) -> None:
    """Still claimed: draw the curves, close tracking, write summary.json and the curves (a
    second command never sees a half-written or stale summary). A claim lost meanwhile:
    another command may hold the run, nothing more is written into it. Runs on a thread of
    its own while Ray shuts down (:func:`_train`): it touches nothing of Ray, and marks no
    moment."""
    run, summary = ctx.run, ctx.summary
    held = run.held
    ctx.lost = held.reason if held is not None and held.lost.is_set() else None
    title = f"{run.name}: {ctx.cfg.run.scaling.num_workers} worker(s), {ctx.data.kind}"
    png = ctx.plotting.draw(summary["history"], title) if summary["history"] else None
    summary["timeline"] = ctx.timeline.to_dict(ctx.monitor.clock)
    if ctx.lost is not None:
        summary["error"] = ctx.lost
    else:
        run.write_json(SUMMARY_FILE, summary)
        if png is not None:
            run.write_bytes(CURVES_FILE, png)
    ctx.tracker.close(summary)


def _let_go_of_ray(ctx: _Fit) -> None:
    """The last step before Ray shuts down: drop every handle and reference into Ray this
    fit holds, and collect the cycles that hold more, here, while Ray is up. Garbage that
    holds an object reference or an actor handle (an exception from the trainer's thread
    holds its frames: the controller's handle, the data's reference) would otherwise be
    freed by whichever thread next collects, and one that does so while ``ray.shutdown()``
    runs makes Ray's core worker end the process (exit 1)."""
    ctx.trainer = ctx.channel = ctx.result = ctx.error = None
    if ctx.plotting is not None:
        ctx.plotting.join()
    gc.collect()


def _record(ctx: _Fit) -> None:
    """After Ray (files only): summary.json again, with the teardown's last moments."""
    ctx.summary["timeline"] = ctx.timeline.to_dict(ctx.monitor.clock)
    if ctx.lost is None:
        ctx.run.write_json(SUMMARY_FILE, ctx.summary)


def _result(ctx: _Fit, invocation: Sequence[str] | None) -> FitResult:
    summary = ctx.summary
    status = summary["status"]
    return FitResult(
        status,
        summary,
        summary["run_dir"],
        summary["best_checkpoint"],
        error=summary["error"],
        resume_command=(
            None if status == "finished" else resume_command(ctx.cfg, ctx.run.name, invocation)
        ),
        worker_logs=ctx.logs,
    )


class _Plotting:
    """The training curves' PNG. matplotlib's import (a second or more) runs on a thread
    from the first committed epoch, while the run trains; the curves are drawn once the run
    has ended, on the files' thread, while Ray shuts down (:func:`_write`)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=_import_plots, name="plots", daemon=True)
            self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def draw(self, history: list[dict], title: str) -> bytes:
        self.join()
        from raytrain_mnist.driver.plots import training_curves_png

        return training_curves_png(history, title)


def _import_plots() -> None:
    try:
        from raytrain_mnist.driver import plots

        plots.warm_up()
    except Exception:  # drawing raises it again, where the PNG is asked for
        logger.debug("importing matplotlib failed", exc_info=True)


def _resume_point(run: Run, cfg: FitConfig) -> list[dict]:
    """The history a resume continues from ([] for a new run). Checks, on the driver and
    before any worker starts, that the latest committed checkpoint can resume this run."""
    latest = run.latest_checkpoint()
    if latest is None:
        return []
    from raytrain_mnist.nn.checkpoint import CheckpointError, resumable_state

    with run.local_copy(latest) as directory:
        try:
            return list(resumable_state(directory, cfg.train.to_dict())["history"])
        except CheckpointError as exc:
            raise UserError(
                f"cannot resume run '{run.name}': {exc}; move {run.dir} away, "
                "pick another --name, or add --fresh"
            ) from exc


def _sized_for_data(cfg: FitConfig, train_size: int) -> FitConfig:
    """Without --epochs, a run on a smaller set (the sample) trains about as many steps as
    the default does on full MNIST: the defaults are sized for 60,000 images."""
    if not cfg.auto_epochs:
        return cfg
    epochs = epochs_for(cfg.train, train_size)
    if epochs == cfg.train.epochs:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, epochs=epochs))


def _workers_text(cfg: FitConfig) -> str:
    r = cfg.run.scaling
    if not r.elastic:
        return f"{r.num_workers} worker(s)"
    return (
        f"{r.num_workers} worker(s) (elastic: starts once {r.min_workers} fit, checks "
        f"for room every {r.resize_check_s:g} s)"
    )


def _gpu_text(cfg: FitConfig) -> str:
    run = cfg.run
    if not run.scaling.use_gpu:
        return ""
    step = "each step one CUDA graph" if cfg.captures_step else "eager steps"
    return f", {run.scaling.gpus:g} GPU, {run.backend_description}, {step}"


def _summary(ctx: _Fit, metrics: dict, wall_s: float) -> dict:
    """What summary.json holds."""
    cfg, run, data, monitor, error = ctx.cfg, ctx.run, ctx.data, ctx.monitor, ctx.error
    history = monitor.history
    epochs_completed = history[-1]["epoch"] if history else 0
    if error is not None:
        status = "failed"
    elif epochs_completed >= cfg.train.epochs:
        status = "finished"
    else:
        status = "interrupted"
    first = monitor.seen[0] if monitor.seen else metrics
    summary = {
        "name": run.name,
        "run_dir": run.dir,
        "status": status,
        "data_source": data.source,
        "dataset": data.kind,
        "train_size": data.train_size,
        "test_size": data.test_size,
        "num_workers": cfg.run.scaling.num_workers,
        "elastic": cfg.run.scaling.elastic,
        "cpus_per_worker": ctx.cpus_per_worker,
        "use_gpu": cfg.run.scaling.use_gpu,
        "epochs_completed": epochs_completed,
        "resumed_from_epoch": first.get("resumed_from_epoch"),
        "worker_restarts": monitor.restarts,
        "resizes": monitor.resizes,
        "preemptions": monitor.preemptions.entries,
        "worker_started_at": first.get("started_at"),  # unix time the training loop began
        "val_accuracy": metrics.get("val_accuracy"),
        "val_loss": metrics.get("val_loss"),
        "val_total": metrics.get("val_total"),
        "best_val_accuracy": max((h["val_accuracy"] for h in history), default=None),
        "wall_time_s": round(wall_s, 2),
        # Ray's own record of what it committed and kept: the one answer to "which is best".
        "best_checkpoint": run.best_checkpoint(),
        "latest_checkpoint": run.latest_checkpoint(),
        "workers": metrics.get("workers", []),
        "config": {"train": cfg.train.to_dict(), "run": cfg.run.to_dict()},
        "history": history,
        "error": None if error is None else cause_line(error),
    }
    return json.loads(json.dumps(summary))  # as summary.json reads back: a range is a list
