"""One command at a time per run: who holds ``<storage>/<name>``.

On a local (or network) disk the command holds an exclusive ``flock`` on a lock file
``.claim.lock`` inside the run directory, opened for writing (NFSv4 and EFS refuse a lock on
a descriptor opened read-only); the kernel drops it when the command dies. An object store has
no locks: the run holds a *lease* object beside it, renewed every few seconds, and a rival
judges it stale only on its own monotonic clock (unchanged for ``LEASE_TTL_S`` while it
watched), never by comparing the lease's wall-clock time with its own. On S3 (``s3://``,
with boto3: the ``s3`` extra) every write of the lease is conditional (:mod:`.versioned`):
the first over no lease (``If-None-Match: *``) or over the stale one watched, each renewal
over the version this command wrote last (``If-Match``), so a rival's lease written in
between is refused by the store, never overwritten, and of two commands taking a lease at
once exactly one wins (a store found to ignore the conditions is treated as one without
them). Other stores (``gs://``, any other pyarrow file system) have no conditional write:
there a lease is read back after it is taken and read before it is renewed, and a rival
whose lease lands between that read and the renewal is overwritten and loses the claim at
its own next renewal. A command whose lease is taken from it is told through
:class:`Claim` and stops its run. ``--fresh`` keeps the previous run as
``NAME.previous-N``. docs/design.md ("The claim") says why.
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
from collections.abc import Callable, Iterator
from pathlib import Path

from raytrain_mnist.display import is_count
from raytrain_mnist.driver.runs.storage import RunStorage, parse_record
from raytrain_mnist.driver.runs.versioned import ABSENT, Conflict, FileObject, open_object
from raytrain_mnist.errors import EXIT_USAGE, UserError, first_line

logger = logging.getLogger(__name__)

#: A rival takes a lease over once it has watched it unchanged for this long.
LEASE_TTL_S = 30.0
#: The file inside a local run directory that its command holds locked.
LOCK_FILE = ".claim.lock"
#: Between writing a lease and reading it back, on a store without conditional writes: a
#: rival who wrote at the same moment is seen.
_LEASE_SETTLE_S = 0.5
#: How long taking and releasing a lease retry a store that answers with errors.
_RETRY_S = 10.0


class Claim:
    """What :func:`hold` yields: ``lost`` is set (and ``reason`` says why, in one line) when
    the command's hold on the run was taken from it (another command's token in its lease,
    or renewals failing for most of the TTL). The command must then stop its run: another
    may be writing it. A caller that stops on ``lost`` and reports the loss itself sets
    ``handled``; otherwise the loss is logged as a warning."""

    def __init__(self) -> None:
        self.lost = threading.Event()
        self.reason: str | None = None
        self.handled = False

    def lose(self, reason: str) -> None:
        self.reason = reason
        self.lost.set()
        (logger.debug if self.handled else logger.warning)("%s", reason)


@contextlib.contextmanager
def hold(files: RunStorage, fresh: bool = False, what: str = "run") -> Iterator[Claim]:
    """Hold the run in ``files`` for one command: refuse a second while the first runs.

    With ``fresh`` the previous run, if any, is kept as ``NAME.previous-N`` and a
    new one starts. The run directory exists inside the block.
    """
    files.check_writable()
    created = not files.exists()
    claim = Claim()
    holder: DirLock | Lease = DirLock(files) if files.local else Lease(files, claim.lose)
    holder.acquire(what)
    try:
        if fresh and not created and _has_run_files(files):
            kept = files.move_aside()
            logger.info("--fresh: the previous %s is kept in %s", what, kept)
            if isinstance(holder, DirLock):  # its lock file went with the old directory
                old, holder = holder, DirLock(files)
                old.moved_to(files.sibling(kept))
                try:
                    holder.acquire(what)  # the new directory, before the old lock goes
                finally:
                    old.release()
            created = True
        yield claim
    finally:
        try:
            holder.release()
        finally:
            if created and files.local and not _has_run_files(files):
                with contextlib.suppress(OSError):  # refused before anything was written
                    Path(files.dir).rmdir()


def _has_run_files(files: RunStorage) -> bool:
    """Whether the run directory holds anything but the claim's lock file."""
    if not files.local:
        return files.has_files()
    path = Path(files.dir)
    return path.is_dir() and any(p.name != LOCK_FILE for p in path.iterdir())


# --------------------------------------------------------------------------- local disks


