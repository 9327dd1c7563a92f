"""What a run's files say: its identity, its summary, and Ray Train's record of the
checkpoints it committed. Reads and writes go through :class:`.storage.RunStorage`.

* **identity**: ``run.json`` (a search's ``search.json``): the training settings, the data set
  asked for and a fingerprint of the data actually used. The default name derives from the
  settings, a resume must match the identity, a run begun on the sample is never resumed on
  full MNIST.
* **summary**: ``summary.json``, written once at the end.
* **checkpoints**: Ray Train's ``checkpoint_manager_snapshot.json``: the latest, and the best
  by the metric the trainer ranks them by. A folder the record does not list is never taken
  for a checkpoint.
"""

from __future__ import annotations

import hashlib
from typing import Any

from raytrain_mnist.config import CHECKPOINT_METRIC, FitConfig, settings_digest
from raytrain_mnist.driver.runs.storage import RunStorage
from raytrain_mnist.errors import EXIT_USAGE, UserError

RUN_FILE = "run.json"
SUMMARY_FILE = "summary.json"
CURVES_FILE = "training_curves.png"
#: Written by Ray Train V2 each time it commits a checkpoint.
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
#: The file inside every checkpoint directory (checkpoint.STATE_FILE; not imported, to keep
#: this module free of torch).
STATE_FILE = "state.pt"
#: A Tune experiment's records: its identity (like a run's run.json) and its best trial.
SEARCH_FILE = "search.json"
BEST_FILE = "best.json"
#: ``<experiment>/runs/<trial id>``: each trial's Train run.
RUNS_DIR = "runs"


# --------------------------------------------------------------------------- identity


def data_identity(data) -> dict[str, Any]:
    """What a run trained on: the kind, the sizes and a fingerprint of the bytes."""
    digest = hashlib.sha1()
    for tensor in (data.train_images, data.train_labels, data.test_images, data.test_labels):
        digest.update(tensor.contiguous().numpy().tobytes())
    return {
        "kind": data.kind,
        "train_size": data.train_size,
        "test_size": data.test_size,
        "sha1": digest.hexdigest()[:16],
    }


def fit_identity(cfg: FitConfig, data) -> dict[str, Any]:
    """A fit run's identity record: what ``run.json`` holds and a resume must match.

    The worker count is not part of it (the batch is global: a run may resume on another
    number of workers), but it is part of the default name, so that runs on 1 and on 4
    workers do not meet by accident.
    """
    return {"train": cfg.train.to_dict(), "dataset": cfg.run.dataset, "data": data_identity(data)}


def default_name(cfg: FitConfig) -> str:
    """Deterministic (no timestamp): the same command finds the same run again."""
    if cfg.run.name:
        return cfg.run.name
    settings = {
        **cfg.train.to_dict(),
        "num_workers": cfg.run.num_workers,
        "use_gpu": cfg.run.use_gpu,
        "dataset": cfg.run.dataset,
    }
    return f"mnist-{cfg.run.num_workers}w-{settings_digest(settings)}"


def describe_difference(old: dict, new: dict) -> str:
    """``lr: 0.1 then, 0.05 now; data.kind: 'sample' then, 'mnist' now``."""

    def flat(record: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in record.items():
            if isinstance(value, dict):
                out.update(flat(value, "" if key == "train" else f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    before, now = flat(old), flat(new)
    changed = [
        f"{k}: {before.get(k)!r} then, {now[k]!r} now" for k in now if before.get(k) != now[k]
    ]
    return "; ".join(changed) or "unknown format"


class RunRecords:
    """A run's own records: its identity (``record``: run.json, or a search's search.json)
    and its summary."""

    def __init__(self, files: RunStorage, record: str = RUN_FILE) -> None:
        self.files = files
        self.record = record

    def identity(self) -> dict | None:
        return self.files.read_json(self.record)

    def summary(self) -> dict | None:
        return self.files.read_json(SUMMARY_FILE)

    def finished(self) -> dict | None:
        """The summary of a run that finished, else None."""
        summary = self.summary()
        return summary if summary and summary.get("status") == "finished" else None

    def check_identity(self, identity: dict, what: str = "run") -> None:
        """Refuse (exit 2) to continue a run that was started with other settings or data."""
        previous = self.identity()
        if previous is not None and previous != identity:
            raise UserError(
                f"{what} '{self.files.name}' in {self.files.root} was started with other "
                f"settings ({describe_difference(previous, identity)}); repeat its flags and "
                "data to resume it, pick another --name, or add --fresh",
                EXIT_USAGE,
            )


# --------------------------------------------------------------------------- checkpoints


class CheckpointRecord:
    """Ray Train's record of the checkpoints a run committed (``checkpoint_manager_snapshot
    .json``), read afresh at every call: Ray rewrites it at every commit."""

    def __init__(self, files: RunStorage) -> None:
        self.files = files

    def snapshot(self) -> dict:
        """Ray Train's record of the committed checkpoints ({} before the first)."""
        try:
            return self.files.read_json(SNAPSHOT_FILE) or {}
        except UserError:
            return {}  # Ray writes it; a torn read while it commits is not ours to report

    def checkpoints(self) -> list[tuple[str, dict]]:
        """(checkpoint directory, its metrics) of every committed, kept checkpoint."""
        return [
            (f"{self.files.dir}/{r['checkpoint_dir_name']}", r.get("metrics") or {})
            for r in self.snapshot().get("checkpoint_results") or []
            if r.get("checkpoint_dir_name")
        ]

    def latest_checkpoint(self) -> str | None:
        """The checkpoint a resume starts from."""
        latest = self.snapshot().get("latest_checkpoint_result") or {}
        name = latest.get("checkpoint_dir_name")
        return f"{self.files.dir}/{name}" if name else None

    def latest_metrics(self) -> dict:
        return (self.snapshot().get("latest_checkpoint_result") or {}).get("metrics") or {}

    def best_checkpoint(self, metric: str = CHECKPOINT_METRIC, mode: str = "max") -> str | None:
        """The kept checkpoint with the best ``metric`` (the latest on a tie)."""
        scored = [
            (m[metric], i, path)
            for i, (path, m) in enumerate(self.checkpoints())
            if isinstance(m.get(metric), (int, float))
        ]
        if not scored:
            return self.latest_checkpoint()
        pick = max if mode == "max" else min
        sign = 1 if mode == "max" else -1
        return pick(scored, key=lambda s: (s[0], sign * s[1]))[2]

    def relocate(self, recorded: str | None) -> str | None:
        """A checkpoint path recorded in this run's files, where it is now (the run may
        have moved since), or None when it does not lie inside this run."""
        if not recorded:
            return None
        if self.files.contains(recorded):
            return recorded
        name = recorded.rstrip("/").rpartition("/")[2]
        return f"{self.files.dir}/{name}" if name.startswith("checkpoint_") else None
