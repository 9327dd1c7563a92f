"""Driver and CLI of ``python -m raytrain_mnist.fit``: data parallel MNIST on Ray Train.

The driver builds the config, connects to (or starts) Ray, loads MNIST once and puts it
in the object store, then builds and fits a ``TorchTrainer``. It prints one line per epoch
as epochs finish, then a summary, and writes ``summary.json`` and ``training_curves.png``
into the run directory ``<storage-path>/<name>``. It never touches a tensor itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from raytrain_mnist import compat
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
from raytrain_mnist.config import (
    DEFAULT_EPOCHS,
    FitConfig,
    RunSettings,
    TrainConfig,
    check_data_fits,
    epochs_for,
    parse_workers,
)
from raytrain_mnist.console import Renderer
from raytrain_mnist.driver import cluster, runs
from raytrain_mnist.driver.runs import CURVES_FILE, RUN_FILE, SUMMARY_FILE, Run
from raytrain_mnist.errors import EXIT_FAILURE, UserError, cause_line

logger = logging.getLogger(__name__)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist fit",
        description="Train the MNIST ConvNet data-parallel on a Ray cluster (or a local Ray).",
    )
    add_dataclass_args(parser, TrainConfig, "training")
    add_dataclass_args(parser, RunSettings, "run", types={"num_workers": parse_workers})
    return parser


def parse_config(argv: Sequence[str] | None = None) -> FitConfig:
    # argparse keeps a value already in the namespace: None marks "--epochs not given".
    args = build_parser().parse_args(argv, namespace=argparse.Namespace(epochs=None))
    auto_epochs = args.epochs is None
    if auto_epochs:
        args.epochs = DEFAULT_EPOCHS
    return FitConfig(
        train=dataclass_from_args(TrainConfig, args),
        run=dataclass_from_args(RunSettings, args),
        auto_epochs=auto_epochs,
    )


# --------------------------------------------------------------------------- progress


class _Progress:
    """A tiny actor that carries events from the Train controller to the driver: each
    committed epoch, and the controller's own handle (to abort the run on Ctrl-C)."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.controller = None

    def put(self, item: dict) -> None:
        self.items.append(item)

    def set_controller(self, handle: list) -> None:
        self.controller = handle[0]

    def get_controller(self):
        return self.controller

    def drain(self) -> list[dict]:
        items, self.items = self.items, []
        return items


def _callbacks(actor) -> list:
    """Controller-side callbacks feeding ``actor``: they fire and forget, the controller never
    waits on the driver."""
    import ray
    from ray.train import UserCallback

    class EpochFeed(UserCallback):
        """After every rank has reported an epoch and its checkpoint is committed."""

        def after_report(self, run_context, metrics, checkpoint):
            actor.put.remote({**metrics[0], "checkpoint": checkpoint.path if checkpoint else None})

    callbacks: list = [EpochFeed()]
    # The controller's handle: a public hook for it does not exist in Ray 2.60.
    ControllerCallback = compat.controller_callback_base()
    if ControllerCallback is None:
        return callbacks

    class ControllerFeed(ControllerCallback):
        def after_controller_start(self, train_run_context):
            # In a list: a bare handle passed to a task is not the same as one sent as data.
            actor.set_controller.remote([ray.get_runtime_context().current_actor])

    return callbacks + [ControllerFeed()]


def format_epoch(m: dict, epochs: int) -> str:
    return (
        f"epoch {m['epoch']:>3}/{epochs}  train_loss {m['train_loss']:.4f}  "
        f"val_loss {m['val_loss']:.4f}  val_acc {100 * m['val_accuracy']:6.2f}%  "
        f"{m['images_per_s']:8.0f} img/s  {m['epoch_time_s']:6.1f} s"
    )


#: What an epoch's report carries about the run rather than the epoch: not history.
_RUN_KEYS = (
    "val_total",
    "best_val_accuracy",
    "resumed_from_epoch",
    "started_at",
    "workers",
    "checkpoint",
)


def _epoch_entry(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in _RUN_KEYS}


