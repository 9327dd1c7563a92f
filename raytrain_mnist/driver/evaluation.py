"""Score a checkpoint on the test set: :func:`evaluate_checkpoint` returns an
:class:`Evaluation` and writes its report. Library code: it never prints.

The target is resolved by :mod:`raytrain_mnist.driver.targets`. Weights are loaded with
``weights_only=True``. The test set is the one the run trained with when the run says so
(``summary.json``: ``dataset``, ``data_source``, ``config.run.data_dir``), else
``data_dir``/``dataset``.

Scoring is :func:`raytrain_mnist.nn.score.score` (exact shards, all-reduced sums): in
this process with one worker, on a ``TorchTrainer`` running
:func:`~raytrain_mnist.worker.score.score_per_worker` with several. Each image's prediction
comes back with it, for the confusion matrix and the most confidently wrong digits.

The report is ``evaluation.json`` (:meth:`Evaluation.to_dict`), ``confusion_matrix.png`` and
``misclassified.png``, in ``out`` (default: ``evaluation_<checkpoint>/`` beside the
checkpoint), each written through a temporary file beside it and an atomic rename; a folder or
a report path that is a symbolic link is refused (evaluate never writes through a link it did
not make).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_mnist.config import DATASET_CHOICES, ConfigError, RunSettings
from raytrain_mnist.driver.runs import STATE_FILE, Run, data_identity, is_uri
from raytrain_mnist.driver.runs.storage import atomic_write
from raytrain_mnist.driver.targets import Target, quietly, resolve_target
from raytrain_mnist.errors import EXIT_USAGE, UserError, cause_line

logger = logging.getLogger(__name__)

EVALUATION_FILE = "evaluation.json"
CONFUSION_FILE = "confusion_matrix.png"
MISCLASSIFIED_FILE = "misclassified.png"
REPORT_FILES = (EVALUATION_FILE, CONFUSION_FILE, MISCLASSIFIED_FILE)
#: The most confidently wrong digits the report lists and draws.
TOP_WRONG = 32

#: The run settings evaluate's several-worker mode takes, as fit takes them.
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


@dataclass(frozen=True)
class Evaluation:
    """One checkpoint scored on a test set: what ``evaluation.json`` holds (its fields up
    to ``most_confident_errors``, in that order), and where the report was written."""

    checkpoint: str  # the checkpoint scored (a local path or a URI)
    epoch: int | None  # the epoch it was saved after
    run: str | None  # the name of the run that wrote it, when known
    accuracy: float
    loss: float
    correct: int
    test_size: int
    per_class_accuracy: dict[str, float | None]  # "0".."9"; None for a digit with no image
    per_class_size: dict[str, int]
    confusion_matrix: list[list[int]]  # counts[true][predicted]
    reported_val_accuracy: float | None  # what fit reported for this epoch, when recorded
    dataset: str  # "mnist" or "sample"
    data_source: str
    num_workers: int
    most_confident_errors: list[dict]  # index, label, predicted, confidence; most sure first
    out: Path  # the folder the report was written into
    files: tuple[Path, ...]  # the files written there

    def to_dict(self) -> dict[str, Any]:
        """What ``evaluation.json`` holds."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("out", "files")
        }


def evaluate_checkpoint(
    target: str | os.PathLike,
    *,
    data_dir: str | None = None,
    dataset: str | None = None,
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    workers: RunSettings | None = None,
) -> Evaluation:
    """Score ``target`` (RUN_DIR_OR_CHECKPOINT, :func:`~targets.resolve_target`) on its test
    set and write the report into ``out``.

    ``workers``: run settings as fit takes them (those in :data:`WORKER_SETTINGS` count):
    one worker and no address (the default) scores in this process, on its GPU with
    ``use_gpu``; otherwise on Ray Train workers. ``overwrite`` replaces a report already in
    ``out`` (default: refuse). Bad input is a :class:`ConfigError` or :class:`UserError`.
    """
    workers = workers if workers is not None else RunSettings.from_flags(num_workers=1)
    if workers.scaling.elastic:
        raise ConfigError(f"--num-workers must be a count >= 1, got {workers.scaling.num_workers}")
    if dataset is not None and dataset not in DATASET_CHOICES:
        raise ConfigError(f"--dataset must be one of {', '.join(DATASET_CHOICES)}; got {dataset!r}")
    resolved = resolve_target(target)
    state, model = load_checkpoint(resolved.checkpoint)  # one line when it is not one
    data = load_test_data(resolved.summary, data_dir, dataset)
    _check_same_data(resolved, data)
    out_dir = _out_dir(resolved, out)
    _check_no_links(out_dir)
    if not overwrite:
        existing = [f for f in REPORT_FILES if (out_dir / f).exists()]
        if existing:
            raise UserError(
                f"{out_dir} already holds {', '.join(existing)}; pass --overwrite "
                "to replace it, or --out DIR",
                EXIT_USAGE,
            )
    amp = (state.get("config") or {}).get("amp", "off")  # score as training did

    if workers.scaling.num_workers == 1 and workers.address is None:
        import torch

        from raytrain_mnist.nn.score import score

        if workers.scaling.use_gpu and not torch.cuda.is_available():
            raise UserError("--use-gpu: no GPU is visible to this process", EXIT_USAGE)
        device = torch.device("cuda" if workers.scaling.use_gpu else "cpu")
        logger.debug("scoring %s in this process on %s", resolved.checkpoint, device)
        images, labels = torch.from_numpy(data.test_images), torch.from_numpy(data.test_labels)
        result = score(model.to(device), images, labels, device, amp)
    else:
        result = _score_on_ray(model.state_dict(), data, amp, workers)
    return _write_report(result, data, state, resolved, out_dir, workers.scaling.num_workers)


