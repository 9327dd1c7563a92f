"""Run ``fit``, ``tune``, ``evaluate`` or ``serve`` on a Ray cluster through the Jobs API,
and follow it.

    python -m raytrain_mnist.submit [--address http://HOST:8265] [--no-wait] -- fit --use-gpu ...
    python -m raytrain_mnist.submit status JOB_ID | logs [--follow] JOB_ID | stop JOB_ID | list

The command after ``--`` runs on the cluster as ``python -m raytrain_mnist.<command> ...``,
in a working directory that holds this checkout's package, ``pyproject.toml`` and ``README.md``
and nothing else (an allow-list: :func:`upload_files`), so the cluster runs the code you have
here and no other file of the checkout travels. Its flags are checked here first, by the
command's own parse (the one its CLI runs): a bad flag, or a URI with credentials in it, costs
a second, not an upload. The job's output streams to stdout, everything about
the job itself goes to stderr, and the exit status is the job's outcome (0 succeeded, 1 failed
or stopped). Ctrl-C while following asks whether to stop the job or detach from it; without a
terminal it detaches and says how to stop the job.

The address is ``--address``, else ``RAY_API_SERVER_ADDRESS``, else ``RAY_ADDRESS``, else
``http://127.0.0.1:8265`` (where ``ray dashboard cluster.yaml`` forwards the head's dashboard).
Token authentication works as in Ray: ``RAY_AUTH_MODE=token`` with the token in
``~/.ray/auth_token``, ``RAY_AUTH_TOKEN_PATH`` or ``RAY_AUTH_TOKEN``. Unlike Ray's own client,
a token given through one of those is sent even when ``RAY_AUTH_MODE`` is unset (``ray start``
reads tokens the same way), but only where nobody on the way can read it: over https, or to
this machine (the ``ray dashboard`` tunnel). Another host over plain http gets it only with an
explicit ``RAY_AUTH_MODE=token``, and a warning. ``RAY_AUTH_MODE=disabled`` sends none.

What comes from the cluster (job logs, entry points, statuses, messages) is printed with its
terminal control characters shown, not obeyed (:func:`printable`).

A submitted ``serve`` never takes ``--auth-token``: the entrypoint is stored in the cluster's
job table, which ``submit list``, ``ray job list`` and the dashboard show to anyone who can
reach the Jobs API, and so is the runtime environment (its ``env_vars`` included). The token
comes from ``$RAYTRAIN_MNIST_SERVE_TOKEN`` or ``--auth-token-file FILE`` here and travels as a
file in the job's uploaded working directory (:data:`SERVE_TOKEN_FILE`, mode 0600), which the
job table names only by its content hash; the entrypoint says ``--auth-token-file`` that file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import os
import re
import shlex
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from raytrain_mnist import compat
from raytrain_mnist._cli import ArgumentParser, Command, printable
from raytrain_mnist.errors import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    UserError,
    first_line,
)
from raytrain_mnist.serving.settings import TOKEN_ENV

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
ACTIONS = ("status", "logs", "stop", "list")
_CONNECT_TIMEOUT_S = 5.0
_SETTLE_TIMEOUT_S = 60.0  # a job whose log stream ended reaches a final status within this
_PACKAGE_DIR = Path(__file__).resolve().parent
#: The environment's default for --driver-resource (docs/cluster.md: where drivers run).
DRIVER_RESOURCE_VAR = "RAYTRAIN_MNIST_DRIVER_RESOURCE"
#: Where a submitted ``serve`` finds its token: a file (mode 0600) in the job's working
#: directory, its first line the token, its second a random line that keeps the package's
#: content hash (the ``gcs://_ray_pkg_<hash>.zip`` the job table shows) from being a hash of
#: the token. Never the entrypoint, never ``runtime_env.env_vars``: the job table shows both.
SERVE_TOKEN_FILE = "serve-token"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist submit",
        usage="%(prog)s [--address URL] [--no-wait] -- {fit,tune,evaluate,serve} [flags]\n"
        "       %(prog)s [--address URL] {status,logs,stop} JOB_ID | list",
        description="Submit fit, tune, evaluate or serve to a Ray cluster's Jobs API and "
        "follow it (serve runs until stopped: use --no-wait), or act on "
        "jobs already submitted.",
        epilog="example:\n  %(prog)s --address http://127.0.0.1:8265 -- fit --num-workers 4 "
        "--use-gpu \\\n      --storage-path s3://bucket/runs",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "action", nargs="?", choices=ACTIONS, help="act on existing jobs instead of submitting one"
    )
    parser.add_argument("job_id", nargs="?", help="the job (submission id) to act on")
    parser.add_argument(
        "--address",
        help="Jobs API (dashboard) URL; default: "
        "$RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS, else " + DEFAULT_ADDRESS,
    )
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="print the job id and return instead of following the job",
    )
    parser.add_argument(
        "--driver-resource",
        metavar="NAME",
        default=os.environ.get(DRIVER_RESOURCE_VAR) or None,
        help="run the job's driver on a node that offers the custom resource NAME "
        "(cluster.yaml: job_driver, its ray.driver.cpu node with the workers' IAM role) "
        f"instead of the head; default: ${DRIVER_RESOURCE_VAR}, else off",
    )
    parser.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="with logs: follow the job to its end, exit with its outcome",
    )
    return parser


def _commands() -> dict[str, str]:
    from raytrain_mnist.__main__ import COMMANDS

    return {name: text for name, text in COMMANDS.items() if name != "submit"}


# --------------------------------------------------------------------------- connection


def resolve_address(address: str | None) -> str:
    """``--address``, else Ray's environment variables, else the forwarded dashboard."""
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
    if parts.scheme == "https":
        return True
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name that may resolve anywhere
        return False


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(f"raytrain-mnist: warning: {message}", file=sys.stderr, flush=True)


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


