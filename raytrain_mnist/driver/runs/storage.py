"""Where a run lives, as files: a local directory or a prefix on an object store.

:class:`RunStorage` decides once whether ``<storage>/<name>`` is a local path or a URI, opens
the one pyarrow file system that reaches it, and gives a local path and a URI the same
guarantees: atomic writes (temp + fsync + rename locally, a single put on object stores),
reads that fail in one line, moving a run aside. Nothing here knows what the files mean
(:mod:`.records`) or who holds the run (:mod:`.claim`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raytrain_mnist.config import MAX_CHECKPOINT_BYTES, ConfigError, check_run_name
from raytrain_mnist.errors import EXIT_USAGE, UserError, first_line

#: The most bytes a record of a run may hold (run.json, summary.json, best.json, Ray's
#: checkpoint snapshot, a lease): ours hold kilobytes. A bigger file is refused, never read
#: whole: at most this many bytes and one more are read.
MAX_RECORD_BYTES = 8 << 20
#: The deepest a record may nest (ours nest a handful of levels): whatever walks a record
#: afterwards (a comparison, a flattening, ``--json``) never meets Python's recursion limit.
MAX_RECORD_DEPTH = 32

#: What a URI reads as more than a path (a query, a fragment, an escape, a Windows
#: separator): never inside a name recorded in a run's files.
_URI_SPECIAL = frozenset("?#%\\")


def is_uri(path: str) -> bool:
    """The one test of "is this a URI or a local path"."""
    return "://" in str(path)


def check_no_credentials(uri: str, flag: str) -> None:
    """Refuse a URI that carries credentials (:func:`raytrain_mnist.config.check_no_credentials`:
    user info, secret query parameters; the message redacts them), as a usage error."""
    from raytrain_mnist.config import ConfigError
    from raytrain_mnist.uris import check_no_credentials as check

    try:
        check(uri, flag)
    except ConfigError as exc:
        raise UserError(str(exc), EXIT_USAGE) from None


def is_safe_name(name: object) -> bool:
    """Whether ``name`` is one safe path segment, on a local disk and in a URI: what a run
    name may be (:func:`raytrain_mnist.config.check_run_name`: no ``/``, no ``.`` or ``..``,
    printable), and nothing a URI reads as more than a path. Names recorded in a run's
    files (checkpoints, trials) are followed only then."""
    if not isinstance(name, str) or any(c in _URI_SPECIAL for c in name):
        return False
    try:
        check_run_name(name)
    except ConfigError:
        return False
    return True


def parse_record(raw: bytes, finite: bool = False) -> Any:
    """The JSON value a record's bytes hold; :class:`ValueError` saying why in a few words
    when they hold none: more than :data:`MAX_RECORD_BYTES`, not JSON (or not UTF-8),
    nested deeper than :data:`MAX_RECORD_DEPTH` (or than the parser goes), or, with
    ``finite``, a number that is not finite (``NaN``, ``Infinity``, ``1e400``): a record
    this package writes without them holds none."""
    if len(raw) > MAX_RECORD_BYTES:
        raise ValueError(f"more than {MAX_RECORD_BYTES} bytes")
    hooks = {"parse_constant": _not_finite, "parse_float": _finite_float} if finite else {}
    try:
        value = json.loads(raw, **hooks)
    except RecursionError:
        raise ValueError("RecursionError: nested deeper than the JSON parser goes") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc.__class__.__name__}: {first_line(exc)}") from None
    except ValueError as exc:  # an int of over 4300 digits; NaN where it must be finite
        raise ValueError(first_line(exc)) from None
    _check_depth(value)
    return value


def _not_finite(word: str) -> float:
    raise ValueError(f"{word} where a number must be finite")


def _finite_float(word: str) -> float:
    value = float(word)
    if not math.isfinite(value):
        raise ValueError(f"{word[:40]} is out of a float's range")
    return value


def _check_depth(value: Any) -> None:
    """ValueError when ``value`` nests deeper than :data:`MAX_RECORD_DEPTH` (walked without
    recursion)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > MAX_RECORD_DEPTH:
            raise ValueError(f"nested deeper than {MAX_RECORD_DEPTH} levels")
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def atomic_write(target: Path, payload: bytes) -> None:
    """Write ``payload`` to the local file ``target`` through a temporary file beside it
    (created anew, never through a link) and a rename: a reader sees the old file or the
    new one, never half of one. On any error (a full disk included) the temporary file is
    removed and the previous file is left as it was; the error is raised. A link at
    ``target`` is replaced by the file, never written through."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself, durable (not every FS can)
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def storage_root(storage_path: str) -> str:
    """What Ray gets: an absolute local path, or the URI as given (credentials refused)."""
    if is_uri(storage_path):
        check_no_credentials(storage_path, "--storage-path")
        return storage_path.rstrip("/")
    return str(Path(storage_path).expanduser().resolve())


class RunStorage:
    """The directory ``<root>/<name>``; ``root`` as :func:`storage_root` returns it.

    ``dir`` is how the directory is named to users and to Ray (a local path or a URI);
    ``filesystem`` and ``base`` are the pyarrow file system that holds it and its path there,
    opened on first use.
    """

    def __init__(self, root: str, name: str) -> None:
        self.root = root
        self.name = name
        self.dir = f"{root.rstrip('/')}/{name}"
        self.local = not is_uri(root)
        self._filesystem = None
        self._base = ""

    def sibling(self, name: str) -> RunStorage:
        """The directory ``<root>/<name>``, beside this one."""
        return RunStorage(self.root, name)

    # ----------------------------------------------------------------- the file system

    @property
    def filesystem(self):
        """The pyarrow file system that holds this directory."""
        self._open()
        return self._filesystem

    @property
    def base(self) -> str:
        """This directory's path inside :attr:`filesystem`."""
        self._open()
        return self._base

    def _open(self) -> None:
        if self._filesystem is not None:
            return
        import pyarrow.fs

        if self.local:
            self._filesystem, self._base = pyarrow.fs.LocalFileSystem(), self.dir
            return
        try:
            self._filesystem, self._base = pyarrow.fs.FileSystem.from_uri(self.dir)
        except (ValueError, OSError) as exc:
            raise UserError(f"--storage-path {self.root}: {first_line(exc)}", EXIT_USAGE) from exc

    def path(self, name: str = "") -> str:
        """The path of ``name`` (a file in this directory) inside :attr:`filesystem`."""
        return f"{self.base}/{name}" if name else self.base

    def _type(self, path: str):
        try:
            return self.filesystem.get_file_info(path).type
        except OSError as exc:
            raise UserError(f"cannot reach {self.dir}: {first_line(exc)}") from exc

    # ----------------------------------------------------------------- files

    def exists(self, name: str = "") -> bool:
        import pyarrow.fs

        return self._type(self.path(name)) != pyarrow.fs.FileType.NotFound

    def is_file(self, name: str) -> bool:
        import pyarrow.fs

        return self._type(self.path(name)) == pyarrow.fs.FileType.File

    def has_files(self) -> bool:
        """Whether anything is in this directory."""
        if self.local:
            return Path(self.dir).is_dir() and any(Path(self.dir).iterdir())
        return self.exists()

    def read_bytes(self, name: str, limit: int = MAX_RECORD_BYTES) -> bytes | None:
        """The file's bytes, None when it is no file. A file of more than ``limit`` bytes
        is refused in one line (:class:`UserError`) before it is read, and no more than
        ``limit`` bytes and one are ever read (a file that grows meanwhile, a store whose
        listing lies)."""
        import pyarrow.fs

        path = self.path(name)
        try:
            info = self.filesystem.get_file_info(path)
        except OSError as exc:
            raise UserError(f"cannot reach {self.dir}: {first_line(exc)}") from exc
        if info.type != pyarrow.fs.FileType.File:
            return None
        too_big = UserError(
            f"{self.dir}/{name} is unreadable (more than {limit} bytes, more than a record "
            "of raytrain_mnist holds); move the run away or pick another --name"
        )
        if info.size is not None and info.size > limit:
            raise too_big
        try:
            with self.filesystem.open_input_stream(path) as f:
                raw = f.read(limit + 1)
        except OSError as exc:
            raise UserError(f"{self.dir}/{name} is unreadable ({first_line(exc)})") from exc
        if len(raw) > limit:
            raise too_big
        return raw

    def read_json(self, name: str, finite: bool = False) -> dict | None:
        """A JSON record of the run (:func:`parse_record`; ``finite``: one that never
        holds NaN or infinity); None when absent, one line (:class:`UserError`) when it is
        not a record of ours."""
        raw = self.read_bytes(name)
        if raw is None:
            return None
        try:
            value = parse_record(raw, finite)
        except ValueError as exc:
            raise UserError(
                f"{self.dir}/{name} is unreadable ({exc}); move the run away or pick another --name"
            ) from exc
        if not isinstance(value, dict):
            raise UserError(
                f"{self.dir}/{name} is not a run file of raytrain_mnist; pick another --name"
            )
        return value

    def write_bytes(self, name: str, payload: bytes) -> str:
        """Atomically: a reader sees the old file or the new one, never half of one. A
        write that fails (a full disk) leaves the previous file intact and no temporary
        file behind, and is one line (:class:`UserError`)."""
        if self.local:
            target = Path(self.dir) / name
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(target, payload)
            except OSError as exc:
                raise UserError(
                    f"cannot write {target} ({exc.strerror or first_line(exc)}); "
                    f"the previous {target.name}, if any, is kept"
                ) from exc
            return str(target)
        # An object store's single PUT is atomic: the object appears whole or not at all.
        try:
            with self.filesystem.open_output_stream(self.path(name)) as f:
                f.write(payload)
        except OSError as exc:
            raise UserError(f"cannot write {self.dir}/{name} ({first_line(exc)})") from exc
        return f"{self.dir}/{name}"

    def write_json(self, name: str, record: dict) -> str:
        return self.write_bytes(name, json.dumps(record, indent=2).encode())

    # ----------------------------------------------------------------- the directory

    def contains(self, path: str) -> bool:
        """Whether ``path`` lies inside this directory: locally once every link is
        resolved; in a URI, below this directory by safe segments only (no ``..``, nothing
        a URI reads as more than a path, so never another bucket or host)."""
        if not isinstance(path, str) or is_uri(path) != (not self.local):
            return False
        if self.local:
            try:
                Path(path).resolve().relative_to(Path(self.dir).resolve())
                return True
            except (ValueError, OSError):
                return False
        prefix = self.dir + "/"
        if not path.startswith(prefix):
            return False
        return all(is_safe_name(part) for part in path[len(prefix) :].rstrip("/").split("/"))

    def check_writable(self) -> None:
        """Refuse (exit 2), in one line, a local storage path where this directory cannot
        be made: a file, or a directory this user cannot write. On an object store, make
        the storage directory the way Ray Train makes the run's and every checkpoint's
        (pyarrow's ``create_dir``, which on S3 first sends HeadBucket: that needs
        ``s3:ListBucket`` on the bucket, docs/iam/README.md), so that credentials Ray Train
        could not checkpoint with fail here in one line (exit 1), before any Ray starts."""
        if not self.local:
            try:
                self.filesystem.create_dir(self.base.rpartition("/")[0])
            except OSError as exc:
                raise UserError(
                    f"cannot create {self.dir}, where the run keeps its checkpoints: "
                    f"{first_line(exc)}"
                ) from exc
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

    def move_aside(self) -> str:
        """Move this directory to the first free ``NAME.previous-N`` beside it; returns that
        name."""
        n = 1
        while self.sibling(f"{self.name}.previous-{n}").exists():
            n += 1
        kept = self.sibling(f"{self.name}.previous-{n}")
        if self.local:
            Path(self.dir).rename(kept.dir)
        else:
            # Object stores cannot rename a prefix: copy every object, then drop the originals.
            import pyarrow.fs

            fs, base = self.filesystem, self.base
            files = [
                info
                for info in fs.get_file_info(pyarrow.fs.FileSelector(base, recursive=True))
                if info.type == pyarrow.fs.FileType.File
            ]
            for info in files:
                fs.copy_file(info.path, kept.path() + info.path[len(base) :])
            fs.delete_dir(base)
        return kept.name


