"""Every run and search under a storage path, as ``raytrain-mnist runs`` lists them.

:func:`list_runs` reads each directory's records (``run.json`` and ``summary.json`` of a fit
run; ``search.json`` and ``best.json`` of a search) into a :class:`RunEntry`, newest first.
Whether a run is running now is read from its claim (:mod:`.claim`): the lock a command holds
on a local run, the lease beside a run on an object store. Nothing is written, nothing is
claimed. A directory whose records cannot be read is listed as ``damaged`` with the reason in
one line: one bad run never hides the others.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raytrain_mnist.driver.runs import claim
from raytrain_mnist.driver.runs.records import (
    BEST_FILE,
    RUN_FILE,
    SEARCH_FILE,
    SUMMARY_FILE,
    CheckpointRecord,
)
from raytrain_mnist.driver.runs.storage import RunStorage, is_safe_name, is_uri, storage_root
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


def read_entry(files: RunStorage) -> RunEntry | None:
    """The entry of the directory ``files``; None when it is no run of raytrain_mnist."""
    try:
        present = {name for name in _RECORDS if files.is_file(name)}
        if not present:
            return None
        running = is_running(files)
        if present & {SEARCH_FILE, BEST_FILE}:
            return _search_entry(files, running)
        return _fit_entry(files, running)
    except (UserError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        return RunEntry(
            files.name, "?", "damaged", None, None, None, None, None, None, files.dir,
            problem=first_line(exc),
        )  # fmt: skip


def _fit_entry(files: RunStorage, running: bool) -> RunEntry:
    identity = files.read_json(RUN_FILE) or {}
    summary = files.read_json(SUMMARY_FILE)
    planned = _number((identity.get("train") or {}).get("epochs"))
    started = _started(files, RUN_FILE, summary)
    if summary is None or running:  # no summary yet, or an older attempt's: Ray's record
        metrics = CheckpointRecord(files).checkpoints()
        accuracies = [m.get("val_accuracy") for _, m in metrics]
        accuracies = [a for a in accuracies if isinstance(a, (int, float))]
        epochs = [m.get("epoch") for _, m in metrics if isinstance(m.get("epoch"), int)]
        workers = (summary or {}).get("num_workers")
        return RunEntry(
            files.name,
            "fit",
            "running" if running else "stopped",
            max(accuracies, default=None),
            max(epochs, default=0),
            planned,
            workers,
            started,
            round(time.time() - started, 1) if running and started else None,
            files.dir,
        )
    status = _STATUS.get(summary.get("status"))
    if status is None:
        raise ValueError(f"{SUMMARY_FILE} has status {summary.get('status')!r}")
    planned = _number(((summary.get("config") or {}).get("train") or {}).get("epochs")) or planned
    return RunEntry(
        files.name,
        "fit",
        status,
        _number(summary.get("best_val_accuracy")),
        _number(summary.get("epochs_completed")),
        planned,
        summary.get("num_workers"),
        started,
        _number(summary.get("wall_time_s")),
        files.dir,
    )


def _search_entry(files: RunStorage, running: bool) -> RunEntry:
    files.read_json(SEARCH_FILE)  # damaged when unreadable
    best = files.read_json(BEST_FILE)
    started = _started(files, SEARCH_FILE, None)
    if best is None or running:
        return RunEntry(
            files.name,
            "tune",
            "running" if running else "stopped",
            _number((best or {}).get("best_val_accuracy")),
            None,
            None,
            (best or {}).get("num_workers"),
            started,
            round(time.time() - started, 1) if running and started else None,
            files.dir,
        )
    trials = best.get("trials") or []
    if best.get("num_unfinished"):
        status = "stopped"
    elif best.get("num_errors"):
        status = "failed"
    else:
        status = "finished"
    max_epochs, num_trials = _number(best.get("max_epochs")), _number(best.get("num_trials"))
    return RunEntry(
        files.name,
        "tune",
        status,
        _number(best.get("best_val_accuracy")),
        sum(_number(t.get("epochs_run")) or 0 for t in trials),
        max_epochs * num_trials if max_epochs and num_trials else None,
        best.get("num_workers"),
        started,
        _number(best.get("wall_time_s")),
        files.dir,
    )


def _number(value: Any) -> Any:
    """A number from a record, None for anything else (a record is read like input)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _started(files: RunStorage, record: str, summary: dict | None) -> float | None:
    """When the run's last command started: the summary's timeline, else when its identity
    record was written (each command writes it as it starts)."""
    t0 = _number(((summary or {}).get("timeline") or {}).get("t0"))
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
            raw = f.read()
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
    """A lease on an object store: live when its process runs on this host, or, from
    another host, when it was renewed within the TTL by its own clock. A listing may be
    wrong about a lease another host stopped renewing a moment ago; a claim never relies
    on a clock (:class:`.claim.Lease`)."""
    try:
        lease = json.loads(raw)
    except (ValueError, RecursionError):
        return True  # someone's, whatever it holds: the claim would watch it too
    if not isinstance(lease, dict):
        return True
    if lease.get("host_id") == claim.host_id():
        return _process_alive(lease)
    renewed = _number(lease.get("renewed"))
    return renewed is None or time.time() - renewed < 3 * claim.LEASE_TTL_S


def _process_alive(lease: dict) -> bool:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess, KeyError, ValueError, TypeError):
        process = psutil.Process(int(lease["pid"]))
        with contextlib.suppress(psutil.AccessDenied):
            return (
                process.create_time() == lease.get("pid_started")
                and process.status() != psutil.STATUS_ZOMBIE
            )
        return True
    return False