def check_address(url: str) -> None:
    """The forms the Jobs client takes: the dashboard's http(s)://HOST[:PORT], or a Ray
    cluster address (HOST:PORT of the GCS, ray://HOST:PORT, auto). Anything else is refused
    here, in one line, before a request goes anywhere."""
    from raytrain_mnist.config import ConfigError, check_ray_address, redact_uri

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
                f"--address {printable(redact_uri(url))!r} is not a dashboard URL "
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
def _one_line_errors(url: str, job_id: str | None = None) -> Iterator[None]:
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
            f"cannot follow the logs at {url}: HTTP {exc.status} {printable(exc.message)}"
        ) from None
    except (ConnectionError, requests.exceptions.RequestException, aiohttp.ClientError) as exc:
        raise UserError(
            f"lost the connection to the Ray dashboard at {url} ({printable(first_line(exc))})"
        ) from None
    except RuntimeError as exc:
        text = str(exc)
        if job_id and ("404" in text or "does not exist" in text):
            raise UserError(
                f"no job {job_id!r} on the cluster at {url}; "
                "`raytrain-mnist submit list` shows its jobs"
            ) from None
        raise UserError(f"the Jobs API at {url} said: {printable(first_line(exc))}") from None


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


def _last_line(text: str) -> str:
    """A job's message ends with the line that names the cause (the exception, the exit code)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return printable(lines[-1]) if lines else "no message"


def connect(address: str | None):
    """A JobSubmissionClient for ``address``, and the URL it talks to."""
    url = resolve_address(address)
    check_address(url)  # before anything, the token included, is decided for it
    use_token_if_given(url)
    _check_reachable(url)
    from ray.job_submission import JobSubmissionClient

    compat.quiet_job_sdk()  # the SDK's loggers say INFO per request; ours are enough
    with _one_line_errors(url), _address_from_argument_only():
        client = JobSubmissionClient(url)  # asks /api/version, which checks the token
    return client, url


# --------------------------------------------------------------------------- submitting


def entrypoint(command: Sequence[str]) -> str:
    """The shell command the job runs on the cluster, checked here first."""
    return job_command(command)[0]


def job_command(command: Sequence[str]) -> tuple[str, str | None]:
    """The shell command the job runs on the cluster, checked here first, and the token a
    ``serve`` job carries in its working directory (:data:`SERVE_TOKEN_FILE`; None: none)."""
    from raytrain_mnist.__main__ import load_command

    commands = _commands()
    if not command:
        raise UserError(
            f"nothing after --: name a command ({', '.join(commands)}) and its flags", EXIT_USAGE
        )
    name, args = command[0], list(command[1:])
    if name not in commands:
        raise UserError(
            f"{name!r} is not a command to submit; use one of "
            f"{', '.join(commands)}, e.g. -- fit --num-workers 4 --use-gpu",
            EXIT_USAGE,
        )
    # The command's own parse, as its CLI runs it: flag errors surface here as the command
    # reports them (exit status 2). It only parses and validates; paths in the flags
    # (--data-dir, --storage-path, a checkpoint) are the cluster's and are not looked at;
    # serve's --auth-token-file is read here, and its token travels (below).
    the_command = load_command(name)
    options = the_command.parse(args)
    token = None
    if name == "serve":
        if the_command.build_parser().parse_args(args).auth_token is not None:
            raise UserError(
                "serve --auth-token would be stored in the cluster's job table, which anyone "
                f"who can list its jobs reads; set ${TOKEN_ENV} or pass "
                "--auth-token-file FILE instead (submit carries it in the job's files)",
                EXIT_USAGE,
            )
        token = options.token
        if token is not None:
            args = _reading_the_staged_token(the_command, args)
    return shlex.join(["python", "-m", f"raytrain_mnist.{name}", *args]), token


def _reading_the_staged_token(the_command: Command, args: list[str]) -> list[str]:
    """serve's ``args`` with their ``--auth-token-file`` (a path here) replaced by the one
    that reads :data:`SERVE_TOKEN_FILE` in the job's working directory."""
    flag = "--auth-token-file"
    kept: list[str] = []
    rest = iter(args)
    for arg in rest:
        if arg == "--":
            kept += [arg, *rest]
            break
        word = arg.split("=", 1)[0]
        if len(word) > len("--auth-token") and flag.startswith(word):  # argparse's prefixes
            if "=" not in arg:
                next(rest, None)
            continue
        kept.append(arg)
    at = kept.index("--") if "--" in kept else len(kept)
    kept[at:at] = [flag, SERVE_TOKEN_FILE]
    if the_command.build_parser().parse_args(kept).auth_token_file != SERVE_TOKEN_FILE:
        raise UserError(f"spell serve's {flag} FILE out in full", EXIT_USAGE)
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
def staged_upload(root: Path | None = None, serve_token: str | None = None) -> Iterator[dict]:
    """The job's runtime environment: a temporary directory holding a copy of
    :func:`upload_files` (and nothing else) as its working directory, removed once the job
    is submitted (Ray uploads it during ``submit_job``). With ``serve_token``, it holds
    :data:`SERVE_TOKEN_FILE` too."""
    root = Path(root) if root is not None else _PACKAGE_DIR.parent
    with tempfile.TemporaryDirectory(prefix="raytrain_mnist-upload-") as staging:
        for name in upload_files(root):
            target = Path(staging, name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / name, target, follow_symlinks=False)
        if serve_token is not None:
            import secrets

            # Ray's zip keeps the mode: 0600 on every node that unpacks it, too.
            fd = os.open(
                Path(staging, SERVE_TOKEN_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600
            )
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(f"{serve_token}\n{secrets.token_hex(32)}\n")
        yield {"working_dir": staging}


def submit(
    client,
    url: str,
    entry: str,
    wait: bool,
    driver_resource: str | None = None,
    serve_token: str | None = None,
) -> int:
    # Without entrypoint resources Ray pins the driver to the head (and the head's role).
    resources = {driver_resource: 1} if driver_resource else None
    with _one_line_errors(url), staged_upload(serve_token=serve_token) as env:
        job_id = client.submit_job(
            entrypoint=entry, runtime_env=env, entrypoint_resources=resources
        )
    if not wait:
        print(job_id)
        print(
            f"submitted {job_id} to {url}; follow it with: {_self(url)} logs --follow {job_id}",
            file=sys.stderr,
        )
        return 0
    print(f"submitted {job_id} to {url}: {entry}", file=sys.stderr, flush=True)
    return follow(client, url, job_id)


def _self(url: str) -> str:
    return f"python -m raytrain_mnist.submit --address {url}"


# --------------------------------------------------------------------------- following


def follow(client, url: str, job_id: str) -> int:
    """Stream the job's logs until it ends; return its outcome as an exit status."""

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            sys.stdout.write(printable(chunk))
            sys.stdout.flush()

    print(f"following job {job_id} (Ctrl-C: stop it or detach)", file=sys.stderr, flush=True)
    with _one_line_errors(url, job_id):
        status = client.get_job_status(job_id)
        if status.is_terminal():  # all there is, at once: Ray's tail takes seconds to see it
            sys.stdout.write(printable(client.get_job_logs(job_id)))
            sys.stdout.flush()
            return outcome(client, url, job_id, status)
    try:
        with _one_line_errors(url, job_id):
            asyncio.run(tail())
    except KeyboardInterrupt:
        return interrupted(client, url, job_id)
    except UserError as exc:
        # The stream broke; the job itself may be fine.
        print(f"raytrain-mnist: warning: {exc}", file=sys.stderr)
    status = _settle(client, url, job_id, _SETTLE_TIMEOUT_S)
    return outcome(client, url, job_id, status)


def _settle(client, url: str, job_id: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    with _one_line_errors(url, job_id):
        while True:
            status = client.get_job_status(job_id)
            if status.is_terminal() or time.monotonic() > deadline:
                return status
            time.sleep(0.5)


def outcome(client, url: str, job_id: str, status) -> int:
    name = str(status)
    if name == "SUCCEEDED":
        print(f"job {job_id} succeeded", file=sys.stderr)
        return 0
    if name == "FAILED":
        with _one_line_errors(url, job_id):
            message = client.get_job_info(job_id).message or "no message"
        code = re.search(r"exit code (-?\d+)", message)
        cause = _last_line(message).removeprefix("raytrain-mnist: error: ")
        raise UserError(f"job {job_id} failed{f' (exit code {code[1]})' if code else ''}: {cause}")
    if name == "STOPPED":
        raise UserError(f"job {job_id} was stopped")
    raise UserError(
        f"job {job_id} is still {printable(name)}, but its log stream ended; follow it "
        f"again with: {_self(url)} logs --follow {job_id}"
    )


def interrupted(client, url: str, job_id: str, stdin=None) -> int:
    """Ctrl-C while following: stop the job, or leave it running (the default)."""
    stdin = stdin or sys.stdin
    how = (
        f"follow it with: {_self(url)} logs --follow {job_id}; stop it with: "
        f"{_self(url)} stop {job_id}"
    )
    answer = ""
    if stdin is not None and stdin.isatty():
        try:
            print(file=sys.stderr)
            answer = input(f"stop job {job_id} on the cluster? [y = stop / N = detach] ")
        except (EOFError, KeyboardInterrupt):
            answer = ""
    if answer.strip().lower() in ("y", "yes"):
        stop(client, url, job_id)
        return EXIT_INTERRUPTED
    print(f"detached; job {job_id} keeps running; {how}", file=sys.stderr)
    return EXIT_INTERRUPTED


# --------------------------------------------------------------------------- actions


def status(client, url: str, job_id: str) -> int:
    with _one_line_errors(url, job_id):
        info = client.get_job_info(job_id)
    message = f"  {_last_line(info.message)}" if info.message else ""
    print(f"{job_id}: {printable(info.status)}{message}")
    return 0


def logs(client, url: str, job_id: str, keep_following: bool) -> int:
    if keep_following:
        return follow(client, url, job_id)
    with _one_line_errors(url, job_id):
        sys.stdout.write(printable(client.get_job_logs(job_id)))
    return 0


def stop(client, url: str, job_id: str) -> int:
    with _one_line_errors(url, job_id):
        client.stop_job(job_id)
    status = _settle(client, url, job_id, _SETTLE_TIMEOUT_S)
    print(f"job {job_id}: {status}", file=sys.stderr)
    return 0 if status.is_terminal() else EXIT_FAILURE


def list_jobs(client, url: str) -> int:
    with _one_line_errors(url):
        jobs = client.list_jobs()
    jobs.sort(key=lambda j: j.start_time or 0)
    print(f"{'job':<32} {'status':<10} {'started':<19}  entrypoint")
    for job in jobs:
        started = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.start_time / 1000))
            if job.start_time
            else "-"
        )
        print(
            printable(
                f"{job.submission_id or job.job_id or '-':<32} {str(job.status):<10} "
                f"{started:<19}  {job.entrypoint}",
                lines=False,
            )
        )
    return 0


