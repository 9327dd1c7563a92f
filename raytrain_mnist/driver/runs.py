"""The one home of a run: where it lives, what it is, who holds it, what it has committed.

A *run* is a directory ``<storage>/<name>`` on a local disk or on any file system pyarrow
reaches by URI (``s3://bucket/runs``, ``gs://...``; endpoint and credentials come from the
standard environment, e.g. ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``). Ray Train writes its
checkpoints there; this module reads and writes everything else, through one pyarrow file
system, so a URI gets exactly the guarantees a local path gets:

* **identity** — ``run.json``: the training settings, the data set asked for and a
  fingerprint of the data actually used. The default name derives from it, a resume must
  match it, a run begun on the sample is never resumed on full MNIST.
* **claim** — one command at a time per run: a file lock on a local disk (released by the
  kernel if the command dies), a *lease* object with an owner and a heartbeat on object
  stores (a lease whose owner stopped beating, or whose process is gone from this host, is
  taken over). ``--fresh`` keeps the previous run as ``NAME.previous-N``.
* **checkpoints** — Ray Train's own record of what it committed
  (``checkpoint_manager_snapshot.json``): the latest, and the best by the metric the
  trainer ranks them by. A folder the record does not list is never taken for a checkpoint.
* **summary** — ``summary.json``, written once at the end while the run is still claimed,
  atomically (temp + fsync + rename locally, a single put on object stores).

Tune experiments are runs too (their identity is the search; their trials are Train runs
below ``runs/``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from raytrain_mnist.config import CHECKPOINT_METRIC, FitConfig, settings_digest
from raytrain_mnist.errors import EXIT_USAGE, UserError, first_line

logger = logging.getLogger(__name__)

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
#: The metric Ray Train ranks kept checkpoints by, and so "the best checkpoint" everywhere.

#: A lease on an object store is stale once its owner has not renewed it for this long.
LEASE_TTL_S = 30.0
_LEASE_BEAT_S = 5.0
#: Between writing a lease and reading it back: a rival who wrote at the same moment is seen.
_LEASE_SETTLE_S = 0.5


def is_uri(path: str) -> bool:
    """The one test of "is this a URI or a local path"."""
    return "://" in str(path)


def check_no_credentials(uri: str, flag: str) -> None:
    """Refuse ``scheme://user:secret@host``: secrets never travel in flags, files or logs."""
    if is_uri(uri) and urlsplit(uri).password is not None:
        raise UserError(
            f"{flag}: the URI carries credentials; pass them through the "
            "environment instead (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for "
            "s3://, MLFLOW_TRACKING_USERNAME / _PASSWORD for MLflow)",
            EXIT_USAGE,
        )


def storage_root(storage_path: str) -> str:
    """What Ray gets: an absolute local path, or the URI as given (credentials refused)."""
    if is_uri(storage_path):
        check_no_credentials(storage_path, "--storage-path")
        return storage_path.rstrip("/")
    return str(Path(storage_path).expanduser().resolve())


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


# --------------------------------------------------------------------------- the run


