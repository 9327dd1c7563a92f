"""The Ray Jobs API client behind ``submit``: the address and its token, the job's working
directory (an allow-list of this checkout), where its driver runs, and its logs and outcome.
Library code: it logs and raises, the command prints (docs/cluster.md: the rules)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from raytrain_mnist import compat
from raytrain_mnist.errors import EXIT_USAGE, ConfigError, UserError, first_line
from raytrain_mnist.net import is_loopback
from raytrain_mnist.serving.settings import TokenHash
from raytrain_mnist.uris import check_no_credentials, looks_secret, redact_uri

logger = logging.getLogger(__name__)

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
#: What ``submit`` uploads from a checkout as its job's working directory, and nothing else
#: (:func:`upload_files`): these project files (pip needs both to install the package:
#: pyproject.toml names README.md as its readme), and the package's own files.
UPLOAD_FILES = ("pyproject.toml", "README.md")
#: The package's files that travel: its modules and the serve page (its package data).
PACKAGE_SUFFIXES = (".py", ".html")
#: Left out of the uploads that ``submit`` does not make, which take a whole checkout: Ray's
#: own ``ray job submit --working-dir .`` (`.rayignore`) and ``ray up``'s rsync (cluster.yaml's
#: `rsync_exclude`): secrets (environment files, keys, cloud credentials), and bulk the cluster
#: has its own of. A deny-list misses what it does not name; ``submit`` itself uploads an
#: allow-list. One list, gitignore patterns that mean the same to rsync; tests/test_submit.py
#: holds the three equal. The checkout's data/, runs/, ... are anchored ("/runs/"): a bare
#: "runs/" also left out the package's own raytrain_mnist/driver/runs/.
EXCLUDES = [
    ".env",
    ".env.*",
    "*.pem",
    "*.key",
    ".aws/",
    ".ray/",
    "/data/",
    "/runs/",
    "/checkpoints/",
    "/mlruns/",
    "*.pt",
    "evaluation_*/",
    ".git/",
    ".venv/",
    "__pycache__/",
    "*.egg-info/",
    ".pytest_cache/",
]
#: Where a submitted ``serve`` finds what it checks tokens against: a file in the job's working
#: directory holding the token's salted hash (``TokenHash.line``), never the token. Ray keeps
#: a job's package in the GCS and unpacked on its nodes long after the job (until its cache
#: is full), so the token itself never goes: no file, no entrypoint, no ``runtime_env``.
SERVE_TOKEN_HASH_FILE = "serve-token.sha256"
#: The custom resource of cluster.yaml's driver node (ray.driver.cpu): where a job's driver
#: goes by default on a cluster that offers it.
DRIVER_RESOURCE = "job_driver"
#: ``--driver-resource none``: no resource asked, Ray's default placement (the head).
ON_THE_HEAD = "none"
_CONNECT_TIMEOUT_S = 5.0
_SETTLE_TIMEOUT_S = 60.0  # a job whose log stream ended reaches a final status within this
_STATUS_POLL_S = 0.5  # how often a followed job's status is asked (follow)
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# --------------------------------------------------------------------------- connection


def dashboard_url(address: str | None) -> str:
    """The Jobs API to talk to: ``--address``, else Ray's environment variables, else the
    dashboard ``ray dashboard cluster.yaml`` forwards (not the GCS address that
    :func:`raytrain_mnist.driver.cluster.resolve_address` finds for ``ray.init``)."""
    address = (
        address
        or os.environ.get("RAY_API_SERVER_ADDRESS")
        or os.environ.get("RAY_ADDRESS")
        or DEFAULT_ADDRESS
    )
    return address.rstrip("/")


def private_channel(url: str) -> bool:
    """Whether what is sent to ``url`` stays private: https, or this machine (the
    ``ray dashboard`` SSH tunnel listens on 127.0.0.1)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return parts.scheme == "https" or is_loopback(parts.hostname or "")


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def use_token_if_given(url: str = DEFAULT_ADDRESS) -> None:
    """Send a token whenever one is configured, unless RAY_AUTH_MODE says otherwise, and
    never unasked where it would cross the network in clear text.

    Ray's client sends a token only under ``RAY_AUTH_MODE=token``; ``ray start`` turns token
    mode on when a token exists. The client follows ``ray start`` over https and to loopback;
    a plain-http ``url`` elsewhere needs ``RAY_AUTH_MODE=token`` set by the user. Must run
    before Ray reads its configuration (the first ray import in this process).
    """
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path and not Path(path).expanduser().is_file():
        raise UserError(
            f"RAY_AUTH_TOKEN_PATH={path} is not a file; point it at the cluster's "
            "token, or unset it",
            EXIT_USAGE,
        )
    have_token = bool(
        os.environ.get("RAY_AUTH_TOKEN") or path or (Path.home() / ".ray" / "auth_token").is_file()
    )
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is None and have_token:
        if private_channel(url):
            os.environ["RAY_AUTH_MODE"] = "token"
        else:
            _warn_once(
                f"not sending the Ray token to {url}: plain http to another host can "
                "be read on the way; use https or `ray dashboard cluster.yaml` "
                f"({DEFAULT_ADDRESS}), or set RAY_AUTH_MODE=token to send it anyway"
            )
    elif mode == "token" and not have_token:
        raise UserError(
            "RAY_AUTH_MODE=token but no token: put the cluster's token in "
            "~/.ray/auth_token, or set RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN",
            EXIT_USAGE,
        )
    elif mode == "token" and not private_channel(url):
        _warn_once(
            f"sending the Ray token to {url} over plain http (RAY_AUTH_MODE=token): "
            "anyone on the way can read it; prefer https or `ray dashboard`"
        )


