"""``python -m raytrain_mnist.evaluate RUN_DIR_OR_CHECKPOINT``: score a checkpoint on the test set.

The target is a run directory (its ``summary.json`` names the best checkpoint), a Tune
experiment directory (its ``best.json`` does), a checkpoint directory (``fit``'s
``checkpoint_*`` or a Tune trial's) or a ``state.pt`` file. Weights are
loaded with ``weights_only=True``. The test set is the one the run trained with when the run
says so (``summary.json``: ``dataset``, ``data_source``, ``config.run.data_dir``), else
``--data-dir``/``--dataset``.

Scoring reuses :func:`raytrain_mnist.loop.evaluate` (exact shards, all-reduced sums): in this
process with one worker, on a ``TorchTrainer`` with several. A forward hook collects each
image's prediction on the way, for the confusion matrix and the most confidently wrong digits.

Writes ``evaluation.json``, ``confusion_matrix.png`` and ``misclassified.png`` into ``--out``
(default: ``evaluation_<checkpoint>/`` beside the checkpoint) and prints accuracy per class.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from raytrain_mnist._cli import (EXIT_USAGE, ArgumentParser, UserError, run_cli,
                                 setup_logging)
from raytrain_mnist.config import DATASET_CHOICES, ConfigError

EVALUATION_FILE = "evaluation.json"
CONFUSION_FILE = "confusion_matrix.png"
MISCLASSIFIED_FILE = "misclassified.png"
_SUMMARY_FILE = "summary.json"  # fit.SUMMARY_FILE; not imported, to keep --help light
_STATE_FILE = "state.pt"  # checkpoint.STATE_FILE
_SEARCH_FILE = "search.json"  # tune.SEARCH_FILE
_BEST_FILE = "best.json"  # tune.BEST_FILE
_TOP_WRONG = 32


@dataclass(frozen=True)
class Target:
    """What RUN_DIR_OR_CHECKPOINT resolved to."""

    checkpoint: Path  # the checkpoint directory, or a bare state.pt file
    summary: dict | None  # the summary of the run that wrote it, when found
    summary_path: Path | None


# --------------------------------------------------------------------------- resolving

def resolve_target(target: str | os.PathLike) -> Target:
    """A run directory, a ``summary.json``, a Tune experiment directory (its ``best.json``),
    a checkpoint directory or a ``state.pt`` file."""
    path = Path(target).expanduser()
    if not path.exists():
        raise UserError(f"{path} does not exist; pass a run directory, a checkpoint "
                        f"directory or a {_STATE_FILE} file", EXIT_USAGE)
    if path.is_file() and path.name == _SUMMARY_FILE:
        path = path.parent
    if path.is_dir() and not (path / _STATE_FILE).is_file():
        summary_path = path / _SUMMARY_FILE
        best = _read_summary(path / _BEST_FILE)
        if not summary_path.is_file() and best is not None and "experiment_dir" in best:
            # A Tune experiment: best.json names the best trial's checkpoint.
            return resolve_target(_best_checkpoint(best, path))
        if not summary_path.is_file():
            checkpoints = sorted(path.glob(f"checkpoint_*/{_STATE_FILE}"))
            hint = (f"; pass one of its checkpoints, e.g. {checkpoints[-1].parent}"
                    if checkpoints else "")
            raise UserError(f"{path} is neither a run directory (no {_SUMMARY_FILE}) nor a "
                            f"checkpoint (no {_STATE_FILE}){hint}", EXIT_USAGE)
        summary = _read_summary(summary_path)
        if summary is None:
            raise UserError(f"{summary_path} is unreadable; pass a checkpoint directory instead")
        return Target(_best_checkpoint(summary, path), summary, summary_path)
    if path.is_file():
        with path.open("rb") as f:
            if f.read(4) != b"PK\x03\x04":  # torch.save writes a zip archive
                raise UserError(f"{path} is not a checkpoint: pass a run directory, a "
                                f"checkpoint directory or a {_STATE_FILE} file", EXIT_USAGE)
    checkpoint = path
    # A checkpoint inside a run directory: that run's summary says which data it used.
    # In a Tune experiment (<experiment>/runs/<trial>/checkpoint_*), search.json says
    # which data set was asked for.
    for parent in list(path.parents)[:4]:
        summary = _read_summary(parent / _SUMMARY_FILE)
        if summary is not None and "dataset" in summary:
            return Target(checkpoint, summary, parent / _SUMMARY_FILE)
        search = _read_summary(parent / _SEARCH_FILE)
        if search is not None and search.get("dataset") in ("mnist", "sample"):
            return Target(checkpoint, {"dataset": search["dataset"]}, parent / _SEARCH_FILE)
    return Target(checkpoint, None, None)


def _read_summary(path: Path) -> dict | None:
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def _best_checkpoint(summary: dict, run_dir: Path) -> Path:
    recorded = summary.get("best_checkpoint") or summary.get("latest_checkpoint")
    if not recorded:
        raise UserError(f"run {run_dir} has no checkpoint (status: "
                        f"{summary.get('status', 'unknown')}); train it first")
    candidates = [Path(recorded)]
    if "://" not in recorded:  # the directory may have been moved since
        recorded_dir = summary.get("run_dir") or summary.get("experiment_dir") or ""
        try:
            candidates.append(run_dir / Path(recorded).relative_to(recorded_dir))
        except ValueError:
            candidates.append(run_dir / Path(recorded).name)
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise UserError(f"the best checkpoint of {run_dir} ({recorded}) is not here; pass a "
                    "local checkpoint directory")


# --------------------------------------------------------------------------- data

def load_test_data(summary: dict | None, data_dir: str | None, dataset: str | None):
    """The test set the run was scored on while it trained, when the run says which."""
    from raytrain_mnist.data import load_mnist

    trained_on = (summary or {}).get("dataset")
    if trained_on is None:
        return load_mnist(data_dir, dataset or "auto")
    if dataset not in (None, "auto", trained_on):
        raise UserError(f"this checkpoint was trained and scored on the {trained_on!r} data "
                        f"set; evaluating it on {dataset!r} would not measure the same thing "
                        f"(drop --dataset or pass --dataset {trained_on})", EXIT_USAGE)
    if trained_on == "sample":
        data = load_mnist(None, "sample")
    else:
        recorded = ((summary.get("config") or {}).get("run") or {}).get("data_dir")
        if data_dir is None and recorded is not None and not Path(recorded).is_dir():
            raise UserError(f"the run read MNIST from {recorded}, which is not a directory "
                            "here; pass --data-dir", EXIT_USAGE)
        data = load_mnist(data_dir or recorded, "mnist")
    expected = summary.get("test_size")
    if expected is not None and data.test_size != expected:
        raise UserError(f"the run was scored on {expected} test images, {data.source} holds "
                        f"{data.test_size}; pass the --data-dir it trained with", EXIT_USAGE)
    published = "checksums match the published MNIST"
    trained_source = summary.get("data_source")
    if trained_source and (published in trained_source) != (published in data.source):
        raise UserError(f"the run trained on {summary.get('data_source')}, this is "
                        f"{data.source}; pass the --data-dir it trained with", EXIT_USAGE)
    return data


# --------------------------------------------------------------------------- scoring

def score(model, images, labels, device, amp: str = "off", rank: int = 0,
          world_size: int = 1) -> dict[str, Any]:
    """:func:`loop.evaluate` on this rank's shard, plus each image's prediction and confidence.

    Returns the all-reduced metrics and this shard's ``predictions`` and ``confidence``
    (softmax probability of the predicted class) as numpy arrays.
    """
    import torch

    from raytrain_mnist.loop import amp_context, evaluate

    if amp == "fp16" and device.type != "cuda":
        amp = "off"  # fp16 autocast is a GPU feature; fit refuses it on CPU anyway
    probabilities: list[torch.Tensor] = []
    hook = model.register_forward_hook(
        lambda _module, _inputs, logits: probabilities.append(logits.float().softmax(1).cpu()))
    try:
        metrics = evaluate(model, images, labels, device, amp_context(amp, device), rank,
                           world_size)
    finally:
        hook.remove()
    confidence, predictions = (torch.cat(probabilities) if probabilities
                               else torch.empty(0, 10)).max(1)
    return {**metrics, "predictions": predictions.numpy(), "confidence": confidence.numpy()}


def _score_per_worker(config: dict[str, Any]) -> dict[str, Any] | None:
    """Ray Train worker: score this rank's shard, gather every shard's predictions on rank 0."""
    import numpy as np
    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    from raytrain_mnist.model import ConvNet

    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(config["threads"])
    device = ray.train.torch.get_device()
    images, labels = ray.get(config["data"])
    model = ConvNet()
    model.load_state_dict(ray.get(config["weights"]))
    result = score(model.to(device), images, labels, device, config["amp"], rank, world_size)
    shards = [None] * world_size
    # Shards are contiguous and in rank order, so concatenating restores the test order.
    dist.all_gather_object(shards, (result["predictions"], result["confidence"]))
    if rank != 0:
        return None
    result["predictions"] = np.concatenate([p for p, _ in shards])
    result["confidence"] = np.concatenate([c for _, c in shards])
    return result


def _score_on_ray(weights: dict, data, amp: str, num_workers: int, use_gpu: bool,
                  address: str | None) -> dict[str, Any]:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrain_mnist import cluster

    address = cluster.resolve_address(address)
    local = address is None and not ray.is_initialized()
    threads = cluster.default_cpus_per_worker(num_workers, local)
    storage = tempfile.mkdtemp(prefix="raytrain_mnist-evaluate-")
    try:
        with cluster.connect(address, cluster.Request(num_workers, threads, use_gpu)):
            trainer = TorchTrainer(
                _score_per_worker,
                train_loop_config={"weights": ray.put(weights), "amp": amp, "threads": threads,
                                   "data": ray.put((data.test_images, data.test_labels))},
                scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                             resources_per_worker={"CPU": threads}),
                run_config=RunConfig(name="evaluate", storage_path=storage,
                                     logging_config=ray.LoggingConfig(log_level="WARNING")),
            )
            try:
                return trainer.fit().return_value
            except ray.train.TrainingFailedError as exc:
                lines = [line for line in str(exc).splitlines() if line.strip()]
                raise UserError(f"evaluation failed: {lines[-1].strip() if lines else exc}")
    finally:
        shutil.rmtree(storage, ignore_errors=True)


# --------------------------------------------------------------------------- the command

def evaluate_checkpoint(target: str | os.PathLike, data_dir: str | None = None,
                        dataset: str | None = None, out: str | os.PathLike | None = None,
                        num_workers: int = 1, use_gpu: bool = False,
                        address: str | None = None) -> dict[str, Any]:
    """Evaluate ``target`` and write the report; returns what ``evaluation.json`` holds,
    plus ``out`` (the folder written) and ``files`` (its paths)."""
    if num_workers < 1:
        raise ConfigError(f"--num-workers must be an integer >= 1, got {num_workers}")
    if dataset is not None and dataset not in DATASET_CHOICES:
        raise ConfigError(f"--dataset must be one of {', '.join(DATASET_CHOICES)}; "
                          f"got {dataset!r}")
    from raytrain_mnist import checkpoint as ckpt

    resolved = resolve_target(target)
    state = ckpt.load(resolved.checkpoint)  # CheckpointError (one line) when it is not one
    model = ckpt.load_model(resolved.checkpoint)
    checkpoint_dir = (resolved.checkpoint if resolved.checkpoint.is_dir()
                      else resolved.checkpoint.parent)
    out_dir = (Path(out).expanduser() if out is not None
               else checkpoint_dir.parent / f"evaluation_{checkpoint_dir.name}")
    data = load_test_data(resolved.summary, data_dir, dataset)
    amp = (state.get("config") or {}).get("amp", "off")  # score as training did

    if num_workers == 1 and address is None:
        import torch

        if use_gpu and not torch.cuda.is_available():
            raise UserError("--use-gpu: no GPU is visible to this process", EXIT_USAGE)
        device = torch.device("cuda" if use_gpu else "cpu")
        result = score(model.to(device), data.test_images, data.test_labels, device, amp)
    else:
        result = _score_on_ray(model.state_dict(), data, amp, num_workers, use_gpu, address)
    return _write_report(result, data, state, resolved, out_dir, num_workers)


def _write_report(result, data, state, resolved: Target, out_dir: Path,
                  num_workers: int) -> dict[str, Any]:
    import numpy as np

    from raytrain_mnist import plots

    labels = data.test_labels.numpy()
    predictions, confidence = result["predictions"], result["confidence"]
    counts = plots.confusion_matrix(labels, predictions)
    # The all-reduced count and the gathered predictions must tell the same story.
    assert int(np.trace(counts)) == round(result["val_accuracy"] * result["val_total"])
    totals = counts.sum(1)
    per_class = {str(c): (float(counts[c, c] / totals[c]) if totals[c] else None)
                 for c in range(len(counts))}
    epoch = state.get("epoch")
    reported = next((h.get("val_accuracy") for h in state.get("history", [])
                     if h.get("epoch") == epoch), None)
    wrong = np.flatnonzero(labels != predictions)
    wrong = wrong[np.argsort(-confidence[wrong], kind="stable")][:_TOP_WRONG]
    summary = resolved.summary or {}
    report = {
        "checkpoint": str(resolved.checkpoint.resolve()),
        "epoch": epoch,
        "run": summary.get("name"),
        "accuracy": result["val_accuracy"],
        "loss": result["val_loss"],
        "correct": int(np.trace(counts)),
        "test_size": result["val_total"],
        "per_class_accuracy": per_class,
        "per_class_size": {str(c): int(t) for c, t in enumerate(totals)},
        "confusion_matrix": counts.tolist(),
        "reported_val_accuracy": reported,
        "dataset": data.kind,
        "data_source": data.source,
        "num_workers": num_workers,
        "most_confident_errors": [
            {"index": int(i), "label": int(labels[i]), "predicted": int(predictions[i]),
             "confidence": float(confidence[i])} for i in wrong],
    }
    name = summary.get("name") or resolved.checkpoint.name
    title = (f"{name}, epoch {epoch}: {100 * report['accuracy']:.2f} % of "
             f"{report['test_size']} test images ({data.kind})")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        files = {
            EVALUATION_FILE: json.dumps(report, indent=2).encode(),
            CONFUSION_FILE: plots.confusion_matrix_png(counts, title),
            MISCLASSIFIED_FILE: plots.misclassified_png(
                data.test_images.numpy(), labels, predictions, confidence,
                f"{name}: the most confidently wrong test digits", limit=_TOP_WRONG),
        }
        for file_name, payload in files.items():
            (out_dir / file_name).write_bytes(payload)
    except OSError as exc:
        raise UserError(f"cannot write the evaluation into {out_dir} ({exc.strerror or exc}); "
                        "pass --out DIR", EXIT_USAGE) from exc
    return {**report, "out": str(out_dir), "files": [str(out_dir / f) for f in files]}


def format_report(report: dict[str, Any]) -> str:
    lines = [f"checkpoint: {report['checkpoint']} (epoch {report['epoch']})",
             f"test set:   {report['test_size']} images, {report['data_source']}",
             f"accuracy {100 * report['accuracy']:.2f}% ({report['correct']}/"
             f"{report['test_size']}), loss {report['loss']:.4f}"
             + ("" if report["reported_val_accuracy"] is None else
                f"; fit reported {100 * report['reported_val_accuracy']:.2f}% for this epoch"),
             "", f"{'digit':>5} {'accuracy':>9} {'images':>7}"]
    for digit, accuracy in report["per_class_accuracy"].items():
        shown = "-" if accuracy is None else f"{100 * accuracy:.2f}%"
        lines.append(f"{digit:>5} {shown:>9} {report['per_class_size'][digit]:>7}")
    lines += ["", f"wrote {', '.join(Path(f).name for f in report['files'])} into "
                  f"{report['out']}"]
    return "\n".join(lines)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist evaluate",
        description="Score a checkpoint on the MNIST test set: accuracy per class, a confusion "
                    "matrix and the most confidently wrong digits.")
    parser.add_argument("target", metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a run directory (its best checkpoint), a checkpoint directory or "
                             "a state.pt file")
    parser.add_argument("--data-dir", help="MNIST in torchvision's layout; default: the "
                        "directory the run trained with")
    parser.add_argument("--dataset", choices=DATASET_CHOICES,
                        help="default: the data set the run trained on (must match when the "
                        "run is known), else auto")
    parser.add_argument("--out", metavar="DIR", help="where to write evaluation.json and the "
                        "PNGs (default: evaluation_<checkpoint>/ beside the checkpoint)")
    parser.add_argument("--num-workers", type=int, default=1,
                        help="Ray Train workers sharing the test set; 1 evaluates in this "
                        "process without Ray (default: 1)")
    parser.add_argument("--use-gpu", action="store_true", help="evaluate on GPU(s)")
    parser.add_argument("--address", help="Ray cluster address (host:port or auto); default: "
                        "$RAY_ADDRESS, else a local Ray when --num-workers > 1")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    address = args.address or (os.environ.get("RAY_ADDRESS") if args.num_workers > 1 else None)
    report = evaluate_checkpoint(args.target, args.data_dir, args.dataset, args.out,
                                 args.num_workers, args.use_gpu, address)
    print(format_report(report))
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