class Run:
    """``<storage>/<name>``: a local directory or a prefix on an object store."""

    def __init__(self, storage: str, name: str, record: str = RUN_FILE) -> None:
        self.storage = storage_root(storage)
        self.name = name
        self.record = record  # the identity record: run.json, or a search's search.json
        self.dir = f"{self.storage.rstrip('/')}/{name}"
        self.local = not is_uri(self.storage)
        self._fs = None  # pyarrow file system, opened on first use

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

    # ----------------------------------------------------------------- files

    @property
    def fs(self):
        """(pyarrow file system, this run's path in it)."""
        if self._fs is None:
            import pyarrow.fs

            if self.local:
                self._fs = (pyarrow.fs.LocalFileSystem(), self.dir)
            else:
                try:
                    fs, path = pyarrow.fs.FileSystem.from_uri(self.dir)
                except (ValueError, OSError) as exc:
                    raise UserError(
                        f"--storage-path {self.storage}: {first_line(exc)}", EXIT_USAGE
                    ) from exc
                self._fs = (fs, path)
        return self._fs

    def _path(self, name: str = "") -> str:
        base = self.fs[1]
        return f"{base}/{name}" if name else base

    def _type(self, path: str):
        try:
            return self.fs[0].get_file_info(path).type
        except OSError as exc:
            raise UserError(f"cannot reach {self.dir}: {first_line(exc)}") from exc

    def exists(self, name: str = "") -> bool:
        import pyarrow.fs

        return self._type(self._path(name)) != pyarrow.fs.FileType.NotFound

    def is_file(self, name: str) -> bool:
        import pyarrow.fs

        return self._type(self._path(name)) == pyarrow.fs.FileType.File

    def read_bytes(self, name: str) -> bytes | None:
        """The file's bytes, None when it does not exist."""
        if not self.is_file(name):
            return None
        try:
            with self.fs[0].open_input_stream(self._path(name)) as f:
                return f.read()
        except OSError as exc:
            raise UserError(f"{self.dir}/{name} is unreadable ({first_line(exc)})") from exc

    def read_json(self, name: str) -> dict | None:
        """A JSON record of the run; None when absent, one-line error when not ours."""
        raw = self.read_bytes(name)
        if raw is None:
            return None
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise UserError(
                f"{self.dir}/{name} is unreadable ({exc.__class__.__name__}); "
                "move the run away or pick another --name"
            ) from exc
        if not isinstance(value, dict):
            raise UserError(
                f"{self.dir}/{name} is not a run file of raytrain_mnist; pick another --name"
            )
        return value

    def write_bytes(self, name: str, payload: bytes) -> str:
        """Atomically: a reader sees the old file or the new one, never half of one."""
        if self.local:
            target = Path(self.dir) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                dir=target.parent, prefix=f".{target.name}.", delete=False
            ) as tmp:
                tmp.write(payload)
                tmp.flush()
                os.fsync(tmp.fileno())
            os.replace(tmp.name, target)
            return str(target)
        # An object store's single PUT is atomic: the object appears whole or not at all.
        with self.fs[0].open_output_stream(self._path(name)) as f:
            f.write(payload)
        return f"{self.dir}/{name}"

    def write_json(self, name: str, record: dict) -> str:
        return self.write_bytes(name, json.dumps(record, indent=2).encode())

    # ----------------------------------------------------------------- records

    def identity(self) -> dict | None:
        return self.read_json(self.record)

    def summary(self) -> dict | None:
        return self.read_json(SUMMARY_FILE)

    def finished(self) -> dict | None:
        """The summary of a run that finished, else None."""
        summary = self.summary()
        return summary if summary and summary.get("status") == "finished" else None

    def check_identity(self, identity: dict, what: str = "run") -> None:
        """Refuse (exit 2) to continue a run that was started with other settings or data."""
        previous = self.identity()
        if previous is not None and previous != identity:
            raise UserError(
                f"{what} '{self.name}' in {self.storage} was started with other settings "
                f"({describe_difference(previous, identity)}); repeat its flags and data to "
                "resume it, pick another --name, or add --fresh",
                EXIT_USAGE,
            )

    # ----------------------------------------------------------------- checkpoints

    def snapshot(self) -> dict:
        """Ray Train's record of the committed checkpoints ({} before the first)."""
        try:
            return self.read_json(SNAPSHOT_FILE) or {}
        except UserError:
            return {}  # Ray writes it; a torn read while it commits is not ours to report

    def checkpoints(self) -> list[tuple[str, dict]]:
        """(checkpoint directory, its metrics) of every committed, kept checkpoint."""
        return [
            (f"{self.dir}/{r['checkpoint_dir_name']}", r.get("metrics") or {})
            for r in self.snapshot().get("checkpoint_results") or []
            if r.get("checkpoint_dir_name")
        ]

    def latest_checkpoint(self) -> str | None:
        """The checkpoint a resume starts from."""
        latest = self.snapshot().get("latest_checkpoint_result") or {}
        name = latest.get("checkpoint_dir_name")
        return f"{self.dir}/{name}" if name else None

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

    def contains(self, path: str) -> bool:
        """Whether ``path`` lies inside this run (checkpoint paths recorded in its files
        are followed only then)."""
        if is_uri(path) != (not self.local):
            return False
        if self.local:
            try:
                Path(path).resolve().relative_to(Path(self.dir).resolve())
                return True
            except ValueError:
                return False
        return path.rstrip("/").startswith(self.dir + "/")

    @contextlib.contextmanager
    def local_copy(self, checkpoint: str) -> Iterator[Path]:
        """A local directory holding ``checkpoint`` (itself, or a download of it)."""
        if not is_uri(checkpoint):
            yield Path(checkpoint)
            return
        import pyarrow.fs

        fs, path = pyarrow.fs.FileSystem.from_uri(checkpoint)
        with tempfile.TemporaryDirectory(prefix="raytrain_mnist-ckpt-") as tmp:
            try:
                pyarrow.fs.copy_files(
                    path,
                    tmp,
                    source_filesystem=fs,
                    destination_filesystem=pyarrow.fs.LocalFileSystem(),
                )
            except OSError as exc:
                raise UserError(f"cannot read checkpoint {checkpoint}: {first_line(exc)}") from exc
            yield Path(tmp)

    def relocate(self, recorded: str | None) -> str | None:
        """A checkpoint path recorded in this run's files, where it is now (the run may
        have moved since), or None when it does not lie inside this run."""
        if not recorded:
            return None
        if self.contains(recorded):
            return recorded
        name = recorded.rstrip("/").rpartition("/")[2]
        return f"{self.dir}/{name}" if name.startswith("checkpoint_") else None

    # ----------------------------------------------------------------- claiming

    @contextlib.contextmanager
    def claim(self, fresh: bool = False, what: str = "run") -> Iterator[Run]:
        """Hold the run for one command: refuse a second while the first runs.

        With ``fresh`` the previous run, if any, is kept as ``NAME.previous-N`` and a
        new one starts. The run directory exists inside the block.
        """
        self._check_storage()
        created = not self.exists()
        holder = _DirLock(self) if self.local else _Lease(self)
        holder.acquire(what)
        try:
            if fresh and not created and self._has_files():
                kept = self._move_aside()
                logger.info("--fresh: the previous %s is kept in %s", what, kept)
                holder.release()  # the lock went with the old directory
                created = True
                holder.acquire(what)
            yield self
        finally:
            try:
                if created and self.local and not self._has_files():
                    Path(self.dir).rmdir()  # refused before anything was written
            finally:
                holder.release()

    def _has_files(self) -> bool:
        if self.local:
            return Path(self.dir).is_dir() and any(Path(self.dir).iterdir())
        return self.exists()

    def _check_storage(self) -> None:
        if not self.local:
            return
        path = Path(self.dir)
        storage = path.parent
        if storage.exists() and not storage.is_dir():
            raise UserError(f"--storage-path {storage} is a file, not a directory", EXIT_USAGE)
        if path.exists() and not path.is_dir():
            raise UserError(
                f"{path} exists and is not a run directory; pick another --name", EXIT_USAGE
            )
        try:
            storage.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=storage):
                pass
        except OSError as exc:
            raise UserError(
                f"--storage-path {storage} is not writable ({exc.strerror}); "
                "pick another directory",
                EXIT_USAGE,
            ) from exc

    def _move_aside(self) -> str:
        n = 1
        while Run(self.storage, f"{self.name}.previous-{n}").exists():
            n += 1
        kept = Run(self.storage, f"{self.name}.previous-{n}")
        if self.local:
            Path(self.dir).rename(kept.dir)
        else:
            # Object stores cannot rename a prefix: copy every object, then drop the originals.
            import pyarrow.fs

            fs, base = self.fs
            files = [
                info
                for info in fs.get_file_info(pyarrow.fs.FileSelector(base, recursive=True))
                if info.type == pyarrow.fs.FileType.File
            ]
            for info in files:
                fs.copy_file(info.path, kept._path() + info.path[len(base) :])
            fs.delete_dir(base)
        return kept.name