class DirLock:
    """A local run: an exclusive ``flock`` on ``<run>/.claim.lock``, opened for writing.

    Inside the run directory, not beside it: a command that is refused finds the file there
    already (its holder made it) and changes nothing; the holder removes it on release. The
    kernel drops the lock when the command dies (a killed command leaves the file, which the
    next one locks). ``flock`` rather than POSIX ``lockf``: a POSIX lock belongs to the
    process, so a second claim from the same process would not be refused.
    """

    def __init__(self, files: RunStorage) -> None:
        self.files = files
        self.path = Path(files.dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self, what: str) -> None:
        directory = Path(self.files.dir)
        if directory.is_symlink():  # planted: the run would be written where it points
            raise UserError(
                f"{directory} is a symbolic link; a run directory is never used through a "
                "link: remove it or pick another --name",
                EXIT_USAGE,
            )
        for _ in range(20):
            made_dir = not directory.exists()
            try:
                directory.mkdir(exist_ok=True)
                fd, made = _open_lock_file(self.path)
            except FileNotFoundError:  # a claim that ended removed the directory meanwhile
                continue
            except OSError as exc:
                if made_dir:
                    with contextlib.suppress(OSError):
                        directory.rmdir()
                raise self._error(exc) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise UserError(
                    f"{what} '{self.files.name}' is already running in "
                    f"{self.files.root}; wait for it, or pick another --name"
                ) from None
            except OSError as exc:  # ENOLCK, EBADF, EINVAL: a file system without locks
                os.close(fd)
                with contextlib.suppress(OSError):
                    if made:
                        self.path.unlink()
                    if made_dir:
                        directory.rmdir()
                raise self._error(exc) from exc
            if _same_file(fd, self.path):
                self.fd = fd
                return
            os.close(fd)  # its holder removed it between our open and our lock: again
        raise UserError(f"cannot lock {self.files.dir}: its lock file keeps being replaced")

    def _error(self, exc: OSError) -> UserError:
        return UserError(f"cannot lock {self.files.dir}: {exc.strerror or first_line(exc)}")

    def moved_to(self, files: RunStorage) -> None:
        """The run directory was renamed to ``files`` (``--fresh``): release removes the
        lock file there."""
        self.path = Path(files.dir) / LOCK_FILE

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if _same_file(self.fd, self.path):  # still ours: remove it while holding it
                with contextlib.suppress(OSError):
                    self.path.unlink()
        finally:
            os.close(self.fd)  # closing the descriptor drops the lock
            self.fd = None


def _open_lock_file(path: Path) -> tuple[int, bool]:
    """A descriptor of ``path`` opened for writing (made if absent, never through a
    symbolic link) and whether this call made the file."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            pass
        try:
            return os.open(path, flags), False
        except FileNotFoundError:  # removed between the two opens: make it
            if not path.parent.is_dir():
                raise


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        here = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


# --------------------------------------------------------------------------- object stores


def host_id() -> str:
    """Which process table a pid belongs to: the kernel's boot id and this process's PID
    namespace (containers that share a hostname differ in the namespace), or the hostname
    where ``/proc`` says neither."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return socket.gethostname()


