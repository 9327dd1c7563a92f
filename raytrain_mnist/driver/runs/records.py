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
import os
import time
from typing import Any

from raytrain_mnist.config import CHECKPOINT_METRIC, FitConfig, settings_digest
from raytrain_mnist.display import excerpt
from raytrain_mnist.driver.runs.storage import RunStorage, is_safe_name, parse_record
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
#: What a search's record holds beside its identity: where the search read MNIST (resolved),
#: for ``evaluate`` and ``serve`` of its trials. Not compared on a resume: another copy of
#: the same data is the same search (the data's fingerprint, ``data``, is compared).
DATA_DIR_KEY = "data_dir"
BEST_FILE = "best.json"
#: ``<experiment>/runs/<trial id>``: each trial's Train run.
RUNS_DIR = "runs"


# --------------------------------------------------------------------------- identity


def data_identity(data) -> dict[str, Any]:
    """What a run trained on: the kind, the sizes and a fingerprint of the bytes."""
    import numpy as np

    digest = hashlib.sha1()
    for array in (data.train_images, data.train_labels, data.test_images, data.test_labels):
        digest.update(np.ascontiguousarray(array).tobytes())
    return {
        "kind": data.kind,
        "train_size": data.train_size,
        "test_size": data.test_size,
        "sha1": digest.hexdigest()[:16],
    }


def fit_identity(cfg: FitConfig, data, data_id: dict | None = None) -> dict[str, Any]:
    """A fit run's identity record: what ``run.json`` holds and a resume must match.

    The worker count is not part of it (the batch is global: a run may resume on another
    number of workers), but it is part of the default name, so that runs on 1 and on 4
    workers do not meet by accident.
    """
    return {
        "train": cfg.train.to_dict(),
        "dataset": cfg.run.data.dataset,
        # A warm service's data is held by the service: it tells its identity (data_id).
        "data": data_identity(data) if data_id is None else data_id,
    }


def default_name(cfg: FitConfig) -> str:
    """Deterministic (no timestamp): the same command finds the same run again."""
    if cfg.run.storage.name:
        return cfg.run.storage.name
    settings = {
        **cfg.train.to_dict(),
        "num_workers": cfg.run.scaling.num_workers,
        "use_gpu": cfg.run.scaling.use_gpu,
        "dataset": cfg.run.data.dataset,
    }
    return f"mnist-{cfg.run.scaling.num_workers}w-{settings_digest(settings)}"


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
    changed = [  # the recorded value cut short: the record is read like input
        f"{k}: {excerpt(before.get(k))} then, {now[k]!r} now"
        for k in now
        if before.get(k) != now[k]
    ]
    return "; ".join(changed) or "unknown format"


class RunRecords:
    """A run's own records: its identity (``record``: run.json, or a search's search.json)
    and its summary."""

    def __init__(self, files: RunStorage, record: str = RUN_FILE) -> None:
        self.files = files
        self.record = record

    def identity(self) -> dict | None:
        return self.files.read_json(self.record, finite=True)  # settings: never NaN

    def summary(self) -> dict | None:
        return self.files.read_json(SUMMARY_FILE)

    def finished(self) -> dict | None:
        """The summary of a run that finished, else None."""
        summary = self.summary()
        return summary if summary and summary.get("status") == "finished" else None

    def check_identity(self, identity: dict, what: str = "run") -> None:
        """Refuse (exit 2) to continue a run that was started with other settings or data."""
        previous = self.identity()
        if isinstance(previous, dict):
            previous = {k: v for k, v in previous.items() if k != DATA_DIR_KEY}
        if previous is not None and previous != identity:
            raise UserError(
                f"{what} '{self.files.name}' in {self.files.root} was started with other "
                f"settings ({describe_difference(previous, identity)}); repeat its flags and "
                "data to resume it, pick another --name, or add --fresh",
                EXIT_USAGE,
            )


# --------------------------------------------------------------------------- checkpoints