class _DirLock:
    """A local run: an exclusive ``flock`` on the run directory itself. The kernel releases
    it when the command dies, and no lock file is left behind."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.fd: int | None = None

    def acquire(self, what: str) -> None:
        path = Path(self.run.dir)
        path.mkdir(exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(
                f"{what} '{self.run.name}' is already running in "
                f"{self.run.storage}; wait for it, or pick another --name"
            ) from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the lock
            self.fd = None


class _Lease:
    """An object store has no locks: the run holds a lease object ``.NAME.lease`` beside it,
    naming its owner and renewed every few seconds. A second command refuses while the lease
    is fresh; a lease left by a dead command is taken over (at once when its process is gone
    from this host, after ``LEASE_TTL_S`` otherwise)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        fs, base = run.fs
        self.fs, self.path = fs, f"{base.rpartition('/')[0]}/.{run.name}.lease"
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> dict:
        import psutil

        return {
            "token": self.token,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_started": psutil.Process().create_time(),
            "renewed": time.time(),
            "run": self.run.name,
        }

    def _read(self) -> dict | None:
        try:
            with self.fs.open_input_stream(self.path) as f:
                value = json.loads(f.read())
        except (OSError, ValueError):  # absent, or not a lease: nobody holds the run
            return None
        return value if isinstance(value, dict) else None

    def _write(self) -> None:
        with self.fs.open_output_stream(self.path) as f:
            f.write(json.dumps(self._record()).encode())

    def acquire(self, what: str) -> None:
        held = self._read()
        if held and held.get("token") != self.token and not _stale(held):
            age = time.time() - float(held.get("renewed", 0))
            raise UserError(
                f"{what} '{self.run.name}' is already running in {self.run.storage} "
                f"(held by pid {held.get('pid')} on {held.get('host')}, renewed {age:.0f} s "
                f"ago); wait for it, or pick another --name"
            )
        self._write()
        time.sleep(_LEASE_SETTLE_S)
        if (self._read() or {}).get("token") != self.token:
            raise UserError(
                f"{what} '{self.run.name}' was claimed by another command at the "
                "same moment; wait for it, or pick another --name"
            )
        self._stop.clear()  # a claim re-acquires after --fresh moved the old run aside
        self._thread = threading.Thread(target=self._renew, name="lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(_LEASE_BEAT_S):
            try:
                if (self._read() or {}).get("token") != self.token:
                    logger.warning("the lease on %s was taken by another command", self.run.dir)
                    return
                self._write()
            except Exception as exc:  # a store hiccup: the next beat retries
                logger.warning(
                    "could not renew the lease on %s (%s)", self.run.dir, first_line(exc)
                )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if (self._read() or {}).get("token") == self.token:
            with contextlib.suppress(OSError):
                self.fs.delete_file(self.path)


def _stale(lease: dict) -> bool:
    """A lease whose owner stopped renewing it, or whose process no longer exists here."""
    if time.time() - float(lease.get("renewed", 0)) > LEASE_TTL_S:
        return True
    if lease.get("host") != socket.gethostname():
        return False
    import psutil

    try:
        return psutil.Process(int(lease["pid"])).create_time() != lease.get("pid_started")
    except (psutil.NoSuchProcess, KeyError, ValueError, TypeError):
        return True