class _Printer:
    """Polls the progress actor from a thread and hands what it carries to the renderer:
    rank 0's progress (worker-group starts, the first step, steps within an epoch) and the
    epochs as they commit. Builds the run's history (the epochs before a resume, from its
    checkpoint, and those seen now) and its record of worker-group restarts and resizes."""

    def __init__(
        self, actor, epochs: int, prior: list[dict], on_epoch=None, renderer: Renderer | None = None
    ) -> None:
        self.actor, self.epochs = actor, epochs
        self.on_epoch = on_epoch  # tracking.EpochLog.log: TensorBoard (and MLflow)
        self.renderer = renderer or Renderer("off", epochs, time.perf_counter())
        self.prior = [_epoch_entry(h) for h in prior]
        self.seen: list[dict] = []
        self.restarts = 0  # worker-group restarts seen (after a failure, or a resize)
        #: Each change of the world size: {"from", "to", "at_epoch"} (the first epoch the
        #: new size trains).
        self.resizes: list[dict] = []
        self._group: tuple | None = None  # (started_at, world size) of the current group
        self._first_step = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Printer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._flush()
        self.renderer.close()

    @property
    def history(self) -> list[dict]:
        """One entry per epoch; an epoch trained again after a restart counts once."""
        by_epoch = {h["epoch"]: h for h in self.prior}
        by_epoch.update({m["epoch"]: _epoch_entry(m) for m in self.seen})
        return [by_epoch[e] for e in sorted(by_epoch)]

    def _run(self) -> None:
        while not self._stop.wait(self.renderer.poll_s):
            self._flush()

    def _flush(self) -> None:
        import ray

        if not ray.is_initialized():  # a call now would start a new Ray of its own
            return
        try:
            items = ray.get(self.actor.drain.remote(), timeout=10)
        except Exception:  # the cluster is going away; what was printed stays printed
            return
        for m in items:
            kind = m.get("progress")
            if kind == "step":
                self.renderer.step(m)
                continue
            # Each worker-group start stamps its reports (rank 0 also announces it before its
            # first epoch): a new stamp is a new group, after a failure or a resize.
            self._group_started(m)
            if kind == "first_step":
                if not self._first_step:
                    self._first_step = True
                    self.renderer.phase("first step")
            elif kind is None:  # a committed epoch
                self.seen.append(m)
                self.renderer.epoch(m["epoch"], format_epoch(m, self.epochs))
                if self.on_epoch is not None:
                    self.on_epoch(m)

    def _group_started(self, m: dict) -> None:
        started_at, size = m.get("started_at"), m.get("world_size")
        if started_at is None or (self._group and self._group[0] == started_at):
            return
        previous, self._group = self._group, (started_at, size)
        resumed = m.get("resumed_from_epoch") or 0
        if previous is None:
            if resumed:
                self.renderer.line(f"resumed from the checkpoint of epoch {resumed}")
            if m.get("progress") == "ready":
                self.renderer.phase(f"{size} worker(s) started")
            return
        self.restarts += 1
        if size is not None and previous[1] is not None and size != previous[1]:
            self.resizes.append({"from": previous[1], "to": size, "at_epoch": resumed + 1})
            self.renderer.line(f"workers {previous[1]} → {size} at epoch {resumed + 1}")
        else:
            self.renderer.line(f"workers restarted from the checkpoint of epoch {resumed}")


# --------------------------------------------------------------------------- the run


def _resume_point(run: Run, cfg: FitConfig) -> list[dict]:
    """The history a resume continues from ([] for a new run). Checks, on the driver and
    before any worker starts, that the latest committed checkpoint can resume this run."""
    latest = run.latest_checkpoint()
    if latest is None:
        return []
    from raytrain_mnist.worker.checkpoint import CheckpointError, resumable_state

    with run.local_copy(latest) as directory:
        try:
            return list(resumable_state(directory, cfg.train.to_dict())["history"])
        except CheckpointError as exc:
            raise UserError(
                f"cannot resume run '{run.name}': {exc}; move {run.dir} away, "
                "pick another --name, or add --fresh"
            ) from exc


