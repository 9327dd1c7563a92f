"""One training run from the driver: ``fit(cfg) -> FitResult``. Library code: it never prints.

``fit`` loads MNIST once and puts it in the object store, claims the run directory
``<storage-path>/<name>``, connects to (or starts) Ray, then builds and fits a
``TorchTrainer`` and writes ``summary.json`` and ``training_curves.png``. It never touches
a tensor itself. What happens on the way reaches the caller as
:mod:`~raytrain_mnist.driver.events` (the CLI renders them; a notebook passes its own sink
or reads the log), and the outcome as a :class:`FitResult`::

    from raytrain_mnist.driver import fit

    result = fit(FitConfig(TrainConfig(epochs=3), RunSettings(num_workers=2)))
    result.status, result.best_checkpoint

Errors a user can cause (bad data, a run of other settings under the name, a cluster that
cannot place the run) raise :class:`~raytrain_mnist.errors.UserError` before training; a
run that fails or is stopped with Ctrl-C returns its result with that status.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from raytrain_mnist.config import (
    DEFAULT_RECIPE,
    RECIPES,
    FitConfig,
    RunSettings,
    check_data_fits,
    command_line,
    epochs_for,
    flags_of,
    python_command,
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
from raytrain_mnist.driver.runs import CURVES_FILE, RUN_FILE, SUMMARY_FILE, Run
from raytrain_mnist.errors import UserError, cause_line

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
    started = time.perf_counter()
    called = time.time()
    timeline = (
        Timeline(started_at, "process start")
        if started_at is not None and started_at <= called
        else Timeline(called, "fit() called")
    )
    timeline.mark("fit_called", called)
    emit = _Serialized(on_event or log_event)

    def phase(text: str, key: str | None = None) -> None:
        elapsed = time.time() - timeline.t0 if key is None else timeline.mark(key)
        emit(Phase(text, elapsed))

    from raytrain_mnist.data import load_mnist

    data = load_mnist(cfg.run.data_dir, cfg.run.dataset)
    # The epochs are part of the run's name and identity: decided before either.
    cfg = _sized_for_data(cfg, data.train_size)
    check_data_fits(cfg.train, cfg.run, data.train_size)
    run = Run(cfg.run.storage_path, runs.default_name(cfg))
    phase(
        f"data loaded: {data.train_size} train / {data.test_size} test images ({data.kind})",
        "data_loaded",
    )
    identity = runs.fit_identity(cfg, data)
    with run.claim(cfg.run.fresh):
        run.held.handled = True  # a lost claim stops the run, with one line (Stopping)
        # Inside the claim: no other command can be writing what these read.
        run.check_identity(identity)
        finished = run.finished()
        if finished is not None:
            logger.debug("run '%s' already finished; see %s/%s", run.name, run.dir, SUMMARY_FILE)
            return FitResult(
                "finished",
                finished,
                run.dir,
                finished.get("best_checkpoint"),
                already_finished=True,
            )
        prior = _resume_point(run, cfg)
        summary, error, tracker, logs, curves = _train(
            cfg, run, data, identity, prior, started, emit, phase, poll_s, timeline
        )
        # Still claimed: a second command never sees a half-written or stale summary. A
        # claim lost meanwhile: another command may hold the run, nothing more is written.
        lost = run.held.reason if run.held.lost.is_set() else None
        if lost is not None:
            summary["error"] = lost
        else:
            run.write_json(SUMMARY_FILE, summary)
        if curves is not None and lost is None:
            run.write_bytes(CURVES_FILE, curves.png())
        tracker.close(summary)
        timeline.mark("files_written")
        summary["timeline"] = timeline.to_dict(summary["timeline"]["worker_clock"])
        if lost is None:  # again, with the teardown's last moments
            run.write_json(SUMMARY_FILE, summary)
    status = summary["status"]
    return FitResult(
        status,
        summary,
        summary["run_dir"],
        summary["best_checkpoint"],
        error=summary["error"],
        resume_command=None if status == "finished" else resume_command(cfg, run.name, invocation),
        worker_logs=logs,
    )


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
    r = cfg.run
    if not r.elastic:
        return f"{r.num_workers} worker(s)"
    return (
        f"{r.num_workers} worker(s) (elastic: starts once {r.min_workers} fit, checks "
        f"for room every {r.resize_check_s:g} s)"
    )


def _gpu_text(run: RunSettings) -> str:
    return f", {run.gpus:g} GPU, {run.backend_description}" if run.use_gpu else ""


def _train(
    cfg: FitConfig,
    run: Run,
    data,
    identity: dict,
    prior: list[dict],
    started: float,
    emit: EventSink,
    phase,
    poll_s: float,
    timeline: Timeline,
):
    """Connect, train, summarize: (summary, error or None, the tracker, worker logs, the
    curves being drawn or None)."""
    address = cluster.resolve_address(cfg.run.address)
    import ray

    local = address is None and not ray.is_initialized()
    # Sized for the most workers the run may have; placed once the fewest fit.
    cpus_per_worker = cfg.run.cpus_per_worker or cluster.default_cpus_per_worker(
        cfg.run.max_workers, local
    )
    request = cluster.Request.for_run(cfg.run, cpus_per_worker)
    phase(
        "starting a local Ray"
        if local
        else f"connecting to Ray at {address}"
        if address
        else "using the connected Ray",
        "ray_starting",
    )
    # A single run needs no dashboard: without it its own Ray starts seconds sooner.
    with cluster.connect(address, request, dashboard=False):
        phase("Ray ready", "ray_ready")
        full_epochs = RECIPES[cfg.recipe]["epochs"]
        sized = (
            f"; {cfg.train.epochs} epochs, as many steps as "
            f"{full_epochs} on full MNIST (--epochs sets them)"
            if cfg.auto_epochs and cfg.train.epochs != full_epochs
            else ""
        )
        emit(
            Note(
                f"{'resuming' if prior else 'starting'} run '{run.name}': "
                f"{_workers_text(cfg)} x {cpus_per_worker} CPU"
                f"{_gpu_text(cfg.run)}, {data.train_size} train / "
                f"{data.test_size} test images from {data.source}{sized}"
            )
        )
        run.write_json(RUN_FILE, identity)
        from raytrain_mnist.driver.tracking import EpochLog

        tracker = EpochLog(run.dir, cfg)  # a bad --mlflow-uri fails here, before training
        channel = start_channel()
        from raytrain_mnist.driver.trainer import build_trainer
        from raytrain_mnist.worker.loop import train_func_per_worker

        # --progress off: no stream from rank 0 at all (the epochs still arrive).
        loop_config = {
            "train": cfg.train.to_dict(),
            "data": ray.put(data),
            "cpus_per_worker": cpus_per_worker,
            "progress": None if cfg.run.progress == "off" else channel,
            "compile": cfg.run.compile,
        }
        trainer = build_trainer(
            cfg.run,
            train_func_per_worker,
            loop_config,
            cpus_per_worker,
            run.storage,
            run.name,
            callbacks=controller_callbacks(channel),
        )
        result = error = logs = None
        phase("workers starting", "trainer_started")
        monitor = RunMonitor(
            channel, cfg.train.epochs, prior, emit, timeline, on_epoch=tracker.log, poll_s=poll_s
        )
        with monitor:
            try:
                result = _fit_interruptibly(trainer, channel, emit, run.held)
            except ray.train.TrainingFailedError as exc:
                error, logs = exc, cluster.worker_logs_dir()
                logger.debug("training failed: %s (worker logs: %s)", cause_line(exc), logs)
            finally:
                timeline.mark("fit_returned")
        metrics = (
            result.metrics
            if result is not None
            else (monitor.seen[-1] if monitor.seen else run.latest_metrics())
        )
        summary = _summarize(
            cfg, run, data, cpus_per_worker, metrics, monitor, time.perf_counter() - started, error
        )
        timeline.mark("summary_built")
        # Drawn (matplotlib's import, the figure: a second or more) while Ray shuts down.
        curves = (
            _Drawing(
                summary["history"], f"{run.name}: {cfg.run.num_workers} worker(s), {data.kind}"
            )
            if summary["history"]
            else None
        )
    if local:
        timeline.mark("ray_shut_down")
    summary["timeline"] = timeline.to_dict(monitor.clock)
    return summary, error, tracker, logs, curves


class _Drawing:
    """The training curves' PNG, drawn on a thread from the moment it is made."""

    def __init__(self, history: list[dict], title: str) -> None:
        self._png: bytes | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._draw, args=(history, title), name="curves", daemon=True
        )
        self._thread.start()

    def _draw(self, history: list[dict], title: str) -> None:
        try:
            from raytrain_mnist.driver.plots import training_curves_png

            self._png = training_curves_png(history, title)
        except BaseException as exc:  # raised where the PNG is asked for
            self._error = exc

    def png(self) -> bytes:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._png is not None
        return self._png


