"""One request to a service (:class:`ServiceRequest`), and the one place it is checked
(:func:`check_request`): what ``fit`` checks on its driver, checked again by the queue for
every client, since any Ray driver on the cluster can call the queue.

The request itself, the value the workers read, is
:class:`~raytrain_mnist.service_request.ServiceRequest`, a module of the lowest layer:
the workers read it too, and import nothing of the driver's.

Paths are checked by what they name, not by how they are spelled: a local path (and a
``file://`` URI) is resolved through every link; any other URI must hold no escape
(``%2e%2e`` is ``..`` to the store), no query, no ``.``/``..``/empty segment. The run's
directory must not be a link, and its claim must be held by the requester: a token the
requester wrote into it while holding the claim (:data:`CLAIM_FILE`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hmac
import os
from typing import Any

from raytrain_mnist.config import RunSettings, check_data_fits
from raytrain_mnist.driver.runs.claim import LOCK_FILE
from raytrain_mnist.driver.runs.storage import RunStorage, is_safe_name, is_uri
from raytrain_mnist.errors import ConfigError
from raytrain_mnist.service_request import RequestError, ServiceRequest

#: The file inside a run that names the request allowed to train it: written by the
#: requester while it holds the run's claim, compared by the queue.
CLAIM_FILE = ".service-claim"
#: What a URI may not hold: an escape, a query or fragment, a Windows separator, a space.
_NOT_IN_URI = frozenset("%?#\\ ")


# --------------------------------------------------------------------------- the checks


def check_request(values: Any, rules: dict[str, Any]) -> ServiceRequest:
    """``values`` as the service trains it, or :class:`RequestError` saying why not, in
    one line. ``rules``: the service's ``storage_roots`` (canonical), ``num_workers`` and
    ``data.train_size`` (its :meth:`~.queue.ServiceQueue.info`)."""
    request = ServiceRequest.from_dict(values)
    run = RunSettings.from_flags(num_workers=rules["num_workers"])
    try:
        check_data_fits(request.train, run, rules["data"]["train_size"])
    except ConfigError as exc:
        raise RequestError(str(exc)) from None
    if not is_safe_name(request.name):
        raise RequestError(f"run name {request.name!r} is not a plain name")
    storage = canonical(request.storage)
    roots = rules["storage_roots"]
    if storage is None or not within(storage, roots):
        raise RequestError(
            f"--storage-path {request.storage!r} is outside the service's storage roots "
            f"({', '.join(roots)}); start the service with --storage-root for it"
        )
    run_dir = f"{storage}/{request.name}"
    if _is_link(run_dir):
        raise RequestError(f"{run_dir} is a symbolic link; a run directory is never followed")
    resume = request.resume_from
    if resume is not None:
        resume = checkpoint_inside(run_dir, resume)
        if resume is None:
            raise RequestError(
                f"the checkpoint to resume from is not one of run '{request.name}''s"
            )
    check_claim(storage, request.name, request.claim)
    return dataclasses.replace(request, storage=storage, resume_from=resume)


def canonical(path: Any) -> str | None:
    """What ``path`` names, spelled one way: a local path (or ``file://`` URI) resolved
    through every link; any other URI as ``scheme://bucket/key`` once it is known to hold
    no escape, query or dot segment. None for what cannot be named safely."""
    if not isinstance(path, str) or not path or any(ord(c) < 0x20 for c in path):
        return None
    if not is_uri(path):
        return os.path.realpath(os.path.expanduser(path))
    scheme, _, rest = path.partition("://")
    if not scheme.isalnum() or any(c in _NOT_IN_URI for c in rest):
        return None
    if scheme.lower() == "file":  # file:///abs (or file://localhost/abs): a local path
        host, slash, local = rest.partition("/")
        if host not in ("", "localhost") or not slash:
            return None
        return os.path.realpath("/" + local)
    segments = rest.rstrip("/").split("/")
    if not segments[0] or any(s in ("", ".", "..") for s in segments):
        return None
    return f"{scheme.lower()}://{'/'.join(segments)}"


def within(storage: str, roots: list[str]) -> bool:
    """Whether the canonical ``storage`` is one of the canonical ``roots`` or below one."""
    return any(storage == r or storage.startswith(r.rstrip("/") + "/") for r in roots)


def within_roots(storage: str, roots: list[str]) -> bool:
    """Whether the storage path ``storage``, in any spelling, lies under one of ``roots``."""
    where = canonical(storage)
    return where is not None and within(where, [r for r in map(canonical, roots) if r])


def checkpoint_inside(run_dir: str, path: Any) -> str | None:
    """The checkpoint ``path`` (canonical) when it is a directory right inside the
    canonical ``run_dir`` by a plain name, and no link; else None."""
    where = canonical(path)
    if where is None:
        return None
    parent, _, leaf = where.rpartition("/")
    if parent != run_dir or not is_safe_name(leaf) or _is_link(where):
        return None
    return where


def _is_link(path: str) -> bool:
    return not is_uri(path) and os.path.islink(path)


def check_claim(storage: str, name: str, token: str) -> None:
    """The run is claimed by the requester: its claim is held (a local run's lock file is
    locked) and it holds the requester's token (:data:`CLAIM_FILE`)."""
    refused = RequestError(
        f"run '{name}' is not claimed by this request's requester; "
        "send it with `raytrain-mnist fit --service`"
    )
    if not token:
        raise refused
    files = RunStorage(storage, name)
    if files.local:
        if not _lock_held(os.path.join(files.dir, LOCK_FILE)):
            raise refused
        path = os.path.join(files.dir, CLAIM_FILE)
        if os.path.islink(path) or not os.path.isfile(path):
            raise refused
    elif not _lease_held(files):
        raise refused
    try:
        found = files.read_bytes(CLAIM_FILE, limit=1024)
    except Exception:  # unreadable is unclaimed
        found = None
    if found is None or not hmac.compare_digest(found.strip(), token.encode()):
        raise refused


def _lock_held(path: str) -> bool:
    """Whether some process holds the claim's ``flock`` on ``path`` (never made here)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # a lock taken here goes with the descriptor
    return False


def _lease_held(files: RunStorage) -> bool:
    """Whether a run on an object store has a lease beside it (:class:`~..runs.claim.Lease`:
    whether it is stale only its rivals can judge, by watching it)."""
    import pyarrow.fs

    lease = f"{files.base.rpartition('/')[0]}/.{files.name}.lease"
    try:
        return files.filesystem.get_file_info(lease).type == pyarrow.fs.FileType.File
    except Exception:  # a store that cannot be asked holds no claim we can see
        return False


def write_claim(files: RunStorage, token: str) -> None:
    """The requester, holding the run's claim: the token that lets its request train it."""
    if files.local:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(files.dir, CLAIM_FILE))  # never written through a link
    files.write_bytes(CLAIM_FILE, token.encode())


def forget_claim(files: RunStorage) -> None:
    """Remove the token :func:`write_claim` wrote (a refused request's run)."""
    with contextlib.suppress(Exception):  # what is left is a token no request holds
        if files.local:
            os.unlink(os.path.join(files.dir, CLAIM_FILE))
        else:
            files.filesystem.delete_file(files.path(CLAIM_FILE))
