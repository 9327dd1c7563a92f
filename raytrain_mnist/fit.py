"""Driver and CLI of ``python -m raytrain_mnist.fit``: data parallel MNIST on Ray Train.

The driver builds the config, connects to (or starts) Ray, loads MNIST once and puts it
in the object store, then builds and fits a ``TorchTrainer``. It prints one line per epoch
as epochs finish, then a summary, and writes ``summary.json`` and ``training_curves.png``
into the run directory ``<storage-path>/<name>``. It never touches a tensor itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from raytrain_mnist import cluster
from raytrain_mnist._cli import (EXIT_FAILURE, EXIT_USAGE, ArgumentParser, UserError,
                                 add_dataclass_args, cause_line, dataclass_from_args, run_cli,
                                 setup_logging)
from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig

logger = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
CURVES_FILE = "training_curves.png"
RUN_FILE = "run.json"  # what the run computes, written at its start; a resume must match it
# Written by Ray Train V2 once a run has committed a checkpoint.
_SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist fit",
        description="Train the MNIST ConvNet data-parallel on a Ray cluster (or a local Ray).",
    )
    add_dataclass_args(parser, TrainConfig, "training")
    add_dataclass_args(parser, RunSettings, "run")
    return parser


def parse_config(argv: Sequence[str] | None = None) -> FitConfig:
    args = build_parser().parse_args(argv)
    return FitConfig(train=dataclass_from_args(TrainConfig, args),
                     run=dataclass_from_args(RunSettings, args))


# --------------------------------------------------------------------------- run directory

def storage_root(storage_path: str) -> str:
    """Ray wants an absolute path or a URI."""
    if "://" in storage_path:
        return storage_path
    return str(Path(storage_path).expanduser().resolve())


def _is_local(path: str) -> bool:
    return "://" not in path


def _run_identity(cfg: FitConfig) -> dict[str, Any]:
    return {"train": cfg.train.to_dict(), "dataset": cfg.run.dataset}


def check_run_dir(cfg: FitConfig, run_dir: str) -> dict | None:
    """Look at what ``run_dir`` already holds, before anything is written.

    Returns the finished summary when the same run already finished, None to go ahead
    (new run, or resume). Raises :class:`UserError` when the command conflicts with the
    run directory or its latest checkpoint cannot be resumed.
    """
    if not _is_local(run_dir):
        return None  # remote storage: Ray's own snapshot decides whether to resume
    path = Path(run_dir)
    storage = path.parent
    if storage.exists() and not storage.is_dir():
        raise UserError(f"--storage-path {storage} is a file, not a directory", EXIT_USAGE)
    if path.exists() and not path.is_dir():
        raise UserError(f"{path} exists and is not a run directory; pick another --name",
                        EXIT_USAGE)
    if cfg.run.fresh or not path.is_dir():
        return None
    run_file, summary_file = path / RUN_FILE, path / SUMMARY_FILE
    if run_file.is_file():
        previous = _read_json(run_file)
        if previous != _run_identity(cfg):
            diff = _describe_difference(previous, _run_identity(cfg))
            raise UserError(
                f"run '{path.name}' in {storage} was started with other settings ({diff}); "
                "repeat its flags to resume it, pick another --name, or add --fresh",
                EXIT_USAGE)
    if summary_file.is_file() and _read_json(summary_file).get("status") == "finished":
        return _read_json(summary_file)
    latest = latest_checkpoint(run_dir)
    if latest is not None:
        from raytrain_mnist.checkpoint import CheckpointError, check_resumable

        try:
            check_resumable(latest, cfg.train.to_dict())
        except CheckpointError as exc:
            raise UserError(f"cannot resume run '{path.name}': {exc}; move {path} away, "
                            "pick another --name, or add --fresh") from exc
    return None


def _snapshot(run_dir: str) -> dict:
    """Ray Train's record of the committed checkpoints (local storage; {} when none)."""
    path = Path(run_dir) / _SNAPSHOT_FILE
    return _read_json(path) if _is_local(run_dir) and path.is_file() else {}


def latest_checkpoint(run_dir: str) -> Path | None:
    """The checkpoint Ray will resume from: the latest one its snapshot has committed.

    Checkpoint folders that the snapshot does not list (a worker died before the
    controller committed them) are never taken for valid ones.
    """
    latest = _snapshot(run_dir).get("latest_checkpoint_result") or {}
    name = latest.get("checkpoint_dir_name")
    return Path(run_dir) / name if name else None