def fit(cfg: FitConfig) -> dict[str, Any]:
    """Train as ``cfg`` says; return the summary (also written to ``summary.json``)."""
    started = time.perf_counter()
    from raytrain_mnist.data import load_mnist

    data = load_mnist(cfg.run.data_dir, cfg.run.dataset)
    # The epochs are part of the run's name and identity: decided before either.
    cfg = _sized_for_data(cfg, data.train_size)
    check_data_fits(cfg.train, cfg.run, data.train_size)
    run = Run(cfg.run.storage_path, runs.default_name(cfg))
    renderer = Renderer(cfg.run.progress, cfg.train.epochs, started)
    renderer.phase(
        f"data loaded: {data.train_size} train / {data.test_size} test images ({data.kind})"
    )
    identity = runs.fit_identity(cfg, data)
    with run.claim(cfg.run.fresh):
        # Inside the claim: no other command can be writing what these read.
        run.check_identity(identity)
        finished = run.finished()
        if finished is not None:
            print(
                f"run '{run.name}' already finished: val_accuracy "
                f"{100 * finished['val_accuracy']:.2f}% after "
                f"{finished['epochs_completed']} epoch(s); see {run.dir}/{SUMMARY_FILE}. "
                "Add --fresh to train it again."
            )
            return finished
        prior = _resume_point(run, cfg)
        summary, error, tracker, logs = _train(cfg, run, data, identity, prior, started, renderer)
        # Still claimed: a second command never sees a half-written or stale summary.
        run.write_json(SUMMARY_FILE, summary)
        if summary["history"]:
            from raytrain_mnist.driver.plots import training_curves_png

            run.write_bytes(
                CURVES_FILE,
                training_curves_png(
                    summary["history"], f"{run.name}: {cfg.run.num_workers} worker(s), {data.kind}"
                ),
            )
        tracker.close(summary)
    _print_summary(summary)
    if error is not None:
        raise UserError(
            f"training failed: {cause_line(error)}; resume with: "
            f"{resume_command(cfg, run.name)} (worker logs: {logs})",
            EXIT_FAILURE,
        )
    if summary["status"] == "interrupted":
        print(
            f"interrupted after {summary['epochs_completed']} epoch(s); resume with: "
            f"{resume_command(cfg, run.name)}",
            file=sys.stderr,
        )
        raise KeyboardInterrupt
    return summary


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


def _train(
    cfg: FitConfig,
    run: Run,
    data,
    identity: dict,
    prior: list[dict],
    started: float,
    renderer: Renderer,
):
    """Connect, train, summarize: (summary, error or None, the tracker, worker logs)."""
    address = cluster.resolve_address(cfg.run.address)
    import ray

    local = address is None and not ray.is_initialized()
    # Sized for the most workers the run may have; placed once the fewest fit.
    cpus_per_worker = cfg.run.cpus_per_worker or cluster.default_cpus_per_worker(
        cfg.run.max_workers, local
    )
    request = cluster.Request.for_run(cfg.run, cpus_per_worker)
    renderer.phase(
        "starting a local Ray"
        if local
        else f"connecting to Ray at {address}"
        if address
        else "using the connected Ray"
    )
    with cluster.connect(address, request):
        sized = (
            f"; {cfg.train.epochs} epochs, as many steps as "
            f"{DEFAULT_EPOCHS} on full MNIST (--epochs sets them)"
            if cfg.auto_epochs and cfg.train.epochs != DEFAULT_EPOCHS
            else ""
        )
        renderer.line(
            f"{'resuming' if prior else 'starting'} run '{run.name}': "
            f"{_workers_text(cfg)} x {cpus_per_worker} CPU"
            f"{_gpu_text(cfg.run)}, {data.train_size} train / "
            f"{data.test_size} test images from {data.source}{sized}"
        )
        run.write_json(RUN_FILE, identity)
        from raytrain_mnist.driver.tracking import EpochLog

        tracker = EpochLog(run.dir, cfg)  # a bad --mlflow-uri fails here, before training
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # On the driver's node, as Ray puts the Train controller: a lost worker node must
        # not take the stream (and the epochs it carries) with it.
        progress = (
            ray.remote(num_cpus=0)(_Progress)
            .options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    ray.get_runtime_context().get_node_id(), soft=False
                )
            )
            .remote()
        )
        from raytrain_mnist.driver.trainer import build_trainer
        from raytrain_mnist.worker.loop import train_func_per_worker

        # --progress off: no stream from rank 0 at all (the epochs still arrive).
        loop_config = {
            "train": cfg.train.to_dict(),
            "data": ray.put(data),
            "cpus_per_worker": cpus_per_worker,
            "progress": None if renderer.mode == "off" else progress,
        }
        trainer = build_trainer(
            cfg.run,
            train_func_per_worker,
            loop_config,
            cpus_per_worker,
            run.storage,
            run.name,
            callbacks=_callbacks(progress),
        )
        result = error = logs = None
        renderer.phase("workers starting")
        with _Printer(progress, cfg.train.epochs, prior, tracker.log, renderer) as printer:
            try:
                result = _fit_interruptibly(trainer, progress)
            except ray.train.TrainingFailedError as exc:
                error, logs = exc, cluster.worker_logs_dir()
        metrics = (
            result.metrics
            if result is not None
            else (printer.seen[-1] if printer.seen else run.latest_metrics())
        )
        summary = _summarize(
            cfg, run, data, cpus_per_worker, metrics, printer, time.perf_counter() - started, error
        )
    return summary, error, tracker, logs


