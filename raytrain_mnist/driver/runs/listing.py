"""Every run and search under a storage path, as ``raytrain-mnist runs`` lists them.

:func:`list_runs` reads each directory's records (``run.json`` and ``summary.json`` of a fit
run; ``search.json`` and ``best.json`` of a search) into a :class:`RunEntry`, newest first.
Whether a run is running now is read from its claim (:mod:`.claim`): the lock a command holds
on a local run, the lease beside a run on an object store. Nothing is written, nothing is
claimed. A directory whose records cannot be read is listed as ``damaged`` with the reason in
one line: one bad run never hides the others.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raytrain_mnist.display import ACCURACY, COUNT, SECONDS, TIME, WORKERS, excerpt
from raytrain_mnist.driver.runs import claim
from raytrain_mnist.driver.runs.records import (
    BEST_FILE,
    RUN_FILE,
    SEARCH_FILE,
    SUMMARY_FILE,
    CheckpointRecord,
)
from raytrain_mnist.driver.runs.storage import (
    MAX_RECORD_BYTES,
    RunStorage,
    is_safe_name,
    is_uri,
    storage_root,
)
from raytrain_mnist.errors import EXIT_USAGE, UserError, first_line

#: What ``summary.json``'s status is called in a listing: a run stopped by Ctrl-C or
#: SIGTERM is "stopped", as is one whose command died before it wrote a summary.
_STATUS = {"finished": "finished", "interrupted": "stopped", "failed": "failed"}
#: The records that make a directory a run (or a search) of raytrain_mnist.
_RECORDS = (RUN_FILE, SUMMARY_FILE, SEARCH_FILE, BEST_FILE)


@dataclass(frozen=True)
class RunEntry:
    """One run or search: what a line of ``raytrain-mnist runs`` shows."""

    name: str
    kind: str  # "fit" or "tune"
    status: str  # running, finished, stopped, failed, or damaged
    best_val_accuracy: float | None
    epochs_done: int | None  # a search: the epochs all its trials trained
    epochs_planned: int | None  # a search: trials x epochs per trial
    workers: Any  # a count, or [min, max] for an elastic run
    started: float | None  # unix time
    wall_s: float | None
    path: str
    problem: str | None = None  # why a damaged run is damaged

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def list_runs(storage_path: str) -> list[RunEntry]:
    """Every run and search directly under ``storage_path`` (a local path or a URI), newest
    first. A storage path that does not exist holds no runs; one that cannot be reached is
    :class:`UserError`."""
    root = storage_root(storage_path)
    entries = [read_entry(RunStorage(root, name)) for name in _directories(root)]
    return sorted(
        (e for e in entries if e is not None),
        key=lambda e: (e.started is not None, e.started or 0, e.name),
        reverse=True,
    )


def find_run(storage_path: str, name: str) -> RunEntry:
    """The run or search ``name`` under ``storage_path``; :class:`UserError` (exit 2) when
    there is none, naming the runs there are."""
    if not is_safe_name(name):
        raise UserError(f"{name!r} is not a run name", EXIT_USAGE)
    root = storage_root(storage_path)
    entry = read_entry(RunStorage(root, name))
    if entry is None:
        names = [e.name for e in list_runs(storage_path)][:5]
        hint = f"; runs there: {', '.join(names)}" if names else "; it holds no runs"
        raise UserError(f"no run '{name}' in {root}{hint}", EXIT_USAGE)
    return entry


def _directories(root: str) -> list[str]:
    """The names of the directories directly under ``root`` (none when it does not exist)."""
    if not is_uri(root):
        path = Path(root)
        if not path.is_dir():
            return []
        return sorted(p.name for p in path.iterdir() if p.is_dir() and is_safe_name(p.name))
    import pyarrow.fs

    try:
        fs, base = pyarrow.fs.FileSystem.from_uri(root)
        infos = fs.get_file_info(pyarrow.fs.FileSelector(base, allow_not_found=True))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot list {root}: {first_line(exc)}") from exc
    names = (i.base_name for i in infos if i.type == pyarrow.fs.FileType.Directory)
    return sorted(n for n in names if is_safe_name(n))


#: What reading a run's records may raise, each a reason for a ``damaged`` row: the records'
#: own one line (UserError), a value that fails its check (ValueError), and what a shape
#: this listing did not foresee makes Python raise.
_UNREADABLE = (
    UserError,
    ValueError,
    TypeError,
    LookupError,
    AttributeError,
    ArithmeticError,
    RecursionError,
)


def read_entry(files: RunStorage) -> RunEntry | None:
    """The entry of the directory ``files``; None when it is no run of raytrain_mnist. A
    run whose records cannot be read, or hold a value that is not what the record says it
    is (a time of 1e20, an accuracy of 400 digits, a worker count that is a string), is
    ``damaged``, with the reason: one bad run never ends the listing."""
    try:
        present = {name for name in _RECORDS if files.is_file(name)}
        if not present:
            return None
        running = is_running(files)
        if present & {SEARCH_FILE, BEST_FILE}:
            return _search_entry(files, running)
        return _fit_entry(files, running)
    except _UNREADABLE as exc:
        return RunEntry(
            files.name,
            "?",
            "damaged",
            None,
            None,
            None,
            None,
            None,
            None,
            files.dir,
            problem=first_line(exc),
        )


def _object(record: dict, key: str, where: str) -> dict:
    """``record[key]``: a JSON object, {} when absent; ValueError when it is anything else
    (``where``: what names the record, and the keys above ``key``)."""
    value = record.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}{key} {excerpt(value)} is not an object")
    return value


def _fit_entry(files: RunStorage, running: bool) -> RunEntry:
    identity = files.read_json(RUN_FILE, finite=True) or {}
    summary = files.read_json(SUMMARY_FILE)
    planned = COUNT.check(
        _object(identity, "train", f"{RUN_FILE}: ").get("epochs"), f"{RUN_FILE}: train.epochs"
    )
    started = _started(files, RUN_FILE, summary)
    if summary is None or running:  # no summary yet, or an older attempt's: Ray's record
        metrics = [m for _, m in CheckpointRecord(files).checkpoints()]
        accuracies = [m.get("val_accuracy") for m in metrics]
        epochs = [m.get("epoch") for m in metrics]
        workers = (summary or {}).get("num_workers")
        return RunEntry(
            files.name,
            "fit",
            "running" if running else "stopped",
            max((a for a in accuracies if ACCURACY.valid(a)), default=None),
            max((e for e in epochs if COUNT.valid(e)), default=0),
            planned,
            WORKERS.check(workers, f"{SUMMARY_FILE}: num_workers"),
            started,
            round(time.time() - started, 1) if running and started else None,
            files.dir,
        )
    recorded = summary.get("status")
    status = _STATUS.get(recorded) if isinstance(recorded, str) else None
    if status is None:
        raise ValueError(f"{SUMMARY_FILE} has status {excerpt(recorded)}")
    config = _object(summary, "config", f"{SUMMARY_FILE}: ")
    train = _object(config, "train", f"{SUMMARY_FILE}: config.")
    planned = COUNT.check(train.get("epochs"), f"{SUMMARY_FILE}: config.train.epochs") or planned
    where = f"{SUMMARY_FILE}:"
    return RunEntry(
        files.name,
        "fit",
        status,
        ACCURACY.check(summary.get("best_val_accuracy"), f"{where} best_val_accuracy"),
        COUNT.check(summary.get("epochs_completed"), f"{where} epochs_completed"),
        planned,
        WORKERS.check(summary.get("num_workers"), f"{where} num_workers"),
        started,
        SECONDS.check(summary.get("wall_time_s"), f"{where} wall_time_s"),
        files.dir,
    )


def _search_entry(files: RunStorage, running: bool) -> RunEntry:
    files.read_json(SEARCH_FILE, finite=True)  # damaged when unreadable
    best = files.read_json(BEST_FILE, finite=True)
    started = _started(files, SEARCH_FILE, None)
    where = f"{BEST_FILE}:"
    accuracy = ACCURACY.check((best or {}).get("best_val_accuracy"), f"{where} best_val_accuracy")
    workers = WORKERS.check((best or {}).get("num_workers"), f"{where} num_workers")
    if best is None or running:
        return RunEntry(
            files.name,
            "tune",
            "running" if running else "stopped",
            accuracy,
            None,
            None,
            workers,
            started,
            round(time.time() - started, 1) if running and started else None,
            files.dir,
        )
    trials = best.get("trials") or []
    if not isinstance(trials, list) or not all(isinstance(t, dict) for t in trials):
        raise ValueError(f"{where} trials is not a list of objects")
    counts = {
        key: COUNT.check(best.get(key), f"{where} {key}")
        for key in ("num_unfinished", "num_errors", "max_epochs", "num_trials")
    }
    if counts["num_unfinished"]:
        status = "stopped"
    elif counts["num_errors"]:
        status = "failed"
    else:
        status = "finished"
    max_epochs, num_trials = counts["max_epochs"], counts["num_trials"]
    return RunEntry(
        files.name,
        "tune",
        status,
        accuracy,
        sum(COUNT.check(t.get("epochs_run"), f"{where} epochs_run") or 0 for t in trials),
        max_epochs * num_trials if max_epochs and num_trials else None,
        workers,
        started,
        SECONDS.check(best.get("wall_time_s"), f"{where} wall_time_s"),
        files.dir,
    )


def _started(files: RunStorage, record: str, summary: dict | None) -> float | None:
    """When the run's last command started: the summary's timeline, else when its identity
    record was written (each command writes it as it starts)."""
    timeline = _object(summary or {}, "timeline", f"{SUMMARY_FILE}: ")
    t0 = TIME.check(timeline.get("t0"), f"{SUMMARY_FILE}: timeline.t0")
    if t0 is not None:
        return float(t0)
    info = files.filesystem.get_file_info(files.path(record))
    return info.mtime.timestamp() if info.mtime is not None else None


# --------------------------------------------------------------------------- the claim


def is_running(files: RunStorage) -> bool:
    """Whether a command holds the run now, read from its claim without taking it."""
    if files.local:
        return _locked(Path(files.dir) / claim.LOCK_FILE)
    try:
        with files.filesystem.open_input_stream(
            f"{files.base.rpartition('/')[0]}/.{files.name}.lease"
        ) as f:
            raw = f.read(MAX_RECORD_BYTES + 1)  # a bigger one is no lease of ours: read no more
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise UserError(f"cannot read the lease of {files.dir}: {first_line(exc)}") from exc
    return _lease_live(raw)


def _locked(path: Path) -> bool:
    """Whether another process holds the claim's ``flock`` on ``path``. A shared lock is
    tried and dropped at once: it fails while a command holds the exclusive one; a command
    that claims the run in that instant is refused as if the run were held."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False  # a command that ended removed it
    except OSError:
        return False  # not a lock this package made
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # drops the shared lock, if taken
    return False


def _lease_live(raw: bytes) -> bool:
    """A lease on an object store: live when its process runs on this host (as the claim
    reads it: :func:`.claim._parse`, :func:`.claim._alive`), or, from another host, when it
    was renewed within the TTL by its own clock. Bytes that are not a lease are someone's:
    live, as the claim would watch them. A listing may be wrong about a lease another host
    stopped renewing a moment ago; a claim never relies on a clock (:class:`.claim.Lease`)."""
    lease = claim._parse(raw)
    if lease.get("host_id") == claim.host_id():
        return claim._alive(lease)
    renewed = lease.get("renewed")
    return not TIME.valid(renewed) or time.time() - renewed < 3 * claim.LEASE_TTL_S