def _best_committed_checkpoint(run_dir: str) -> Path | None:
    results = _snapshot(run_dir).get("checkpoint_results") or []
    if not results:
        return None
    best = max(results, key=lambda r: r.get("metrics", {}).get("val_accuracy", 0))
    return Path(run_dir) / best["checkpoint_dir_name"]


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is unreadable ({exc.__class__.__name__}); move the run "
                        "directory away or pick another --name") from exc
    if not isinstance(value, dict):
        raise UserError(f"{path} is not a run file of raytrain_mnist; pick another --name")
    return value


@contextlib.contextmanager
def claim_run_dir(run_dir: str, fresh: bool) -> Iterator[None]:
    """Create the run directory and hold its lock while the run is going.

    A second command with the same run name is refused while the lock is held. With
    ``fresh``, a previous run directory is kept, renamed ``NAME.previous-N``.
    """
    if not _is_local(run_dir):
        yield
        return
    from filelock import FileLock, Timeout

    path = Path(run_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise UserError(f"--storage-path {path.parent} is not writable ({exc.strerror}); "
                        "pick another directory", EXIT_USAGE) from exc
    lock = FileLock(str(path.parent / f".{path.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise UserError(f"run '{path.name}' is already running in {path.parent}; wait for it, "
                        "or pick another --name") from None
    created = False
    try:
        if fresh and path.exists():
            n = 1
            while path.with_name(f"{path.name}.previous-{n}").exists():
                n += 1
            path.rename(path.with_name(f"{path.name}.previous-{n}"))
            print(f"--fresh: the previous run is kept in {path.name}.previous-{n}")
        created = not path.exists()
        path.mkdir(exist_ok=True)
        yield
    finally:
        if created and path.is_dir() and not any(path.iterdir()):  # refused before any write
            path.rmdir()
        lock.release()


def _describe_difference(old: dict, new: dict) -> str:
    flat_old = {**old.get("train", {}), "dataset": old.get("dataset")}
    flat_new = {**new["train"], "dataset": new["dataset"]}
    changed = [f"{k}: {flat_old.get(k)!r} then, {flat_new[k]!r} now"
               for k in flat_new if flat_old.get(k) != flat_new[k]]
    return "; ".join(changed) or "unknown format"


def write_file(run_dir: str, name: str, payload: bytes) -> str:
    """Write into a run directory on a local disk or any pyarrow file system (s3://...)."""
    if _is_local(run_dir):
        target = Path(run_dir) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(payload)
        os.replace(tmp, target)
        return str(target)
    import pyarrow.fs

    fs, base = pyarrow.fs.FileSystem.from_uri(run_dir)
    with fs.open_output_stream(f"{base}/{name}") as f:
        f.write(payload)
    return f"{run_dir}/{name}"


# --------------------------------------------------------------------------- progress

class _Progress:
    """A tiny actor that carries each committed epoch from the Train controller to the driver."""

    def __init__(self) -> None:
        self.items: list[dict] = []

    def put(self, item: dict) -> None:
        self.items.append(item)

    def drain(self) -> list[dict]:
        items, self.items = self.items, []
        return items


def _progress_callback(actor):
    from ray.train import UserCallback

    class ProgressCallback(UserCallback):
        """Runs in the controller after every rank has reported an epoch."""

        def after_report(self, run_context, metrics, checkpoint):
            item = {**metrics[0], "checkpoint": checkpoint.path if checkpoint else None}
            actor.put.remote(item)  # fire and forget: the controller never waits on us

    return ProgressCallback()


def format_epoch(m: dict, epochs: int) -> str:
    return (f"epoch {m['epoch']:>3}/{epochs}  train_loss {m['train_loss']:.4f}  "
            f"val_loss {m['val_loss']:.4f}  val_acc {100 * m['val_accuracy']:6.2f}%  "
            f"{m['images_per_s']:8.0f} img/s  {m['epoch_time_s']:6.1f} s")


class _Printer:
    """Polls the progress actor from a thread and prints epochs as they commit."""

    def __init__(self, actor, epochs: int, on_epoch=None) -> None:
        self.actor, self.epochs = actor, epochs
        self.on_epoch = on_epoch  # tracking.EpochLog.log: TensorBoard (and MLflow)
        self.seen: list[dict] = []
        self.restarts = 0  # worker-group restarts seen (after a worker or node failure)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "_Printer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._flush()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._flush()

    def _flush(self) -> None:
        import ray

        try:
            items = ray.get(self.actor.drain.remote(), timeout=10)
        except Exception:  # the cluster is going away; what was printed stays printed
            return
        for m in items:
            # Each worker-group start stamps its reports; a new stamp mid-run is a restart.
            new_start = not self.seen or m.get("started_at") != self.seen[-1].get("started_at")
            if new_start and self.seen:
                self.restarts += 1
                print(f"workers restarted from the checkpoint of epoch "
                      f"{m.get('resumed_from_epoch') or 0}", flush=True)
            elif new_start and m.get("resumed_from_epoch"):
                print(f"resumed from the checkpoint of epoch {m['resumed_from_epoch']}",
                      flush=True)
            self.seen.append(m)
            print(format_epoch(m, self.epochs), flush=True)
            if self.on_epoch is not None:
                self.on_epoch(m)


def fit(cfg: FitConfig) -> dict[str, Any]:
    """Train as ``cfg`` says; return the summary (also written to ``summary.json``)."""
    started = time.perf_counter()
    storage, name = storage_root(cfg.run.storage_path), cfg.run_name
    run_dir = f"{storage.rstrip('/')}/{name}"
    finished = check_run_dir(cfg, run_dir)
    if finished is not None:
        print(f"run '{name}' already finished: val_accuracy "
              f"{100 * finished['val_accuracy']:.2f}% after {finished['epochs_completed']} "
              f"epoch(s); see {run_dir}/{SUMMARY_FILE}. Add --fresh to train it again.")
        return finished

    from raytrain_mnist.data import load_mnist

    data = load_mnist(cfg.run.data_dir, cfg.run.dataset)
    address = cluster.resolve_address(cfg.run.address)
    import ray

    local = address is None and not ray.is_initialized()
    threads = cfg.run.cpus_per_worker or cluster.default_cpus_per_worker(
        cfg.run.num_workers, local)
    request = cluster.Request(cfg.run.num_workers, threads, cfg.run.use_gpu)

    with claim_run_dir(run_dir, cfg.run.fresh), cluster.connect(address, request):
        resuming = latest_checkpoint(run_dir) is not None
        print(f"{'resuming' if resuming else 'starting'} run '{name}': {cfg.run.num_workers} "
              f"worker(s) x {threads} CPU{', 1 GPU' if cfg.run.use_gpu else ''}, "
              f"{data.train_size} train / {data.test_size} test images from {data.source}",
              flush=True)
        write_file(run_dir, RUN_FILE, json.dumps(_run_identity(cfg), indent=2).encode())
        from raytrain_mnist.tracking import EpochLog

        tracker = EpochLog(run_dir, cfg)  # a bad --mlflow-uri fails here, before training
        progress = ray.remote(num_cpus=0)(_Progress).remote()
        from raytrain_mnist.loop import train_func_per_worker
        from raytrain_mnist.trainer import build_trainer

        loop_config = {"train": cfg.train.to_dict(), "data": ray.put(data), "threads": threads}
        trainer = build_trainer(cfg.run, train_func_per_worker, loop_config, threads, storage,
                                name, callbacks=[_progress_callback(progress)])
        result = error = None
        interrupted = False
        with _Printer(progress, cfg.train.epochs, tracker.log) as printer:
            try:
                result = _fit_interruptibly(trainer)
            except ray.train.TrainingFailedError as exc:
                error, logs = exc, cluster.worker_logs_dir()
            except KeyboardInterrupt:
                interrupted = True
                print("\nCtrl-C: stopping the workers; the last committed checkpoint is kept",
                      file=sys.stderr, flush=True)
        metrics = result.metrics if result is not None else (
            printer.seen[-1] if printer.seen else _committed_metrics(run_dir))
        summary = _summarize(cfg, name, run_dir, data, threads, result, metrics,
                             printer, time.perf_counter() - started, error)
        if interrupted:
            ray.shutdown()  # ends this job: Ray stops its controller and workers

    write_file(run_dir, SUMMARY_FILE, json.dumps(summary, indent=2).encode())
    if summary["history"]:
        from raytrain_mnist.plots import training_curves_png

        write_file(run_dir, CURVES_FILE, training_curves_png(
            summary["history"], f"{name}: {cfg.run.num_workers} worker(s), {data.kind}"))
    tracker.close(summary)
    _print_summary(summary)
    if error is not None:
        raise UserError(f"training failed: {cause_line(error)}; resume with: "
                        f"{resume_command(cfg)} (worker logs: {logs})", EXIT_FAILURE)
    if summary["status"] == "interrupted":
        print(f"interrupted after {summary['epochs_completed']} epoch(s); resume with: "
              f"{resume_command(cfg)}", file=sys.stderr)
        raise KeyboardInterrupt
    return summary


def _fit_interruptibly(trainer):
    """``trainer.fit()`` on a helper thread, so that Ctrl-C reaches this (main) thread.

    On the main thread Ray installs its own SIGINT handler, which exits the process
    without a word; off it, Ray installs none, and we stop the run ourselves.
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # handed to the main thread as is
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="trainer.fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _committed_metrics(run_dir: str) -> dict:
    """Metrics of the latest committed checkpoint, from Ray's snapshot."""
    return (_snapshot(run_dir).get("latest_checkpoint_result") or {}).get("metrics", {})


def resume_command(cfg: FitConfig) -> str:
    return (f"python -m raytrain_mnist.fit {' '.join(sys.argv[1:])}".strip()
            + ("" if cfg.run.name else f" --name {cfg.run_name}"))


def _summarize(cfg, name, run_dir, data, threads, result, metrics, printer, wall_s, error):
    history = metrics.get("history", [])
    epochs_completed = len(history)
    if error is not None:
        status = "failed"
    elif epochs_completed >= cfg.train.epochs:
        status = "finished"
    else:
        status = "interrupted"
    best_path = latest_path = None
    if result is not None and result.checkpoint is not None:
        latest_path = result.checkpoint.path
        if result.best_checkpoints:
            best = max(result.best_checkpoints, key=lambda cm: cm[1].get("val_accuracy", 0))
            best_path = best[0].path
    else:  # stopped early: what Ray committed is on disk
        latest_path, best_path = latest_checkpoint(run_dir), _best_committed_checkpoint(run_dir)
    first = printer.seen[0] if printer.seen else metrics
    return {
        "name": name,
        "run_dir": run_dir,
        "status": status,
        "data_source": data.source,
        "dataset": data.kind,
        "train_size": data.train_size,
        "test_size": data.test_size,
        "num_workers": cfg.run.num_workers,
        "cpus_per_worker": threads,
        "use_gpu": cfg.run.use_gpu,
        "epochs_completed": epochs_completed,
        "resumed_from_epoch": first.get("resumed_from_epoch"),
        "worker_restarts": printer.restarts,
        "worker_started_at": first.get("started_at"),  # unix time the training loop began
        "val_accuracy": metrics.get("val_accuracy"),
        "val_loss": metrics.get("val_loss"),
        "val_total": metrics.get("val_total"),
        "best_val_accuracy": metrics.get("best_val_accuracy"),
        "wall_time_s": round(wall_s, 2),
        "best_checkpoint": None if best_path is None else str(best_path),
        "latest_checkpoint": None if latest_path is None else str(latest_path),
        "workers": metrics.get("workers", []),
        "config": {"train": cfg.train.to_dict(), "run": dataclasses.asdict(cfg.run)},
        "history": history,
        "error": None if error is None else cause_line(error),
    }


def _print_summary(s: dict) -> None:
    if s["history"]:
        print(f"\n{'epoch':>5} {'train_loss':>10} {'val_loss':>9} {'val_acc':>8} "
              f"{'img/s':>8} {'time_s':>7}")
        for h in s["history"]:
            print(f"{h['epoch']:>5} {h['train_loss']:>10.4f} {h['val_loss']:>9.4f} "
                  f"{100 * h['val_accuracy']:>7.2f}% {h['images_per_s']:>8.0f} "
                  f"{h['epoch_time_s']:>7.1f}")
    if s["val_accuracy"] is not None:
        print(f"\nval_accuracy {100 * s['val_accuracy']:.2f}% on {s['val_total']} test images "
              f"({s['dataset']}), best {100 * s['best_val_accuracy']:.2f}%, "
              f"{s['wall_time_s']:.0f} s wall")
    print(f"best checkpoint: {s['best_checkpoint']}")
    print(f"run directory:   {s['run_dir']}")


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    summary = fit(parse_config(argv))
    return 0 if summary["status"] == "finished" else EXIT_FAILURE


def cli(argv: Sequence[str] | None = None) -> int:
    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