def check_address(url: str) -> None:
    """The forms the Jobs client takes: the dashboard's http(s)://HOST[:PORT], or a Ray
    cluster address (HOST:PORT of the GCS, ray://HOST:PORT, auto). Anything else is refused
    here, in one line, before a request goes anywhere."""
    from raytrain_mnist.config import check_ray_address

    scheme = url.split("://", 1)[0] if "://" in url else None
    if scheme in ("http", "https"):
        try:
            parts = urlsplit(url)
            ok = (
                bool(parts.hostname)
                and parts.port != 0
                and not parts.username
                and not parts.password
                and not parts.query
                and not parts.fragment
            )
        except ValueError:  # a port that is no number or beyond 65535
            ok = False
        if not ok:
            # Neither a password nor a query string is echoed to the terminal.
            raise UserError(
                f"--address {redact_uri(url)!r} is not a dashboard URL "
                "(http(s)://HOST:PORT, no credentials, no query string, e.g. "
                f"{DEFAULT_ADDRESS})",
                EXIT_USAGE,
            )
        return
    try:
        check_ray_address(url)
    except ConfigError:
        raise UserError(
            f"--address {url!r} is neither a dashboard URL (e.g. {DEFAULT_ADDRESS})"
            " nor a Ray cluster address (HOST:PORT, ray://HOST:PORT, auto)",
            EXIT_USAGE,
        ) from None


def _check_reachable(url: str) -> None:
    """Fail in seconds, with one line, where ``requests`` would wait for the TCP timeout."""
    check_address(url)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return  # a GCS address: Ray resolves it (and reports failures)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((parts.hostname, port), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise UserError(
            f"no Ray dashboard answers at {url} ({getattr(exc, 'strerror', None) or exc}); "
            "is the cluster up? `ray dashboard cluster.yaml` forwards it to "
            f"{DEFAULT_ADDRESS}"
        ) from None


@contextlib.contextmanager
def _address_from_argument_only() -> Iterator[None]:
    """Ray's client lets RAY_ADDRESS override its argument; our argument already folded it in."""
    saved = {
        k: os.environ.pop(k) for k in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS") if k in os.environ
    }
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def one_line_errors(url: str, job_id: str | None = None) -> Iterator[None]:
    """Turn what the Jobs API raises into one line that says what to do."""
    import aiohttp
    import requests
    from ray.exceptions import AuthenticationError

    try:
        yield
    except AuthenticationError as exc:
        raise _auth_error(url, 401 if "required" in str(exc).split(":", 1)[0] else 403) from None
    except aiohttp.WSServerHandshakeError as exc:
        if exc.status in (401, 403):
            raise _auth_error(url, exc.status) from None
        raise UserError(
            f"cannot follow the logs at {url}: HTTP {exc.status} {exc.message}"
        ) from None
    except (ConnectionError, requests.exceptions.RequestException, aiohttp.ClientError) as exc:
        raise UserError(
            f"lost the connection to the Ray dashboard at {url} ({first_line(exc)})"
        ) from None
    except RuntimeError as exc:
        text = str(exc)
        if job_id and ("404" in text or "does not exist" in text):
            raise UserError(
                f"no job {job_id!r} on the cluster at {url}; "
                "`raytrain-mnist submit list` shows its jobs"
            ) from None
        raise UserError(f"the Jobs API at {url} said: {first_line(exc)}") from None