@dataclass(frozen=True)
class SubmitOptions:
    """What ``submit`` was asked: submit ``entrypoint`` (a command already checked here), or
    act (``action``) on jobs of the cluster at ``address``."""

    action: str | None  # status, logs, stop, list; None: submit ``entrypoint``
    job_id: str | None
    follow: bool
    no_wait: bool
    address: str  # the Jobs API: --address, else the environment's, else the default
    entrypoint: str | None  # the shell command the job runs, its flags checked
    driver_resource: str | None = None  # the custom resource the driver's node must offer
    #: The token a ``serve`` job carries in its working directory; never printed.
    serve_token: str | None = field(default=None, repr=False)


def parse(argv: Sequence[str]) -> SubmitOptions:
    """Submit's own flags, then the command after ``--`` through that command's parse. Raises
    SystemExit(2) or UserError for bad input; contacts no cluster."""
    argv = list(argv)
    command: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # `logs --follow ID` and `logs ID -f`
    if args.action and command:
        parser.error(f"give either `{args.action}` or a command after --, not both")
    if not args.action and not command:
        parser.error(
            "nothing to do: submit with `-- fit [flags]`, or use status, logs, stop or list"
        )
    if args.action in ("status", "logs", "stop") and not args.job_id:
        parser.error(f"{args.action} needs a JOB_ID (`list` shows them)")
    if args.action == "list" and args.job_id:
        parser.error("list takes no JOB_ID")
    if args.follow and args.action != "logs":
        parser.error("--follow goes with logs")
    if args.no_wait and not command:
        parser.error("--no-wait goes with submitting a command")
    resource = args.driver_resource
    if resource is not None and (
        not re.fullmatch(r"[A-Za-z0-9_.:/-]+", resource)
        or resource in ("CPU", "GPU", "memory", "object_store_memory")
    ):
        raise UserError(
            f"--driver-resource {resource!r} (or ${DRIVER_RESOURCE_VAR}) is not a custom "
            "resource name; name one that a node offers, e.g. job_driver",
            EXIT_USAGE,
        )
    entry, token = job_command(command) if command else (None, None)
    address = resolve_address(args.address)
    check_address(address)
    return SubmitOptions(
        args.action, args.job_id, args.follow, args.no_wait, address, entry, resource, token
    )


def run(options: SubmitOptions) -> int:
    client, url = connect(options.address)
    if options.entrypoint:
        return submit(
            client,
            url,
            options.entrypoint,
            wait=not options.no_wait,
            driver_resource=options.driver_resource,
            serve_token=options.serve_token,
        )
    if options.action == "status":
        return status(client, url, options.job_id)
    if options.action == "logs":
        return logs(client, url, options.job_id, options.follow)
    if options.action == "stop":
        return stop(client, url, options.job_id)
    return list_jobs(client, url)


COMMAND = Command("submit", build_parser, parse, run)
cli = COMMAND.main


if __name__ == "__main__":
    sys.exit(COMMAND.main())
