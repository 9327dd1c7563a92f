"""``python -m raytrain_mnist.evaluate RUN_DIR_OR_CHECKPOINT``: score a checkpoint on the test set.

The target is a run directory (its ``summary.json`` names the best checkpoint), a Tune
experiment directory (its ``best.json`` does), a checkpoint directory (``fit``'s
``checkpoint_*`` or a Tune trial's) or a ``state.pt`` file. Weights are
loaded with ``weights_only=True``. The test set is the one the run trained with when the run
says so (``summary.json``: ``dataset``, ``data_source``, ``config.run.data_dir``), else
``--data-dir``/``--dataset``.

Scoring reuses :func:`raytrain_mnist.worker.score.evaluate` (exact shards, all-reduced sums): in this
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_mnist._cli import (
    ArgumentParser,
    Command,
    add_dataclass_args,
    dataclass_from_args,
    setup_logging,
)
from raytrain_mnist.config import CHECKPOINT_METRIC, DATASET_CHOICES, ConfigError, RunSettings
from raytrain_mnist.driver.runs import (
    BEST_FILE,
    RUNS_DIR,
    SEARCH_FILE,
    STATE_FILE,
    SUMMARY_FILE,
    Run,
    check_no_credentials,
    data_identity,
    is_uri,
)
from raytrain_mnist.errors import EXIT_USAGE, UserError, cause_line

EVALUATION_FILE = "evaluation.json"
CONFUSION_FILE = "confusion_matrix.png"
MISCLASSIFIED_FILE = "misclassified.png"
_TOP_WRONG = 32


@dataclass(frozen=True)
class Target:
    """What RUN_DIR_OR_CHECKPOINT resolved to."""

    checkpoint: str  # the checkpoint directory (a local path or a URI), or a bare state.pt
    summary: dict | None  # the summary of the run that wrote it, when found
    run: Run | None  # the run (or Tune experiment) it belongs to, when found


# --------------------------------------------------------------------------- resolving


def resolve_target(target: str | os.PathLike) -> Target:
    """A run directory (its best committed checkpoint), a Tune experiment directory (its
    best trial's), a checkpoint directory or a ``state.pt`` file; local or a URI.

    Only checkpoints that lie inside the run given are followed: a path recorded in a file
    of the run never leads elsewhere.
    """
    text = str(target)
    if is_uri(text):
        check_no_credentials(text, "RUN_DIR_OR_CHECKPOINT")
        run = Run.at(text)
        if run.is_file(STATE_FILE):
            return _checkpoint_target(text, run)
        if not run.exists():
            raise UserError(f"{text} does not exist", EXIT_USAGE)
        return _run_target(run)
    path = Path(text).expanduser()
    if not path.exists():
        raise UserError(
            f"{path} does not exist; pass a run directory, a checkpoint "
            f"directory or a {STATE_FILE} file",
            EXIT_USAGE,
        )
    if path.is_file() and path.name in (SUMMARY_FILE, BEST_FILE):
        path = path.parent
    if path.is_dir() and not (path / STATE_FILE).is_file():
        return _run_target(Run.at(path))
    if path.is_file():
        with path.open("rb") as f:
            if f.read(4) != b"PK\x03\x04":  # torch.save writes a zip archive
                raise UserError(
                    f"{path} is not a checkpoint: pass a run directory, a "
                    f"checkpoint directory or a {STATE_FILE} file",
                    EXIT_USAGE,
                )
    return _checkpoint_target(str(path.resolve()), None)


def _run_target(run: Run) -> Target:
    """A fit run (``summary.json``) or a Tune experiment (``best.json``)."""
    best = run.read_json(BEST_FILE)
    summary = run.summary()
    if summary is None and best is not None and run.is_file(SEARCH_FILE):
        trial = best.get("best_trial")
        if not trial:
            raise UserError(f"search {run.dir} has no trial with a result yet")
        trial_run = Run(f"{run.dir}/{RUNS_DIR}", str(trial))
        checkpoint = trial_run.best_checkpoint(
            best.get("metric", CHECKPOINT_METRIC), best.get("mode", "max")
        )
        if checkpoint is None:
            raise UserError(f"the best trial of {run.dir} ({trial}) kept no checkpoint")
        return Target(checkpoint, _search_summary(run), run)
    if summary is None:
        if run.local:
            found = sorted(Path(run.dir).glob(f"checkpoint_*/{STATE_FILE}"))
            hint = f"; pass one of its checkpoints, e.g. {found[-1].parent}" if found else ""
        else:
            hint = ""
        raise UserError(
            f"{run.dir} is neither a run directory (no {SUMMARY_FILE}) nor a "
            f"checkpoint (no {STATE_FILE}){hint}",
            EXIT_USAGE,
        )
    # Ray's record of what it committed names checkpoints relative to the run: always inside.
    checkpoint = run.best_checkpoint() or run.relocate(summary.get("best_checkpoint"))
    if checkpoint is None:
        raise UserError(
            f"run {run.dir} has no checkpoint (status: "
            f"{summary.get('status', 'unknown')}); train it first"
        )
    return Target(checkpoint, summary, run)


def _checkpoint_target(checkpoint: str, run: Run | None) -> Target:
    """A checkpoint inside a run says which data it used: the run's summary, or a Tune
    experiment's search record (``<experiment>/runs/<trial>/checkpoint_*``)."""
    parents = _parents(checkpoint)
    for parent in parents[:4]:
        owner = Run.at(parent)
        summary = _quietly(owner.summary)
        if summary is not None and "dataset" in summary:
            return Target(checkpoint, summary, owner)
        search = _quietly(lambda owner=owner: owner.read_json(SEARCH_FILE))
        if search is not None and search.get("dataset") in ("mnist", "sample"):
            return Target(checkpoint, _search_summary(owner, search), owner)
    return Target(checkpoint, None, run)


def _parents(path: str) -> list[str]:
    if is_uri(path):
        scheme, _, rest = path.partition("://")
        parts = rest.rstrip("/").split("/")
        return [f"{scheme}://{'/'.join(parts[:i])}" for i in range(len(parts) - 1, 1, -1)]
    return [str(p) for p in Path(path).parents]


def _search_summary(experiment: Run, search: dict | None = None) -> dict:
    search = search if search is not None else (experiment.read_json(SEARCH_FILE) or {})
    return {"dataset": search.get("dataset"), "name": experiment.name, "data": search.get("data")}


def _quietly(read):
    try:
        return read()
    except UserError:
        return None


# --------------------------------------------------------------------------- data


def load_test_data(summary: dict | None, data_dir: str | None, dataset: str | None):
    """The test set the run was scored on while it trained, when the run says which."""
    from raytrain_mnist.data import load_mnist

    trained_on = (summary or {}).get("dataset")
    if trained_on is None:
        return load_mnist(data_dir, dataset or "auto")
    if dataset not in (None, "auto", trained_on):
        raise UserError(
            f"this checkpoint was trained and scored on the {trained_on!r} data "
            f"set; evaluating it on {dataset!r} would not measure the same thing "
            f"(drop --dataset or pass --dataset {trained_on})",
            EXIT_USAGE,
        )
    if trained_on == "sample":
        data = load_mnist(None, "sample")
    else:
        recorded = ((summary.get("config") or {}).get("run") or {}).get("data_dir")
        if data_dir is None and recorded is not None and not Path(recorded).is_dir():
            raise UserError(
                f"the run read MNIST from {recorded}, which is not a directory "
                "here; pass --data-dir",
                EXIT_USAGE,
            )
        data = load_mnist(data_dir or recorded, "mnist")
    expected = summary.get("test_size")
    if expected is not None and data.test_size != expected:
        raise UserError(
            f"the run was scored on {expected} test images, {data.source} holds "
            f"{data.test_size}; pass the --data-dir it trained with",
            EXIT_USAGE,
        )
    published = "checksums match the published MNIST"
    trained_source = summary.get("data_source")
    if trained_source and (published in trained_source) != (published in data.source):
        raise UserError(
            f"the run trained on {summary.get('data_source')}, this is "
            f"{data.source}; pass the --data-dir it trained with",
            EXIT_USAGE,
        )
    return data


# --------------------------------------------------------------------------- scoring


def _score_on_ray(weights: dict, data, amp: str, run: RunSettings) -> dict[str, Any]:
    """Score on ``run.num_workers`` Ray Train workers, built as fit builds its trainer."""
    import ray

    from raytrain_mnist.driver import cluster
    from raytrain_mnist.driver.trainer import build_trainer
    from raytrain_mnist.worker.score import score_per_worker

    address = cluster.resolve_address(run.address)
    local = address is None and not ray.is_initialized()
    cpus_per_worker = run.cpus_per_worker or cluster.default_cpus_per_worker(run.num_workers, local)
    storage = tempfile.mkdtemp(prefix="raytrain_mnist-evaluate-")
    try:
        with cluster.connect(address, cluster.Request.for_run(run, cpus_per_worker)):
            config = {
                "weights": ray.put(weights),
                "amp": amp,
                "cpus_per_worker": cpus_per_worker,
                "data": ray.put((data.test_images, data.test_labels)),
            }
            trainer = build_trainer(
                run, score_per_worker, config, cpus_per_worker, storage, "evaluate"
            )
            try:
                return trainer.fit().return_value
            except ray.train.TrainingFailedError as exc:
                raise UserError(f"evaluation failed: {cause_line(exc)}") from exc
    finally:
        shutil.rmtree(storage, ignore_errors=True)


# --------------------------------------------------------------------------- the command

#: Run settings that evaluate's several-worker mode takes, as fit takes them.
WORKER_SETTINGS = (
    "num_workers",
    "use_gpu",
    "gpus_per_worker",
    "cpus_per_worker",
    "backend",
    "init_method",
    "placement_strategy",
    "socket_ifname",
    "address",
)


def evaluate_checkpoint(
    target: str | os.PathLike,
    data_dir: str | None = None,
    dataset: str | None = None,
    out: str | os.PathLike | None = None,
    num_workers: int = 1,
    use_gpu: bool = False,
    address: str | None = None,
    overwrite: bool = False,
    workers: RunSettings | None = None,
) -> dict[str, Any]:
    """Evaluate ``target`` and write the report; returns what ``evaluation.json`` holds,
    plus ``out`` (the folder written) and ``files`` (its paths). ``workers`` (run settings
    as fit takes them) overrides ``num_workers``/``use_gpu``/``address``."""
    if workers is None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ConfigError(f"--num-workers must be an integer >= 1, got {num_workers}")
        workers = RunSettings(num_workers=num_workers, use_gpu=use_gpu, address=address)
    if dataset is not None and dataset not in DATASET_CHOICES:
        raise ConfigError(f"--dataset must be one of {', '.join(DATASET_CHOICES)}; got {dataset!r}")
    resolved = resolve_target(target)
    state, model = load_checkpoint(resolved.checkpoint)  # one line when it is not one
    data = load_test_data(resolved.summary, data_dir, dataset)
    _check_same_data(resolved, data)
    out_dir = _out_dir(resolved, out)
    if not overwrite:
        existing = [f for f in REPORT_FILES if (out_dir / f).exists()]
        if existing:
            raise UserError(
                f"{out_dir} already holds {', '.join(existing)}; pass --overwrite "
                "to replace it, or --out DIR",
                EXIT_USAGE,
            )
    amp = (state.get("config") or {}).get("amp", "off")  # score as training did

    if workers.num_workers == 1 and workers.address is None:
        import torch

        if workers.use_gpu and not torch.cuda.is_available():
            raise UserError("--use-gpu: no GPU is visible to this process", EXIT_USAGE)
        device = torch.device("cuda" if workers.use_gpu else "cpu")
        from raytrain_mnist.worker.score import score

        result = score(model.to(device), data.test_images, data.test_labels, device, amp)
    else:
        result = _score_on_ray(model.state_dict(), data, amp, workers)
    return _write_report(result, data, state, resolved, out_dir, workers.num_workers)


REPORT_FILES = (EVALUATION_FILE, CONFUSION_FILE, MISCLASSIFIED_FILE)


def load_checkpoint(checkpoint: str) -> tuple[dict, Any]:
    """The checkpoint's state and its model, read once with ``weights_only=True`` (a URI is
    downloaded first). :class:`~raytrain_mnist.worker.checkpoint.CheckpointError` when unusable."""
    from raytrain_mnist.worker import checkpoint as ckpt

    with Run.at(checkpoint).local_copy(checkpoint) as local:
        state = ckpt.load(local)
        return state, ckpt.model_from(state, local)


def _check_same_data(resolved: Target, data) -> None:
    """The run's identity record names the data it trained and was scored on."""
    if resolved.run is None:
        return
    record = (_quietly(resolved.run.identity) or resolved.summary or {}).get("data")
    if not record or "sha1" not in record:
        return
    found = data_identity(data)
    if found["sha1"] != record["sha1"]:
        raise UserError(
            f"{data.source} is not the data run '{resolved.run.name}' trained on "
            f"({record['kind']}, {record['train_size']} train / "
            f"{record['test_size']} test images); pass the --data-dir it "
            "trained with",
            EXIT_USAGE,
        )


def _out_dir(resolved: Target, out: str | os.PathLike | None) -> Path:
    """``--out``, else ``evaluation_<checkpoint>/`` beside a local checkpoint, else (a
    checkpoint on an object store) ``evaluation_<run>_<checkpoint>/`` here."""
    if out is not None:
        return Path(out).expanduser()
    checkpoint = resolved.checkpoint.rstrip("/")
    if not is_uri(checkpoint):
        path = Path(checkpoint)
        directory = path if path.is_dir() else path.parent
        return directory.parent / f"evaluation_{directory.name}"
    parts = checkpoint.split("/")
    name = parts[-1] if parts[-1] != STATE_FILE else parts[-2]
    run = resolved.run.name if resolved.run is not None else "checkpoint"
    return Path.cwd() / f"evaluation_{run}_{name}"


def _write_report(
    result, data, state, resolved: Target, out_dir: Path, num_workers: int
) -> dict[str, Any]:
    import numpy as np

    from raytrain_mnist.driver import plots

    labels = data.test_labels.numpy()
    predictions, confidence = result["predictions"], result["confidence"]
    counts = plots.confusion_matrix(labels, predictions)
    # The all-reduced count and the gathered predictions must tell the same story.
    assert int(np.trace(counts)) == round(result["val_accuracy"] * result["val_total"])
    totals = counts.sum(1)
    per_class = {
        str(c): (float(counts[c, c] / totals[c]) if totals[c] else None) for c in range(len(counts))
    }
    epoch = state.get("epoch")
    reported = next(
        (h.get("val_accuracy") for h in state.get("history", []) if h.get("epoch") == epoch), None
    )
    wrong = np.flatnonzero(labels != predictions)
    wrong = wrong[np.argsort(-confidence[wrong], kind="stable")][:_TOP_WRONG]
    summary = resolved.summary or {}
    report = {
        "checkpoint": resolved.checkpoint,
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
            {
                "index": int(i),
                "label": int(labels[i]),
                "predicted": int(predictions[i]),
                "confidence": float(confidence[i]),
            }
            for i in wrong
        ],
    }
    name = summary.get("name") or resolved.checkpoint.rstrip("/").rpartition("/")[2]
    title = (
        f"{name}, epoch {epoch}: {100 * report['accuracy']:.2f} % of "
        f"{report['test_size']} test images ({data.kind})"
    )
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        files = {
            EVALUATION_FILE: json.dumps(report, indent=2).encode(),
            CONFUSION_FILE: plots.confusion_matrix_png(counts, title),
            MISCLASSIFIED_FILE: plots.misclassified_png(
                data.test_images.numpy(),
                labels,
                predictions,
                confidence,
                f"{name}: the most confidently wrong test digits",
                limit=_TOP_WRONG,
            ),
        }
        for file_name, payload in files.items():
            (out_dir / file_name).write_bytes(payload)
    except OSError as exc:
        raise UserError(
            f"cannot write the evaluation into {out_dir} ({exc.strerror or exc}); pass --out DIR",
            EXIT_USAGE,
        ) from exc
    return {**report, "out": str(out_dir), "files": [str(out_dir / f) for f in files]}


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"checkpoint: {report['checkpoint']} (epoch {report['epoch']})",
        f"test set:   {report['test_size']} images, {report['data_source']}",
        f"accuracy {100 * report['accuracy']:.2f}% ({report['correct']}/"
        f"{report['test_size']}), loss {report['loss']:.4f}"
        + (
            ""
            if report["reported_val_accuracy"] is None
            else f"; fit reported {100 * report['reported_val_accuracy']:.2f}% for this epoch"
        ),
        "",
        f"{'digit':>5} {'accuracy':>9} {'images':>7}",
    ]
    for digit, accuracy in report["per_class_accuracy"].items():
        shown = "-" if accuracy is None else f"{100 * accuracy:.2f}%"
        lines.append(f"{digit:>5} {shown:>9} {report['per_class_size'][digit]:>7}")
    lines += ["", f"wrote {', '.join(Path(f).name for f in report['files'])} into {report['out']}"]
    return "\n".join(lines)