def _fit_interruptibly(trainer, channel, emit: EventSink, held: runs.Claim | None = None):
    """``trainer.fit()`` on a helper thread, so that Ctrl-C reaches this (main) thread.

    On the main thread Ray installs its own SIGINT handler, which exits the process
    without a word; off it, Ray installs none, and we stop the run ourselves by aborting
    its controller, as Ray's handler would: its workers stop, the committed checkpoints
    stay. A Ray that is not ours (a notebook's, a cluster's) lives on; the one this call
    started is shut down by :func:`cluster.connect` once the summary is written (not here:
    the monitor thread would bring up a new Ray if it found none). Returns None when
    interrupted, or when ``held`` (the run's claim) is lost: the run is stopped the same way.
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # handed to the main thread as is
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="trainer.fit", daemon=True)
    thread.start()

    def stop(event: Stopping) -> None:
        emit(event)
        abort_run(channel, thread.is_alive)
        thread.join(60)

    try:
        while thread.is_alive():
            thread.join(0.5)
            if held is not None and held.lost.is_set() and thread.is_alive():
                stop(
                    Stopping(
                        f"{held.reason}: stopping the workers; the last committed "
                        "checkpoint is kept"
                    )
                )
                return None
    except KeyboardInterrupt:
        stop(Stopping())
        return None
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _summarize(
    cfg: FitConfig,
    run: Run,
    data,
    cpus_per_worker: int,
    metrics: dict,
    monitor: RunMonitor,
    wall_s: float,
    error,
) -> dict:
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
        "num_workers": cfg.run.num_workers,
        "elastic": cfg.run.elastic,
        "cpus_per_worker": cpus_per_worker,
        "use_gpu": cfg.run.use_gpu,
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
        "config": {"train": cfg.train.to_dict(), "run": dataclasses.asdict(cfg.run)},
        "history": history,
        "error": None if error is None else cause_line(error),
    }
    return json.loads(json.dumps(summary))  # as summary.json reads back: a range is a list