class CorruptSnapshot(UserError):
    """Ray Train's record of the run's checkpoints cannot be trusted: not JSON, not the
    shape Ray writes, or naming a checkpoint that is not one folder inside the run. Never
    read as "no checkpoints" (a resume would silently start again at epoch 0), never
    followed (Ray would load, and later delete, what it names)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(
            f"cannot resume: {path} is corrupt ({reason}); move it away or pass --fresh"
        )


#: The snapshot's fields that hold one checkpoint's record each, lists of them, and lists of
#: checkpoint folder names (Ray Train V2's ``_CheckpointManagerState``). All optional here.
_ENTRY_FIELDS = ("latest_checkpoint_result",)
_ENTRY_LIST_FIELDS = ("checkpoint_results", "pending_training_results")
_NAME_LIST_FIELDS = (
    "validated_checkpoint_dir_names",
    "timed_out_validation_checkpoint_dir_names",
    "failed_validation_checkpoint_dir_names",
)
#: A read that finds a half-written snapshot (Ray rewrites it in place at every commit, and
#: ``evaluate`` may read a run that is still training) is tried again this often, this far
#: apart, before the file is called corrupt.
_SNAPSHOT_READS, _SNAPSHOT_RETRY_S = 3, 0.25


class CheckpointRecord:
    """Ray Train's record of the checkpoints a run committed (``checkpoint_manager_snapshot
    .json``), read afresh at every call: Ray rewrites it at every commit.

    Every checkpoint it names is checked before anything follows it: one safe path segment
    (:func:`~.storage.is_safe_name`), and on a local disk a folder whose resolved path stays
    inside the run (no link out of it). A snapshot that fails is :class:`CorruptSnapshot`.
    """

    def __init__(self, files: RunStorage) -> None:
        self.files = files

    @property
    def _where(self) -> str:
        return f"{self.files.dir}/{SNAPSHOT_FILE}"

    def snapshot(self) -> dict:
        """Ray Train's record of the committed checkpoints ({} before the first), checked;
        :class:`CorruptSnapshot` when it cannot be trusted."""
        for attempt in range(_SNAPSHOT_READS):
            raw = self.files.read_bytes(SNAPSHOT_FILE)  # one line when unreadable
            if raw is None:
                return {}
            try:
                value = parse_record(raw)  # Ray's metrics may hold NaN: a diverged run
                break
            except ValueError as exc:
                reason = str(exc)
                if attempt + 1 < _SNAPSHOT_READS:
                    time.sleep(_SNAPSHOT_RETRY_S)
        else:
            raise CorruptSnapshot(self._where, reason)
        self._check(value)
        return value

    def _check(self, value: Any) -> None:
        if not isinstance(value, dict):
            raise CorruptSnapshot(self._where, f"a JSON {type(value).__name__}, not an object")
        entries = []
        for field in _ENTRY_FIELDS:
            if value.get(field) is not None:
                entries.append((field, value[field]))
        for field in _ENTRY_LIST_FIELDS:
            listed = value.get(field)
            if listed is None:
                continue
            if not isinstance(listed, list):
                raise CorruptSnapshot(self._where, f"{field} is not a list")
            entries += [(f"{field}[{i}]", entry) for i, entry in enumerate(listed)]
        names = []
        for field, entry in entries:
            if not isinstance(entry, dict) or "checkpoint_dir_name" not in entry:
                raise CorruptSnapshot(self._where, f"{field} is not a checkpoint's record")
            if not isinstance(entry.get("metrics", {}), dict):
                raise CorruptSnapshot(self._where, f"{field}.metrics is not an object")
            names.append(entry["checkpoint_dir_name"])
        for field in _NAME_LIST_FIELDS:
            listed = value.get(field)
            if listed is None:
                continue
            if not isinstance(listed, list):
                raise CorruptSnapshot(self._where, f"{field} is not a list")
            names += listed
        for name in names:
            self._inside(name)

    def _inside(self, name: Any) -> str:
        """The checkpoint folder ``name`` names, when it is one inside this run."""
        if not is_safe_name(name):
            raise CorruptSnapshot(
                self._where, f"checkpoint {name!r} is not one folder inside the run"
            )
        path = f"{self.files.dir}/{name}"
        if self.files.local:
            run, real = os.path.realpath(self.files.dir), os.path.realpath(path)
            if real == run or os.path.commonpath([run, real]) != run:
                raise CorruptSnapshot(
                    self._where, f"checkpoint {name!r} leads outside the run, to {real}"
                )
        return path

    def checkpoints(self) -> list[tuple[str, dict]]:
        """(checkpoint directory, its metrics) of every committed, kept checkpoint."""
        return [
            (self._inside(r["checkpoint_dir_name"]), r.get("metrics") or {})
            for r in self.snapshot().get("checkpoint_results") or []
        ]

    def latest_checkpoint(self) -> str | None:
        """The checkpoint a resume starts from."""
        latest = self.snapshot().get("latest_checkpoint_result")
        return self._inside(latest["checkpoint_dir_name"]) if latest else None

    def latest_metrics(self) -> dict:
        return (self.snapshot().get("latest_checkpoint_result") or {}).get("metrics") or {}

    def best_checkpoint(self, metric: str = CHECKPOINT_METRIC, mode: str = "max") -> str | None:
        """The kept checkpoint with the best ``metric`` (the latest on a tie)."""
        scored = [
            (m[metric], i, path)
            for i, (path, m) in enumerate(self.checkpoints())
            if isinstance(m.get(metric), (int, float)) and not isinstance(m.get(metric), bool)
        ]
        if not scored:
            return self.latest_checkpoint()
        pick = max if mode == "max" else min
        sign = 1 if mode == "max" else -1
        return pick(scored, key=lambda s: (s[0], sign * s[1]))[2]

    def relocate(self, recorded: Any) -> str | None:
        """A checkpoint path recorded in this run's files (``summary.json``), where it is
        now (the run may have moved since), or None when it does not lie inside this run:
        a path inside it as it stands, else a ``checkpoint_*`` folder of that name inside
        it (a safe name, no link out of the run)."""
        if not recorded or not isinstance(recorded, str):
            return None
        if self.files.contains(recorded):
            return recorded
        name = recorded.rstrip("/").rpartition("/")[2]
        if not name.startswith("checkpoint_"):
            return None
        try:
            return self._inside(name)
        except CorruptSnapshot:
            return None