def add_target_argument(parser: ArgumentParser) -> None:
    """RUN_DIR_OR_CHECKPOINT, as :func:`resolve_target` takes it (evaluate and serve)."""
    parser.add_argument(
        "target",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run directory (its best checkpoint), a Tune experiment (its "
        "best trial's), a checkpoint directory or a state.pt file; a "
        "local path or a URI such as s3://bucket/runs/NAME",
    )


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist evaluate",
        description="Score a checkpoint on the MNIST test set: accuracy per class, a confusion "
        "matrix and the most confidently wrong digits.",
    )
    add_target_argument(parser)
    parser.add_argument(
        "--data-dir",
        help="MNIST in torchvision's layout; default: the directory the run trained with",
    )
    parser.add_argument(
        "--dataset",
        choices=DATASET_CHOICES,
        help="default: the data set the run trained on (must match when the "
        "run is known), else auto",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="where to write evaluation.json and the "
        "PNGs (default: evaluation_<checkpoint>/ beside the checkpoint)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an evaluation already in --out (default: refuse)",
    )
    add_dataclass_args(
        parser,
        RunSettings,
        "workers (Ray Train, when --num-workers > 1 or --address is given; as in fit)",
        only=WORKER_SETTINGS,
        defaults={"num_workers": 1},
    )
    return parser


@dataclass(frozen=True)
class EvaluateOptions:
    target: str
    data_dir: str | None
    dataset: str | None
    out: str | None
    overwrite: bool
    workers: RunSettings


def parse_options(argv: Sequence[str]) -> EvaluateOptions:
    args = build_parser().parse_args(argv)
    if args.address is None and args.num_workers > 1:
        args.address = os.environ.get("RAY_ADDRESS") or None
    workers = dataclass_from_args(RunSettings, args, only=WORKER_SETTINGS)
    return EvaluateOptions(
        args.target, args.data_dir, args.dataset, args.out, args.overwrite, workers
    )


def run(options: EvaluateOptions) -> int:
    setup_logging()
    report = evaluate_checkpoint(
        options.target,
        options.data_dir,
        options.dataset,
        options.out,
        overwrite=options.overwrite,
        workers=options.workers,
    )
    print(format_report(report))
    return 0


COMMAND = Command("evaluate", build_parser, parse_options, run)
cli = COMMAND.main


if __name__ == "__main__":
    sys.exit(COMMAND.main())