def load_checkpoint(checkpoint: str) -> tuple[dict, Any]:
    """The checkpoint's state and its model, read once with ``weights_only=True`` (a URI is
    downloaded first). :class:`~raytrain_mnist.nn.checkpoint.CheckpointError` when unusable."""
    from raytrain_mnist.nn import checkpoint as ckpt

    with Run.at(checkpoint).local_copy(checkpoint) as local:
        state = ckpt.load(local)
        return state, ckpt.model_from(state, local)


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
        # The run's own record of where it read MNIST is followed, when nothing else was
        # asked for: it is the data the run was scored on. A planted summary.json can name
        # any directory, but that reads no arbitrary file: load_mnist opens only the four
        # fixed IDX names (train-/t10k-images-idx3-ubyte, -labels-idx1-ubyte, or .gz) in
        # DIR/MNIST/raw, DIR/raw or DIR, parses them as IDX with its size bounds, and the
        # data must then match the fingerprint of the run's identity (_check_same_data).
        # A string that names no directory here is an error asking for --data-dir; a value
        # that is not a string is not followed at all.
        recorded = _field(_field(summary, "config"), "run").get("data_dir")
        if not isinstance(recorded, str) or not recorded:
            recorded = None
        if data_dir is None and recorded is not None and not Path(recorded).is_dir():
            raise UserError(
                f"the run read MNIST from {recorded}, which is not a directory "
                "here; pass --data-dir",
                EXIT_USAGE,
            )
        data = load_mnist(data_dir or recorded, "mnist")
    expected = summary.get("test_size")
    if isinstance(expected, int) and data.test_size != expected:
        raise UserError(
            f"the run was scored on {expected} test images, {data.source} holds "
            f"{data.test_size}; pass the --data-dir it trained with",
            EXIT_USAGE,
        )
    published = "checksums match the published MNIST"
    trained_source = summary.get("data_source")
    if (
        isinstance(trained_source, str)
        and trained_source
        and (published in trained_source) != (published in data.source)
    ):
        raise UserError(
            f"the run trained on {summary.get('data_source')}, this is "
            f"{data.source}; pass the --data-dir it trained with",
            EXIT_USAGE,
        )
    return data


def _field(record: Any, key: str) -> dict:
    """``record[key]`` when both are JSON objects, else {}: a run's files are read, never
    trusted to have our shape."""
    value = record.get(key) if isinstance(record, dict) else None
    return value if isinstance(value, dict) else {}


def _check_same_data(resolved: Target, data) -> None:
    """The run's identity record names the data it trained and was scored on."""
    if resolved.run is None:
        return
    record = _field(quietly(resolved.run.identity) or resolved.summary, "data")
    if "sha1" not in record:
        return
    found = data_identity(data)
    if found["sha1"] != record["sha1"]:
        raise UserError(
            f"{data.source} is not the data run '{resolved.run.name}' trained on "
            f"({record.get('kind')}, {record.get('train_size')} train / "
            f"{record.get('test_size')} test images); pass the --data-dir it "
            "trained with",
            EXIT_USAGE,
        )