def _auth_error(url: str, status: int) -> UserError:
    if status == 401:
        return UserError(
            f"the cluster at {url} requires a token (HTTP 401): put it in ~/.ray/auth_token, "
            "or set RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN (and not RAY_AUTH_MODE=disabled)"
        )
    return UserError(
        f"the cluster at {url} refused the token (HTTP 403): this client's token "
        "(RAY_AUTH_TOKEN, else RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token) is not the "
        "cluster's; `ray get-auth-token` on the head prints the right one"
    )


#: How our commands start their one error line (``_cli``).
_OURS = "raytrain-mnist: error: "


def last_line(text: str) -> str:
    """A job's message ends with the line that names the cause (the exception, the exit code)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def connect(address: str | None):
    """A JobSubmissionClient for ``address``, and the URL it talks to."""
    url = dashboard_url(address)
    check_address(url)  # before anything, the token included, is decided for it
    use_token_if_given(url)
    _check_reachable(url)
    from ray.job_submission import JobSubmissionClient

    compat.quiet_job_sdk()  # the SDK's loggers say INFO per request; ours are enough
    with one_line_errors(url), _address_from_argument_only():
        client = JobSubmissionClient(url)  # asks /api/version, which checks the token
    return client, url


# --------------------------------------------------------------------------- the job


def check_env(pairs: Sequence[str]) -> dict[str, str]:
    """``--env KEY=VALUE`` words as the job's environment variables. The job table shows
    them to anyone who can list the cluster's jobs: a name that reads as a secret
    (``*TOKEN*``, ``*SECRET*``, ``*KEY*``, ``*PASSWORD*``, ...) or a URI with credentials
    is refused, in one line that does not echo the value."""
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not _ENV_NAME.fullmatch(name):
            raise UserError(
                f"--env takes NAME=VALUE with NAME of letters, digits and '_' (e.g. "
                f"NCCL_DEBUG=INFO), got {name[:40]!r}",
                EXIT_USAGE,
            )
        if looks_secret(name):
            raise UserError(
                f"--env {name}: the job's environment is stored in the cluster's job table, "
                "which anyone who can list its jobs reads; give secrets to the nodes "
                "(their environment, instance role or files), never to the job",
                EXIT_USAGE,
            )
        try:
            check_no_credentials(value, f"--env {name}")
        except ConfigError as exc:
            raise UserError(str(exc), EXIT_USAGE) from None
        env[name] = value
    return env


def staged_token_args(parse_args: Callable[[list[str]], Any], args: list[str]) -> list[str]:
    """serve's ``args`` with their ``--auth-token-file`` or ``--auth-token-hash`` (a path
    here) replaced by ``--auth-token-hash`` :data:`SERVE_TOKEN_HASH_FILE`, in the job's
    working directory; ``parse_args`` is serve's parser, which checks the result."""
    flags = ("--auth-token-file", "--auth-token-hash")
    kept: list[str] = []
    rest = iter(args)
    for arg in rest:
        if arg == "--":
            kept += [arg, *rest]
            break
        if arg in flags:
            next(rest, None)
        elif not arg.startswith(tuple(f"{flag}=" for flag in flags)):
            kept.append(arg)
    at = kept.index("--") if "--" in kept else len(kept)
    kept[at:at] = ["--auth-token-hash", SERVE_TOKEN_HASH_FILE]
    parsed = parse_args(kept)
    if parsed.auth_token_hash != SERVE_TOKEN_HASH_FILE or parsed.auth_token_file is not None:
        raise UserError(
            "spell serve's --auth-token-file FILE or --auth-token-hash FILE out in full",
            EXIT_USAGE,
        )
    return kept