@contextlib.contextmanager
def local_copy(checkpoint: str, limit: int | None = None) -> Iterator[Path]:
    """A local directory holding ``checkpoint`` (itself, or a download of it).

    A download is bounded: a checkpoint that lists more than ``limit`` bytes (default
    :data:`MAX_CHECKPOINT_BYTES`) is refused before anything is fetched, the bytes are
    counted while copying (an object that grows meanwhile is cut off), and an object whose
    key would lead outside the directory (``..``, empty segments) is refused.
    :class:`UserError`, one line."""
    if not is_uri(checkpoint):
        yield Path(checkpoint)
        return
    import pyarrow.fs

    limit = MAX_CHECKPOINT_BYTES if limit is None else limit

    def refused(why: str) -> UserError:
        return UserError(f"refusing to download checkpoint {checkpoint}: {why}")

    try:
        fs, base = pyarrow.fs.FileSystem.from_uri(checkpoint)
        base = base.rstrip("/")
        listing = fs.get_file_info(pyarrow.fs.FileSelector(base, recursive=True))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read checkpoint {checkpoint}: {first_line(exc)}") from exc
    files: list[tuple[str, list[str]]] = []
    total = 0
    for info in listing:
        if info.type != pyarrow.fs.FileType.File:
            continue
        relative = info.path[len(base) + 1 :] if info.path.startswith(base + "/") else ""
        parts = relative.split("/")
        if not relative or any(part in ("", ".", "..") for part in parts):
            raise refused(f"it holds {info.path!r}, not a plain path inside it ('..' or '//')")
        files.append((info.path, parts))
        total += max(info.size or 0, 0)
    if total > limit:
        raise refused(
            f"it holds {total} bytes, more than the {limit} bytes a checkpoint of "
            "raytrain_mnist may hold"
        )
    with tempfile.TemporaryDirectory(prefix="raytrain_mnist-ckpt-") as tmp:
        copied = 0
        try:
            for source, parts in files:
                local = Path(tmp, *parts)
                local.parent.mkdir(parents=True, exist_ok=True)
                with fs.open_input_stream(source) as src, open(local, "xb") as dst:
                    while chunk := src.read(1 << 20):
                        copied += len(chunk)
                        if copied > limit:
                            raise refused(f"it grew past {limit} bytes while downloading")
                        dst.write(chunk)
        except OSError as exc:
            raise UserError(f"cannot read checkpoint {checkpoint}: {first_line(exc)}") from exc
        yield Path(tmp)