def _out_dir(resolved: Target, out: str | os.PathLike | None) -> Path:
    """``out``, else ``evaluation_<checkpoint>/`` beside a local checkpoint, else (a
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


def _check_no_links(out_dir: Path) -> None:
    """Refuse (exit 2) a report folder, or a report file in it, that is a symbolic link:
    the report is written only where its path says, never through a link someone else
    planted (a checkpoint's default report folder lies inside a run anyone with access to
    the storage may write)."""
    for path in (out_dir, *(out_dir / name for name in REPORT_FILES)):
        if path.is_symlink():
            raise UserError(
                f"{path} is a symbolic link; evaluate does not write through links: "
                "remove it or pass --out DIR",
                EXIT_USAGE,
            )


def _score_on_ray(weights: dict, data, amp: str, run: RunSettings) -> dict[str, Any]:
    """Score on ``run.scaling.num_workers`` Ray Train workers, built as fit builds its trainer."""
    import ray

    from raytrain_mnist.driver import cluster
    from raytrain_mnist.driver.trainer import build_trainer
    from raytrain_mnist.worker import score_per_worker

    address = cluster.resolve_address(run.address)
    local = address is None and not ray.is_initialized()
    cpus_per_worker = run.scaling.cpus_per_worker or cluster.default_cpus_per_worker(
        run.scaling.num_workers, local
    )
    storage = tempfile.mkdtemp(prefix="raytrain_mnist-evaluate-")
    try:
        with cluster.connect(address, cluster.Request.for_run(run, cpus_per_worker)) as own:
            config = {
                "weights": ray.put(weights),
                "amp": amp,
                "cpus_per_worker": cpus_per_worker,
                "data": ray.put((data.test_images, data.test_labels)),
            }
            trainer = build_trainer(
                run, score_per_worker, config, cpus_per_worker, storage, "evaluate", own_ray=own
            )
            try:
                with cluster.keeping_sigint_handler():
                    return trainer.fit().return_value
            except ray.train.TrainingFailedError as exc:
                raise UserError(f"evaluation failed: {cause_line(exc)}") from exc
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def _write_report(
    result: dict[str, Any], data, state: dict, resolved: Target, out_dir: Path, num_workers: int
) -> Evaluation:
    from raytrain_mnist.driver import plots

    labels = data.test_labels
    counts = plots.confusion_matrix(labels, result["predictions"])
    evaluation = _evaluation(result, data, state, resolved, counts, out_dir, num_workers)
    name = (resolved.summary or {}).get("name") or resolved.checkpoint.rstrip("/").rpartition("/")[
        2
    ]
    title = (
        f"{name}, epoch {evaluation.epoch}: {100 * evaluation.accuracy:.2f} % of "
        f"{evaluation.test_size} test images ({data.kind})"
    )
    try:
        _check_no_links(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        files = {
            EVALUATION_FILE: json.dumps(evaluation.to_dict(), indent=2).encode(),
            CONFUSION_FILE: plots.confusion_matrix_png(counts, title),
            MISCLASSIFIED_FILE: plots.misclassified_png(
                data.test_images,
                labels,
                result["predictions"],
                result["confidence"],
                f"{name}: the most confidently wrong test digits",
                limit=TOP_WRONG,
            ),
        }
        _check_no_links(out_dir)  # again: the folder may have been made meanwhile
        for file_name, payload in files.items():
            atomic_write(out_dir / file_name, payload)
    except OSError as exc:
        raise UserError(
            f"cannot write the evaluation into {out_dir} ({exc.strerror or exc}); pass --out DIR",
            EXIT_USAGE,
        ) from exc
    return evaluation


def _evaluation(
    result: dict[str, Any], data, state: dict, resolved: Target, counts, out_dir: Path, workers: int
) -> Evaluation:
    """The scores as an :class:`Evaluation`: per class, confusion, the most confident errors."""
    import numpy as np

    from raytrain_mnist.driver import plots

    labels = data.test_labels
    predictions, confidence = result["predictions"], result["confidence"]
    # The all-reduced count and the gathered predictions must tell the same story.
    assert int(np.trace(counts)) == round(result["val_accuracy"] * result["val_total"])
    totals = counts.sum(1)
    epoch = state.get("epoch")
    wrong = plots.most_confident_errors(labels, predictions, confidence, TOP_WRONG)
    return Evaluation(
        checkpoint=resolved.checkpoint,
        epoch=epoch,
        run=(resolved.summary or {}).get("name"),
        accuracy=result["val_accuracy"],
        loss=result["val_loss"],
        correct=int(np.trace(counts)),
        test_size=result["val_total"],
        per_class_accuracy={
            str(c): (float(counts[c, c] / totals[c]) if totals[c] else None)
            for c in range(len(counts))
        },
        per_class_size={str(c): int(t) for c, t in enumerate(totals)},
        confusion_matrix=counts.tolist(),
        reported_val_accuracy=next(
            (h.get("val_accuracy") for h in state.get("history", []) if h.get("epoch") == epoch),
            None,
        ),
        dataset=data.kind,
        data_source=data.source,
        num_workers=workers,
        most_confident_errors=[
            {
                "index": int(i),
                "label": int(labels[i]),
                "predicted": int(predictions[i]),
                "confidence": float(confidence[i]),
            }
            for i in wrong
        ],
        out=out_dir,
        files=tuple(out_dir / f for f in REPORT_FILES),
    )
