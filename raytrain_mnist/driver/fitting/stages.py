"""What every ``fit`` does, on its own trainer or on a warm service: the stages that
name, claim, open, summarize and write a run (:class:`Fit` carries what each found), and
what a fit returns (:class:`FitResult`)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from raytrain_mnist.config import (
    DEFAULT_RECIPE,
    RECIPES,
    FitConfig,
    check_data_fits,
    epochs_for,
    flags_of,
)
from raytrain_mnist.driver import runs
from raytrain_mnist.driver.events import Event, EventSink, Note, Phase, Status, Stopping
from raytrain_mnist.driver.monitor import (
    RunMonitor,
    Timeline,
)
from raytrain_mnist.driver.runs import CURVES_FILE, SUMMARY_FILE, Run
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


class Serialized:
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


@dataclass
class Fit:
    """One fit as its stages hand it on: what it was asked, then what each stage found
    (each field after ``timeline`` is set by the stage its comment names)."""

    cfg: FitConfig  # prepare sizes its epochs for the data
    emit: EventSink
    poll_s: float
    started: float  # perf_counter at the call: the summary's wall time
    timeline: Timeline
    data: Any = None  # prepare
    run: Run = field(init=False)  # prepare
    identity: dict = field(init=False)  # prepare: what run.json holds
    prior: list[dict] = field(default_factory=list)  # open_run: the history a resume continues
    address: str | None = None  # _size
    local: bool = False  # _size: this fit starts its own Ray
    disconnects: bool = False  # _size: this fit connects to a cluster (and so disconnects)
    cpus_per_worker: int = 0  # _size
    tracker: Any = None  # _build: TensorBoard, MLflow
    channel: Any = None  # _build: the progress channel's actor
    trainer: Any = None  # _build
    plotting: Plotting | None = None  # _build
    monitor: RunMonitor = field(init=False)  # _monitor
    result: Any = None  # _monitor: Ray Train's Result (a run that was not stopped)
    error: BaseException | None = None  # _monitor: the failure; dropped once summarized
    trainer_ended: bool = False  # _monitor: trainer.fit() returned (no thread of it in Ray)
    logs: str | None = None  # _monitor: the worker logs of a failed run
    summary: dict = field(default_factory=dict)  # summarize
    lost: str | None = None  # write_files: why the claim was lost (nothing more is written)

    def phase(self, text: str, key: str | None = None) -> None:
        elapsed = time.time() - self.timeline.t0 if key is None else self.timeline.mark(key)
        self.emit(Phase(text, elapsed))

    def claim_lost(self) -> str | None:
        """Why this fit's claim was taken from it, else None (it goes on)."""
        held = self.run.held
        return held.reason if held is not None and held.lost.is_set() else None

    def on_epoch(self, metrics: dict) -> None:
        """A committed epoch: to tracking; matplotlib is imported while the run trains."""
        self.tracker.log(metrics)
        self.plotting.start()

    def announce(self, on: str = "") -> None:
        """The start line: the run, where it trains (``on``: " on service 'S'"), its workers
        and data, and how a run on the sample was sized."""
        cfg, data = self.cfg, self.data
        full_epochs = RECIPES[cfg.recipe]["epochs"]
        sized = (
            f"; {cfg.train.epochs} epochs, as many steps as "
            f"{full_epochs} on full MNIST (--epochs sets them)"
            if cfg.auto_epochs and cfg.train.epochs != full_epochs
            else ""
        )
        self.emit(
            Note(
                f"{'resuming' if self.prior else 'starting'} run '{self.run.name}'{on}: "
                f"{workers_text(cfg)} x {self.cpus_per_worker} CPU{gpu_text(cfg)}, "
                f"{data.train_size} train / {data.test_size} test images from "
                f"{data.source}{sized}"
            )
        )


class Backend(Protocol):
    """What trains a fit, between the stages both share (``fit``'s one sequence): a
    TorchTrainer of the run's own (:class:`~.on_trainer.TrainerBackend`) or a warm service
    (:class:`~.on_service.ServiceBackend`)."""

    client: Any  # the service client whose data the run trains on; None: the run loads its own

    def reached(
        self, cfg: FitConfig, emit: EventSink, started_at: float | None
    ) -> contextlib.AbstractContextManager[FitConfig]:
        """Around the whole fit: ``cfg`` as this backend trains it."""

    def ready(self, ctx: Fit) -> None:
        """Once the run is prepared, before it is claimed."""

    def train(self, ctx: Fit) -> None:
        """Inside the claim: train, follow, summarize, let go of Ray and write the files."""


def start_timeline(started_at: float | None) -> tuple[float, Timeline]:
    """The call's perf_counter and the timeline, from the command's start when known."""
    started, called = time.perf_counter(), time.time()
    timeline = (
        Timeline(started_at, "process start")
        if started_at is not None and started_at <= called
        else Timeline(called, "fit() called")
    )
    timeline.mark("fit_called", called)
    return started, timeline