def upload_files(root: Path | None = None) -> list[str]:
    """The files (relative paths, sorted) that a job's working directory holds: in a checkout
    ``root``, :data:`UPLOAD_FILES`; and the package's own files (:data:`PACKAGE_SUFFIXES`)
    wherever it lies. Never a link, a hidden file or folder, or ``__pycache__``: whatever else
    lies in the checkout (``.envrc``, ``.netrc``, SSH and cloud keys, data, runs) stays."""
    root = Path(root) if root is not None else _PACKAGE_DIR.parent
    package = root / _PACKAGE_DIR.name

    def plain_file(path: Path) -> bool:
        return path.is_file() and not path.is_symlink() and not path.name.startswith(".")

    checkout = plain_file(root / "pyproject.toml")
    files = [name for name in UPLOAD_FILES if checkout and plain_file(root / name)]
    for folder, folders, names in os.walk(package):  # never into a linked folder
        here = Path(folder)
        folders[:] = [
            f
            for f in folders
            if f != "__pycache__" and not f.startswith(".") and not (here / f).is_symlink()
        ]
        files += [
            (here / name).relative_to(root).as_posix()
            for name in names
            if name.endswith(PACKAGE_SUFFIXES) and plain_file(here / name)
        ]
    return sorted(files)


@contextlib.contextmanager
def staged_upload(
    root: Path | None = None, serve_token_hash: TokenHash | None = None
) -> Iterator[dict]:
    """The job's runtime environment: a temporary directory holding a copy of
    :func:`upload_files` (and nothing else) as its working directory, removed once the job
    is submitted (Ray uploads it during ``submit_job``). With ``serve_token_hash``, it holds
    :data:`SERVE_TOKEN_HASH_FILE` too."""
    root = Path(root) if root is not None else _PACKAGE_DIR.parent
    with tempfile.TemporaryDirectory(prefix="raytrain_mnist-upload-") as staging:
        for name in upload_files(root):
            target = Path(staging, name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / name, target, follow_symlinks=False)
        if serve_token_hash is not None:
            # The hash hides the token; mode 0600 (Ray's zip keeps it, on every node that
            # unpacks it too) keeps other users from trying guesses against it.
            fd = os.open(
                Path(staging, SERVE_TOKEN_HASH_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600
            )
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(f"{serve_token_hash.line()}\n")
        yield {"working_dir": staging}


def driver_placement(url: str, asked: str | None) -> str | None:
    """The custom resource the job's driver asks for: ``asked`` (``--driver-resource``);
    unless told (None), :data:`DRIVER_RESOURCE` where a live node of the cluster offers it
    (cluster.yaml's driver node), so no job runs with the head's role; :data:`ON_THE_HEAD`
    or a cluster without one: None, Ray's default (the head)."""
    if asked is not None:
        return None if asked == ON_THE_HEAD else asked
    from ray.util.state import list_nodes

    try:
        with one_line_errors(url), _address_from_argument_only():
            nodes = list_nodes(address=url, filters=[("state", "=", "ALIVE")], timeout=10)
    except Exception as exc:  # the state API is an extra: placement falls back to Ray's
        logger.warning("cannot list the cluster's nodes (%s): the driver runs on the head", exc)
        return None
    offered = any((n.resources_total or {}).get(DRIVER_RESOURCE) for n in nodes)
    return DRIVER_RESOURCE if offered else None


def submit_job(
    client,
    url: str,
    entry: str,
    driver_resource: str | None = None,
    serve_token_hash: TokenHash | None = None,
    env_vars: dict[str, str] | None = None,
) -> str:
    """Submit ``entry`` with this checkout's files as its working directory; the job id."""
    # Without entrypoint resources Ray pins the driver to the head (and the head's role).
    resources = {driver_resource: 1} if driver_resource else None
    with one_line_errors(url), staged_upload(serve_token_hash=serve_token_hash) as env:
        if env_vars:
            env["env_vars"] = dict(env_vars)
        return client.submit_job(entrypoint=entry, runtime_env=env, entrypoint_resources=resources)


# --------------------------------------------------------------------------- following


def follow(client, url: str, job_id: str, write: Callable[[str], Any]):
    """Hand the job's logs to ``write`` as they come until it ends; its last status.
    Ctrl-C (``KeyboardInterrupt``) propagates: the caller decides to stop or detach.

    The end is the job's status, asked every :data:`_STATUS_POLL_S`: Ray's log stream ends
    2-4 s after the job (at the end of its file it waits a second, asks the status, waits
    again). Once the status is final the stream is dropped and the rest of the log (the
    whole file minus what was streamed) written, so nothing is lost or written twice."""
    streamed: list[str] = []

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            streamed.append(chunk)
            write(chunk)

    async def ended():
        while not (status := await asyncio.to_thread(client.get_job_status, job_id)).is_terminal():
            await asyncio.sleep(_STATUS_POLL_S)
        return status

    async def until_the_end():
        tailing, ending = asyncio.ensure_future(tail()), asyncio.ensure_future(ended())
        try:
            await asyncio.wait({tailing, ending}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (tailing, ending):
                task.cancel()
        if ending.done() and not ending.cancelled() and ending.exception() is None:
            return ending.result()
        if tailing.done() and not tailing.cancelled():
            tailing.result()  # the stream's own error, if it broke
        return None

    with one_line_errors(url, job_id):
        status = client.get_job_status(job_id)
        if status.is_terminal():  # all there is, at once
            write(client.get_job_logs(job_id))
            return status
    try:
        with one_line_errors(url, job_id):
            status = asyncio.run(until_the_end())
    except UserError as exc:
        # The stream broke; the job itself may be fine.
        logger.warning("%s", exc)
        status = None
    if status is None:  # the stream ended first (or broke): the status follows shortly
        return settle(client, url, job_id, _SETTLE_TIMEOUT_S)
    with one_line_errors(url, job_id):
        everything, sent = client.get_job_logs(job_id), "".join(streamed)
    if everything.startswith(sent):
        write(everything[len(sent) :])
    return status


def settle(client, url: str, job_id: str, timeout_s: float = _SETTLE_TIMEOUT_S):
    """The job's status once it is final, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with one_line_errors(url, job_id):
        while True:
            status = client.get_job_status(job_id)
            if status.is_terminal() or time.monotonic() > deadline:
                return status
            time.sleep(0.5)


def outcome(client, url: str, job_id: str, status, resume: str) -> None:
    """Return when the job succeeded; else raise the one line that says how it ended
    (``resume``: the command that follows it again)."""
    name = str(status)
    if name == "SUCCEEDED":
        return
    if name == "FAILED":
        with one_line_errors(url, job_id):
            message = client.get_job_info(job_id).message or "no message"
            # The message quotes the end of the job's logs as Ray had read them when the
            # job ended: on a loaded head that can stop short of the command's own error
            # line, which the log file (read now) holds.
            ours = [line for line in client.get_job_logs(job_id).splitlines() if _OURS in line]
        code = re.search(r"exit code (-?\d+)", message)
        cause = (ours[-1] if ours else last_line(message)).split(_OURS, 1)[-1].strip()
        raise UserError(f"job {job_id} failed{f' (exit code {code[1]})' if code else ''}: {cause}")
    if name == "STOPPED":
        raise UserError(f"job {job_id} was stopped")
    raise UserError(
        f"job {job_id} is still {name}, but its log stream ended; follow it again with: {resume}"
    )


def stop(client, url: str, job_id: str):
    """Stop the job; its status once that took (or after the settle timeout)."""
    with one_line_errors(url, job_id):
        client.stop_job(job_id)
    return settle(client, url, job_id)


def job_records(client, url: str) -> list[dict[str, Any]]:
    """Every job of the cluster, oldest first, as ``submit list`` shows them (and
    ``--json`` prints them): id, status, start and end (ISO 8601, UTC), entrypoint, the
    message's last line, the node its driver ran on."""
    with one_line_errors(url):
        jobs = client.list_jobs()
    jobs.sort(key=lambda j: j.start_time or 0)
    return [
        {
            "job_id": job.submission_id or job.job_id,
            "status": str(job.status),
            "started": _iso(job.start_time),
            "ended": _iso(getattr(job, "end_time", None)),
            "entrypoint": job.entrypoint,
            "message": last_line(job.message) if getattr(job, "message", None) else None,
            "driver_node_id": getattr(job, "driver_node_id", None),
        }
        for job in jobs
    ]


def _iso(milliseconds: int | None) -> str | None:
    if not milliseconds:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(milliseconds / 1000))