class Lease:
    """An object store has no locks: the run holds a lease object ``.NAME.lease`` beside it,
    naming its owner and renewed every ``beat_s`` seconds (each renewal a new object: its
    counter goes up).

    A second command refuses at once when the owner's process is alive on its own host
    (:func:`host_id`), takes over at once when it is gone, and otherwise watches the lease:
    it refuses as soon as the lease changes, and takes it over once the lease stayed
    unchanged for ``ttl_s`` on its own monotonic clock. The time recorded in the lease is
    for people; no clock is compared with another host's. Only "not found" means no lease:
    a store that answers with errors is retried, and the heartbeat never stops for them.
    Where the store has conditional writes (S3), each write names the version it replaces
    and a refusal (412) means another command's lease is there. ``on_lost(reason)`` is
    called (from the heartbeat's thread) when another command's token is found in the
    lease, or when renewals have failed for two thirds of the TTL (before a rival could
    take over). ``filesystem``: a pyarrow file system to reach the lease through, written
    unconditionally (default: the run's own store, conditional where it can be).
    """

    def __init__(
        self,
        files: RunStorage,
        on_lost: Callable[[str], None] | None = None,
        *,
        ttl_s: float = LEASE_TTL_S,
        beat_s: float | None = None,
        filesystem=None,
    ) -> None:
        self.files = files
        self.path = f"{files.base.rpartition('/')[0]}/.{files.name}.lease"
        #: The lease object: written conditionally where the store can (versioned.py).
        self.store = (
            FileObject(filesystem, self.path)
            if filesystem is not None
            else open_object(files, self.path)
        )
        self._version: str | None = None  # the version this command wrote last
        self.token = uuid.uuid4().hex
        self.on_lost = on_lost
        self.ttl_s = ttl_s
        self.beat_s = beat_s if beat_s is not None else ttl_s / 10
        self.give_up_s = ttl_s * 2 / 3
        #: Renewals written (the counter in the lease).
        self.beats = 0
        self._renewed = 0.0  # monotonic start of the last write that succeeded
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def renewed_at(self) -> float:
        """When (monotonic clock) the last write of the lease that succeeded began."""
        return self._renewed

    @property
    def uri(self) -> str:
        return f"{self.files.root}/.{self.files.name}.lease"

    # ----------------------------------------------------------------- store access

    def _record(self) -> bytes:
        import psutil

        return json.dumps(
            {
                "token": self.token,
                "beat": self.beats,
                "host": socket.gethostname(),
                "host_id": host_id(),
                "pid": os.getpid(),
                "pid_started": psutil.Process().create_time(),
                "renewed": time.time(),  # for people: no host's clock is compared with it
                "run": self.files.name,
            }
        ).encode()

    def _put(self, expect: str | None) -> None:
        """Write this command's record over the version ``expect`` (:data:`ABSENT`: over no
        lease) where the store checks it, over whatever is there where it cannot.
        :class:`_Taken` when the store holds another command's lease instead."""
        for _ in range(3):
            try:
                self._version = self.store.write(self._record(), expect)
            except Conflict:
                found = self.store.read()
                if found is None:
                    logger.warning("the lease %s had vanished; writing it again", self.uri)
                elif (lease := _parse(found[0])).get("token") != self.token:
                    raise _Taken(lease) from None
                # Ours after all (a request retried after it had landed), or gone: again.
                expect = ABSENT if found is None else found[1]
                continue
            self.beats += 1
            return
        raise OSError("the lease changed under every conditional write")

    def _retried(self, call: Callable, doing: str):
        """``call()``, retried with backoff while the store answers with errors, for up to
        :data:`_RETRY_S`; then one line."""
        deadline, pause = time.monotonic() + _RETRY_S, 0.2
        while True:
            try:
                return call()
            except FileNotFoundError:
                raise
            except OSError as exc:
                if time.monotonic() + pause > deadline:
                    raise UserError(f"cannot {doing} {self.uri}: {first_line(exc)}") from exc
                logger.debug("%s %s failed, retrying: %s", doing, self.uri, first_line(exc))
                time.sleep(pause)
                pause = min(pause * 2, 2.0)

    # ----------------------------------------------------------------- taking it

    def acquire(self, what: str) -> None:
        found = self._retried(self.store.read, "read the lease")
        expect = ABSENT  # where the store checks it: no lease, or the stale one we watched
        if found is not None:
            held, expect = found
            if _parse(held).get("token") != self.token:
                expect = self._wait_out(held, expect, what)
        written = time.monotonic()
        try:
            self._retried(lambda: self._put(expect), "write the lease")
            self._check_conditions()
            if not self.store.conditional:
                self._read_back()
        except _Taken:
            raise UserError(
                f"{what} '{self.files.name}' was claimed by another command at the "
                "same moment; wait for it, or pick another --name"
            ) from None
        self._renewed = written
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name="lease", daemon=True)
        self._thread.start()

    def _check_conditions(self) -> None:
        """A store that would apply the conditional writes it must refuse (over the lease
        just written) gets the lease of a store without them: read back, read before
        each renewal."""
        if not self.store.conditional:
            return
        ignored = self._retried(
            lambda: self.store.ignores_conditions(self._record()), "write the lease"
        )
        if ignored:
            logger.warning(
                "%s ignores conditional writes: the lease %s is read back and read before "
                "each renewal instead",
                self.files.root,
                self.uri,
            )
            self.store.conditional = False

    def _read_back(self) -> None:
        """On a store without conditional writes: :class:`_Taken` when a rival who wrote
        at the same moment is seen."""
        time.sleep(_LEASE_SETTLE_S)
        back = self._retried(self.store.read, "read the lease")
        lease = _parse(back[0]) if back is not None else {}
        if lease.get("token") != self.token:
            raise _Taken(lease)

    def _wait_out(self, held: bytes, version: str | None, what: str) -> str | None:
        """Return once the lease ``held`` (at ``version``) is free to take: the version to
        write over (:data:`ABSENT` once it is gone). Refuse while its owner lives."""
        lease = _parse(held)
        if lease.get("host_id") == host_id():  # the owner's process table is ours
            if _alive(lease):
                raise self._refusal(lease, what, "")
            logger.info(
                "taking over the lease of %s '%s': its process (pid %s) is gone",
                what,
                self.files.name,
                lease.get("pid"),
            )
            return version
        logger.info(
            "%s '%s' has a lease (pid %s on %s): watching it for up to %.0f s to see "
            "whether it is renewed",
            what,
            self.files.name,
            lease.get("pid"),
            lease.get("host"),
            self.ttl_s,
        )
        since = time.monotonic()
        while (waited := time.monotonic() - since) < self.ttl_s:
            time.sleep(min(self.beat_s / 3, self.ttl_s - waited))
            now = self._retried(self.store.read, "read the lease")
            if now is None:
                return ABSENT  # released meanwhile
            if now[0] != held:
                raise self._refusal(_parse(now[0]), what, ", renewed while this command watched")
            version = now[1]
        logger.info(
            "taking over the lease of %s '%s': not renewed for %.0f s",
            what,
            self.files.name,
            self.ttl_s,
        )
        return version

    def _refusal(self, lease: dict, what: str, how: str) -> UserError:
        return UserError(
            f"{what} '{self.files.name}' is already running in {self.files.root} "
            f"(held by pid {lease.get('pid')} on {lease.get('host')}{how}); wait for it, "
            "or pick another --name"
        )

    # ----------------------------------------------------------------- keeping it

    def _heartbeat(self) -> None:
        wait, pause, warned = self.beat_s, 0.25, False
        while not self._stop.wait(wait):
            attempt = time.monotonic()
            try:
                if not self._renew():
                    return
            except _Taken as taken:
                lease = taken.lease
                self._lose(
                    f"the lease on run '{self.files.name}' ({self.uri}) was taken by "
                    f"another command (pid {lease.get('pid')} on {lease.get('host')})"
                )
                return
            except Exception as exc:  # a store hiccup: retried sooner, never the end
                failing = attempt - self._renewed
                if failing > self.give_up_s:
                    self._lose(
                        f"could not renew the lease on run '{self.files.name}' ({self.uri}) "
                        f"for {failing:.0f} s ({first_line(exc)}); another command may "
                        "take it over"
                    )
                    return
                if not warned:
                    logger.warning(
                        "could not renew the lease %s (%s); retrying", self.uri, first_line(exc)
                    )
                    warned = True
                wait, pause = min(pause, self.beat_s), pause * 2
                continue
            self._renewed = attempt
            wait, pause, warned = self.beat_s, 0.25, False

    def _renew(self) -> bool:
        """One renewal; False once stopped. Where the store checks it, written over the
        version this command wrote last: a rival's lease written since is refused by the
        store, never overwritten. Elsewhere read first (a rival who writes between that
        read and this write is overwritten, and seen at the next renewal)."""
        if not self.store.conditional:
            found = self.store.read()
            if found is not None and (lease := _parse(found[0])).get("token") != self.token:
                raise _Taken(lease)
            if found is None:
                logger.warning("the lease %s had vanished; writing it again", self.uri)
        if self._stop.is_set():
            return False
        self._put(self._version)
        return True

    def _lose(self, reason: str) -> None:
        if self.on_lost is not None:
            self.on_lost(reason)
        else:
            logger.warning("%s", reason)

    # ----------------------------------------------------------------- letting it go

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this command's (read back
        first: a lease another command has taken is left alone)."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join(timeout=self.beat_s + _RETRY_S)
        self._thread = None
        try:
            held = self._retried(self.store.read, "read the lease")
            if held is not None and _parse(held[0]).get("token") == self.token:
                # Conditional where the store can: a lease taken since the read stays.
                with contextlib.suppress(FileNotFoundError, Conflict):
                    self._retried(lambda: self.store.delete(held[1]), "delete the lease")
        except UserError as exc:
            logger.warning("%s; it expires %.0f s after its last renewal", exc, self.ttl_s)


class _Taken(Exception):
    """Another command's lease is in the store where this command's was to be."""

    def __init__(self, lease: dict) -> None:
        super().__init__(lease.get("token"))
        self.lease = lease


def _parse(raw: bytes) -> dict:
    """A lease's record ({} for bytes that are not one: still someone's, still watched):
    read as :func:`~.storage.parse_record` reads a record, never holding NaN or infinity."""
    try:
        value = parse_record(raw, finite=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


#: The largest process id a kernel hands out (Linux's pid_max is at most 2**22).
_MAX_PID = 2**31 - 1


def _alive(lease: dict) -> bool:
    """Whether the lease's process (pid and start time) still runs in this process table.
    A pid that is not a process id (a string, a float, a 400-digit number) names no
    process."""
    import psutil

    pid = lease.get("pid")
    if not is_count(pid, 1, _MAX_PID):
        return False
    try:
        process = psutil.Process(pid)
        return (
            process.create_time() == lease.get("pid_started")
            and process.status() != psutil.STATUS_ZOMBIE
        )
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # someone else's process: it runs
        return True