def prepare(
    cfg: FitConfig,
    emit: EventSink,
    poll_s: float,
    started_at: float | None,
    service=None,
) -> Fit:
    """Start the timeline, load MNIST (once, on the driver; or take what a ``service``
    holds), size the run for it, name it."""
    started, timeline = start_timeline(started_at)
    if service is None:
        from raytrain_mnist.data import load_mnist

        data = load_mnist(cfg.run.data.data_dir, cfg.run.data.dataset)
    else:
        data = service.data
    # The epochs are part of the run's name and identity: decided before either.
    cfg = sized_for_data(cfg, data.train_size)
    check_data_fits(cfg.train, cfg.run, data.train_size)
    ctx = Fit(cfg, emit, poll_s, started, timeline, data)
    ctx.run = Run(cfg.run.storage.storage_path, runs.default_name(cfg))
    ctx.phase(
        f"data loaded: {data.train_size} train / {data.test_size} test images ({data.kind})",
        "data_loaded",
    )
    ctx.identity = runs.fit_identity(cfg, data, getattr(data, "identity", None))
    return ctx


def open_run(ctx: Fit) -> FitResult | None:
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
    ctx.prior = resume_point(run, ctx.cfg)
    return None


def summarize(ctx: Fit) -> None:
    """The summary, from the result (or the last epoch the monitor saw, or Ray's record)."""
    metrics = (
        ctx.result.metrics
        if ctx.result is not None
        else (ctx.monitor.seen[-1] if ctx.monitor.seen else ctx.run.latest_metrics())
    )
    ctx.summary = summary_of(ctx, metrics, time.perf_counter() - ctx.started)
    ctx.error = None  # its traceback holds the trainer's frames: Ray's objects
    ctx.timeline.mark("summary_built")


def follow(
    ctx: Fit,
    channel: Any,
    call: Callable[[], Any],
    stop: Callable[[str, Callable[[], bool]], object],
    *,
    name: str,
    **relay_options: Any,
) -> Any:
    """The run's middle, whichever backend trains it: ``call()`` (``trainer.fit``, or the
    request followed to its end) on a thread while the monitor drains ``channel`` (the run's
    progress and committed epochs), until it ends or is stopped by Ctrl-C (SIGTERM is one)
    or a lost claim: then ``stop(reason, running)`` (:func:`~raytrain_mnist.driver.relay.relay`).
    Returns the relay's outcome once the monitor has drained what is left."""
    from raytrain_mnist.driver.relay import relay

    ctx.monitor = RunMonitor(
        channel,
        ctx.cfg.train.epochs,
        ctx.prior,
        ctx.emit,
        ctx.timeline,
        on_epoch=ctx.on_epoch,
        poll_s=ctx.poll_s,
    )
    with ctx.monitor:
        try:
            return relay(call, stop, name=name, watch=ctx.claim_lost, **relay_options)
        finally:
            ctx.timeline.mark("fit_returned")


def stopping(ctx: Fit, reason: str, doing: str) -> None:
    """Say why the run stops and what stops it (``doing``: "stopping the workers")."""
    from raytrain_mnist.driver.relay import INTERRUPTED

    why = "Ctrl-C" if reason == INTERRUPTED else reason  # the CLI says SIGTERM for its own
    ctx.emit(Stopping(f"{why}: {doing}; the last committed checkpoint is kept"))


def write_files(ctx: Fit) -> None:
    """Still claimed: draw the curves, close tracking, write summary.json and the curves (a
    second command never sees a half-written or stale summary). A claim lost meanwhile:
    another command may hold the run, nothing more is written into it. Runs on a thread of
    its own while Ray shuts down (:func:`train`): it touches nothing of Ray, and marks no
    moment."""
    run, summary = ctx.run, ctx.summary
    ctx.lost = ctx.claim_lost()
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


def record_end(ctx: Fit) -> None:
    """After Ray (files only): summary.json again, with the teardown's last moments."""
    ctx.summary["timeline"] = ctx.timeline.to_dict(ctx.monitor.clock)
    if ctx.lost is None:
        ctx.run.write_json(SUMMARY_FILE, ctx.summary)


def result_of(ctx: Fit, invocation: Sequence[str] | None) -> FitResult:
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


class Plotting:
    """The training curves' PNG. matplotlib's import (a second or more) runs on a thread
    from the first committed epoch, while the run trains; the curves are drawn once the run
    has ended, on the files' thread, while Ray shuts down (:func:`write_files`)."""

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


def resume_point(run: Run, cfg: FitConfig) -> list[dict]:
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


def sized_for_data(cfg: FitConfig, train_size: int) -> FitConfig:
    """Without --epochs, a run on a smaller set (the sample) trains about as many steps as
    the default does on full MNIST: the defaults are sized for 60,000 images."""
    if not cfg.auto_epochs:
        return cfg
    epochs = epochs_for(cfg.train, train_size)
    if epochs == cfg.train.epochs:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, epochs=epochs))


def workers_text(cfg: FitConfig) -> str:
    r = cfg.run.scaling
    if not r.elastic:
        return f"{r.num_workers} worker(s)"
    return (
        f"{r.num_workers} worker(s) (elastic: starts once {r.min_workers} fit, checks "
        f"for room every {r.resize_check_s:g} s)"
    )


def gpu_text(cfg: FitConfig) -> str:
    run = cfg.run
    if not run.scaling.use_gpu:
        return ""
    step = "each step one CUDA graph" if cfg.captures_step else "eager steps"
    return f", {run.scaling.gpus:g} GPU, {run.backend_description}, {step}"


def summary_of(ctx: Fit, metrics: dict, wall_s: float) -> dict:
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


def let_go_of_ray(ctx: Fit) -> None:
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
