"""The one home of a run: where it lives, what it is, who holds it, what it has committed.

A *run* is a directory ``<storage>/<name>`` on a local disk or on any file system pyarrow
reaches by URI (``s3://bucket/runs``, ``gs://...``; endpoint and credentials come from the
standard environment, e.g. ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``). Ray Train writes its
checkpoints there; this package reads and writes everything else, through one pyarrow file
system, so a URI gets exactly the guarantees a local path gets. :class:`Run` is the door;
behind it, one job per module:

* :mod:`.storage`: the directory as files (local path or URI, decided once), atomic writes
  (temp + fsync + rename locally, a single put on object stores), one-line read errors, and
  the one reader of a record's JSON (:func:`~.storage.parse_record`: at most
  :data:`MAX_RECORD_BYTES`, nested a few levels, NaN refused where a record never holds it).
* :mod:`.records`: what the files say: the **identity** (``run.json``: the training
  settings, the data set asked for and a fingerprint of the data used; the default name
  derives from it, a resume must match it), the **summary** (``summary.json``, written once
  at the end while the run is still claimed) and Ray Train's record of the committed
  **checkpoints** (``checkpoint_manager_snapshot.json``: the latest, and the best by the
  metric the trainer ranks them by; a folder it does not list is never a checkpoint).
* :mod:`.claim`: one command at a time per run: a file lock on a local disk, a lease with
  an owner and a heartbeat on object stores. ``--fresh`` keeps the previous run as
  ``NAME.previous-N``.

Tune experiments are runs too (their identity is the search; their trials are Train runs
below ``runs/``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from raytrain_mnist.config import CHECKPOINT_METRIC
from raytrain_mnist.driver.runs.claim import LEASE_TTL_S, Claim, hold
from raytrain_mnist.driver.runs.records import (
    BEST_FILE,
    CURVES_FILE,
    DATA_DIR_KEY,
    RUN_FILE,
    RUNS_DIR,
    SEARCH_FILE,
    SNAPSHOT_FILE,
    STATE_FILE,
    SUMMARY_FILE,
    CheckpointRecord,
    CorruptSnapshot,
    RunRecords,
    data_identity,
    default_name,
    describe_difference,
    fit_identity,
)
from raytrain_mnist.driver.runs.storage import (
    MAX_CHECKPOINT_BYTES,
    MAX_RECORD_BYTES,
    RunStorage,
    check_no_credentials,
    is_safe_name,
    is_uri,
    local_copy,
    storage_root,
)

__all__ = [
    "BEST_FILE",
    "CURVES_FILE",
    "LEASE_TTL_S",
    "MAX_CHECKPOINT_BYTES",
    "MAX_RECORD_BYTES",
    "RUNS_DIR",
    "RUN_FILE",
    "SEARCH_FILE",
    "DATA_DIR_KEY",
    "SNAPSHOT_FILE",
    "STATE_FILE",
    "SUMMARY_FILE",
    "CorruptSnapshot",
    "Run",
    "RunStorage",
    "check_no_credentials",
    "data_identity",
    "default_name",
    "describe_difference",
    "fit_identity",
    "is_safe_name",
    "is_uri",
    "storage_root",
]


class Run:
    """``<storage>/<name>``: a local directory or a prefix on an object store.

    ``storage`` (the root as Ray gets it), ``name``, ``dir`` (the run's local path or URI)
    and ``local`` say where it is; ``files`` is its :class:`RunStorage`. The methods below
    are the package's whole interface: each hands over to the module that does the job.
    """

    def __init__(self, storage: str, name: str, record: str = RUN_FILE) -> None:
        self.files = RunStorage(storage_root(storage), name)
        self.storage, self.name, self.dir = self.files.root, name, self.files.dir
        self.local = self.files.local
        self.record = record  # the identity record: run.json, or a search's search.json
        self._records = RunRecords(self.files, record)
        self._checkpoints = CheckpointRecord(self.files)
        #: Inside :meth:`claim`: the :class:`~.claim.Claim` held (its ``lost`` event is set
        #: when the hold is taken from this command, which must then stop), else None.
        self.held: Claim | None = None

    @classmethod
    def at(cls, run_dir: str | os.PathLike, record: str = RUN_FILE) -> Run:
        """The run whose directory is ``run_dir``."""
        text = str(run_dir).rstrip("/")
        if is_uri(text):
            storage, _, name = text.rpartition("/")
        else:
            path = Path(text).expanduser().resolve()
            storage, name = str(path.parent), path.name
        return cls(storage, name, record)

    def __repr__(self) -> str:
        return f"Run({self.dir!r})"

    # ----------------------------------------------------------------- files (storage)

    def exists(self, name: str = "") -> bool:
        return self.files.exists(name)

    def is_file(self, name: str) -> bool:
        return self.files.is_file(name)

    def read_bytes(self, name: str) -> bytes | None:
        """A record's bytes, None when it is no file; one line (:class:`UserError`) for a
        file of more than :data:`MAX_RECORD_BYTES`, which is never read whole."""
        return self.files.read_bytes(name)

    def read_json(self, name: str, finite: bool = False) -> dict | None:
        """A JSON record of the run (:func:`~.storage.parse_record`; ``finite``: one that
        never holds NaN or infinity); None when absent, one-line error when not ours."""
        return self.files.read_json(name, finite)

    def write_bytes(self, name: str, payload: bytes) -> str:
        """Atomically: a reader sees the old file or the new one, never half of one."""
        return self.files.write_bytes(name, payload)

    def write_json(self, name: str, record: dict) -> str:
        return self.files.write_json(name, record)

    def contains(self, path: str) -> bool:
        """Whether ``path`` lies inside this run (checkpoint paths recorded in its files
        are followed only then)."""
        return self.files.contains(path)

    def local_copy(self, checkpoint: str) -> contextlib.AbstractContextManager[Path]:
        """A local directory holding ``checkpoint`` (itself, or a download of it)."""
        return local_copy(checkpoint)

    # ----------------------------------------------------------------- records

    def identity(self) -> dict | None:
        return self._records.identity()

    def summary(self) -> dict | None:
        return self._records.summary()

    def finished(self) -> dict | None:
        """The summary of a run that finished, else None."""
        return self._records.finished()

    def check_identity(self, identity: dict, what: str = "run") -> None:
        """Refuse (exit 2) to continue a run that was started with other settings or data."""
        self._records.check_identity(identity, what)

    # ----------------------------------------------------------------- checkpoints (Ray's)

    def snapshot(self) -> dict:
        """Ray Train's record of the committed checkpoints ({} before the first)."""
        return self._checkpoints.snapshot()

    def checkpoints(self) -> list[tuple[str, dict]]:
        """(checkpoint directory, its metrics) of every committed, kept checkpoint."""
        return self._checkpoints.checkpoints()

    def latest_checkpoint(self) -> str | None:
        """The checkpoint a resume starts from."""
        return self._checkpoints.latest_checkpoint()

    def latest_metrics(self) -> dict:
        return self._checkpoints.latest_metrics()

    def best_checkpoint(self, metric: str = CHECKPOINT_METRIC, mode: str = "max") -> str | None:
        """The kept checkpoint with the best ``metric`` (the latest on a tie)."""
        return self._checkpoints.best_checkpoint(metric, mode)

    def relocate(self, recorded: str | None) -> str | None:
        """A checkpoint path recorded in this run's files, where it is now (the run may
        have moved since), or None when it does not lie inside this run."""
        return self._checkpoints.relocate(recorded)

    # ----------------------------------------------------------------- claiming

    @contextlib.contextmanager
    def claim(self, fresh: bool = False, what: str = "run") -> Iterator[Run]:
        """Hold the run for one command: refuse a second while the first runs.

        With ``fresh`` the previous run, if any, is kept as ``NAME.previous-N`` and a
        new one starts. The run directory exists inside the block; :attr:`held` is the
        claim. A claim that is lost sets ``held.lost``: the command must stop its run.
        """
        with hold(self.files, fresh, what) as held:
            self.held = held
            try:
                yield self
            finally:
                self.held = None