def _gpu_text(run: RunSettings) -> str:
    return f", {run.gpus:g} GPU, {run.backend_description}" if run.use_gpu else ""


def _fit_interruptibly(trainer, progress):
    """``trainer.fit()`` on a helper thread, so that Ctrl-C reaches this (main) thread.

    On the main thread Ray installs its own SIGINT handler, which exits the process
    without a word; off it, Ray installs none, and we stop the run ourselves by aborting
    its controller, as Ray's handler would: its workers stop, the committed checkpoints
    stay. A Ray that is not ours (a notebook's, a cluster's) lives on; the one this command
    started is shut down by :func:`cluster.connect` once the summary is written (not here:
    the progress thread would bring up a new Ray if it found none). Returns None when
    interrupted.
    """
    import ray

    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # handed to the main thread as is
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="trainer.fit", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        print(
            "\nCtrl-C: stopping the workers; the last committed checkpoint is kept",
            file=sys.stderr,
            flush=True,
        )
        controller = None
        # Interrupted while the controller was starting: it announces itself in a moment.
        for _ in range(60):
            controller = ray.get(progress.get_controller.remote(), timeout=30)
            if controller is not None or not thread.is_alive():
                break
            time.sleep(0.5)
        if controller is not None:
            try:
                ray.get(controller.abort.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                pass  # the controller ends itself once it has stopped its workers
        thread.join(60)
        return None
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def resume_command(cfg: FitConfig, name: str) -> str:
    """The command that continues this run, as this process was started (never --fresh)."""
    return command_line(
        [*invocation("fit"), *flags_of(cfg.train, cfg.run, skip=("fresh", "name")), "--name", name]
    )


def _summarize(
    cfg: FitConfig,
    run: Run,
    data,
    cpus_per_worker: int,
    metrics: dict,
    printer: _Printer,
    wall_s: float,
    error,
) -> dict:
    history = printer.history
    epochs_completed = history[-1]["epoch"] if history else 0
    if error is not None:
        status = "failed"
    elif epochs_completed >= cfg.train.epochs:
        status = "finished"
    else:
        status = "interrupted"
    first = printer.seen[0] if printer.seen else metrics
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
        "worker_restarts": printer.restarts,
        "resizes": printer.resizes,
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


def _print_summary(s: dict) -> None:
    if s["history"]:
        print(
            f"\n{'epoch':>5} {'train_loss':>10} {'val_loss':>9} {'val_acc':>8} "
            f"{'img/s':>8} {'time_s':>7}"
        )
        for h in s["history"]:
            print(
                f"{h['epoch']:>5} {h['train_loss']:>10.4f} {h['val_loss']:>9.4f} "
                f"{100 * h['val_accuracy']:>7.2f}% {h['images_per_s']:>8.0f} "
                f"{h['epoch_time_s']:>7.1f}"
            )
    if s["val_accuracy"] is not None:
        print(
            f"\nval_accuracy {100 * s['val_accuracy']:.2f}% on {s['val_total']} test images "
            f"({s['dataset']}), best {100 * s['best_val_accuracy']:.2f}%, "
            f"{s['wall_time_s']:.0f} s wall"
        )
    print(f"best checkpoint: {s['best_checkpoint']}")
    print(f"run directory:   {s['run_dir']}")


def run(cfg: FitConfig) -> int:
    setup_logging()
    summary = fit(cfg)
    return 0 if summary["status"] == "finished" else EXIT_FAILURE


COMMAND = Command("fit", build_parser, parse_config, run)
cli = COMMAND.main


if __name__ == "__main__":
    sys.exit(COMMAND.main())
