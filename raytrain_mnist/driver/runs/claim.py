"""One command at a time per run: who holds ``<storage>/<name>``.

On a local disk the run directory itself is ``flock``-ed (the kernel releases the lock if
the command dies); an object store has no locks, so the run holds a *lease* object with an
owner and a heartbeat beside it (a lease whose owner stopped beating, or whose process is
gone from this host, is taken over). ``--fresh`` keeps the previous run as
``NAME.previous-N``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from raytrain_mnist.driver.runs.storage import RunStorage
from raytrain_mnist.errors import UserError, first_line

logger = logging.getLogger(__name__)

#: A lease on an object store is stale once its owner has not renewed it for this long.
LEASE_TTL_S = 30.0
_LEASE_BEAT_S = 5.0
#: Between writing a lease and reading it back: a rival who wrote at the same moment is seen.
_LEASE_SETTLE_S = 0.5


@contextlib.contextmanager
def hold(files: RunStorage, fresh: bool = False, what: str = "run") -> Iterator[None]:
    """Hold the run in ``files`` for one command: refuse a second while the first runs.

    With ``fresh`` the previous run, if any, is kept as ``NAME.previous-N`` and a
    new one starts. The run directory exists inside the block.
    """
    files.check_writable()
    created = not files.exists()
    holder = DirLock(files) if files.local else Lease(files)
    holder.acquire(what)
    try:
        if fresh and not created and files.has_files():
            kept = files.move_aside()
            logger.info("--fresh: the previous %s is kept in %s", what, kept)
            holder.release()  # the lock went with the old directory
            created = True
            holder.acquire(what)
        yield
    finally:
        try:
            if created and files.local and not files.has_files():
                Path(files.dir).rmdir()  # refused before anything was written
        finally:
            holder.release()


class DirLock:
    """A local run: an exclusive ``flock`` on the run directory itself. The kernel releases
    it when the command dies, and no lock file is left behind."""

    def __init__(self, files: RunStorage) -> None:
        self.files = files
        self.fd: int | None = None

    def acquire(self, what: str) -> None:
        path = Path(self.files.dir)
        path.mkdir(exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(
                f"{what} '{self.files.name}' is already running in "
                f"{self.files.root}; wait for it, or pick another --name"
            ) from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the lock
            self.fd = None


class Lease:
    """An object store has no locks: the run holds a lease object ``.NAME.lease`` beside it,
    naming its owner and renewed every few seconds. A second command refuses while the lease
    is fresh; a lease left by a dead command is taken over (at once when its process is gone
    from this host, after ``LEASE_TTL_S`` otherwise)."""

    def __init__(self, files: RunStorage) -> None:
        self.files = files
        self.fs = files.filesystem
        self.path = f"{files.base.rpartition('/')[0]}/.{files.name}.lease"
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
            "run": self.files.name,
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
                f"{what} '{self.files.name}' is already running in {self.files.root} "
                f"(held by pid {held.get('pid')} on {held.get('host')}, renewed {age:.0f} s "
                f"ago); wait for it, or pick another --name"
            )
        self._write()
        time.sleep(_LEASE_SETTLE_S)
        if (self._read() or {}).get("token") != self.token:
            raise UserError(
                f"{what} '{self.files.name}' was claimed by another command at the "
                "same moment; wait for it, or pick another --name"
            )
        self._stop.clear()  # a claim re-acquires after --fresh moved the old run aside
        self._thread = threading.Thread(target=self._renew, name="lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(_LEASE_BEAT_S):
            try:
                if (self._read() or {}).get("token") != self.token:
                    logger.warning("the lease on %s was taken by another command", self.files.dir)
                    return
                self._write()
            except Exception as exc:  # a store hiccup: the next beat retries
                logger.warning(
                    "could not renew the lease on %s (%s)", self.files.dir, first_line(exc)
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
