"""``raytrain-mnist submit``: run ``fit``, ``tune``, ``evaluate`` or ``serve`` on a Ray cluster
through its Jobs API and follow it, or act on jobs already submitted. The command after ``--``
is checked here by its own parse first; the client (token, upload, placement, logs) is
:mod:`raytrain_mnist.driver.jobs`; docs/cluster.md says how it behaves and why.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from raytrain_mnist._cli import ArgumentParser, Command, emit_result, exit_now, printable
from raytrain_mnist.driver import jobs
from raytrain_mnist.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, UserError
from raytrain_mnist.serving.settings import TOKEN_ENV, TokenHash

ACTIONS = ("status", "logs", "stop", "list")
#: The environment's default for --driver-resource (docs/cluster.md: where drivers run).
DRIVER_RESOURCE_VAR = "RAYTRAIN_MNIST_DRIVER_RESOURCE"
_USAGE = (
    "%(prog)s [--address URL] [--no-wait] [--driver-resource NAME]\n"
    "           [--env NAME=VALUE]... -- {fit,tune,evaluate,serve} [flags]\n"
    "       %(prog)s [--address URL] {status,stop} JOB_ID | logs [-f] JOB_ID | list [--json]"
)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist submit",
        usage=_USAGE,
        description="Submit fit, tune, evaluate or serve to a Ray cluster's Jobs API and "
        "follow it (serve runs until stopped: use --no-wait), or act on jobs already submitted.",
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
        f"$RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS, else {jobs.DEFAULT_ADDRESS}",
    )
    parser.add_argument(
        "--no-wait", action="store_true", help="print the job id and return instead of following"
    )
    parser.add_argument(
        "--driver-resource",
        metavar="NAME",
        default=os.environ.get(DRIVER_RESOURCE_VAR) or None,
        help="run the job's driver on a node that offers the custom resource NAME; "
        f"default: ${DRIVER_RESOURCE_VAR}, else {jobs.DRIVER_RESOURCE} where a node offers "
        "it (cluster.yaml's ray.driver.cpu, with the workers' IAM role), else the head; "
        f"'{jobs.ON_THE_HEAD}': the head",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable of the job (repeatable), e.g. NCCL_DEBUG=INFO; the job "
        "table shows them, so secret-looking names and URIs with credentials are refused",
    )
    parser.add_argument(
        "-f", "--follow", action="store_true", help="with logs: follow the job to its end"
    )
    parser.add_argument(
        "--json", action="store_true", help="with list: the jobs as one JSON object on stdout"
    )
    return parser


def entrypoint(command: Sequence[str]) -> str:
    """The shell command the job runs on the cluster, checked here first."""
    return job_command(command)[0]


def job_command(command: Sequence[str]) -> tuple[str, TokenHash | None]:
    """The shell command the job runs on the cluster, checked here by the command's own parse
    (flag errors exit 2 as that command's do; its paths are the cluster's and are not looked
    at), and the token's hash a ``serve`` job carries in its files (None: no token)."""
    from raytrain_mnist.__main__ import COMMANDS, load_command

    names = [name for name in COMMANDS if name != "submit"]
    if not command:
        raise UserError(f"nothing after --: name a command ({', '.join(names)})", EXIT_USAGE)
    name, args = command[0], list(command[1:])
    if name not in names:
        raise UserError(
            f"{name!r} is not a command to submit; use one of "
            f"{', '.join(names)}, e.g. -- fit --num-workers 4 --use-gpu",
            EXIT_USAGE,
        )
    the_command = load_command(name)
    options = the_command.parse(args)
    token_hash = None
    if name == "serve":
        parse_args = the_command.build_parser().parse_args
        if parse_args(args).auth_token is not None:
            raise UserError(
                "serve --auth-token would be stored in the cluster's job table, which anyone "
                f"who can list its jobs reads; set ${TOKEN_ENV} or pass "
                "--auth-token-file FILE instead (submit carries only its salted hash, in the "
                "job's files)",
                EXIT_USAGE,
            )
        token_hash = options.token_hash
        if token_hash is not None:
            args = jobs.staged_token_args(parse_args, args)
    return shlex.join(["python", "-m", f"raytrain_mnist.{name}", *args]), token_hash


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
    driver_resource: str | None = None  # asked for; None: jobs.DRIVER_RESOURCE if offered
    env: dict[str, str] = field(default_factory=dict)  # the job's environment variables
    #: The salted hash of a ``serve`` job's token, carried in its working directory (the
    #: token itself never leaves this machine).
    serve_token_hash: TokenHash | None = field(default=None, repr=False)


def parse(argv: Sequence[str]) -> SubmitOptions:
    """Submit's own flags, then the command after ``--`` through that command's parse. Raises
    SystemExit(2) or UserError for bad input; contacts no cluster."""
    argv = list(argv)
    at = argv.index("--") if "--" in argv else len(argv)
    argv, command = argv[:at], argv[at + 1 :]
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # `logs --follow ID` and `logs ID -f`
    problem = _conflict(args, bool(command))
    if problem:
        parser.error(problem)
    resource = args.driver_resource
    if resource is not None and (
        not re.fullmatch(r"[A-Za-z0-9_.:/-]+", resource)
        or resource in ("CPU", "GPU", "memory", "object_store_memory")
    ):
        raise UserError(
            f"--driver-resource {resource!r} (or ${DRIVER_RESOURCE_VAR}) is not a custom "
            f"resource name; name one that a node offers, e.g. {jobs.DRIVER_RESOURCE}, "
            f"or {jobs.ON_THE_HEAD} for the head",
            EXIT_USAGE,
        )
    env = jobs.check_env(args.env)
    entry, token_hash = job_command(command) if command else (None, None)
    address = jobs.dashboard_url(args.address)
    jobs.check_address(address)
    return SubmitOptions(
        args.action,
        args.job_id,
        args.follow,
        args.no_wait,
        address,
        entry,
        resource,
        env,
        token_hash,
    )


def _conflict(args: argparse.Namespace, command: bool) -> str | None:
    """What in submit's own flags does not go together, or None."""
    if args.action and command:
        return f"give either `{args.action}` or a command after --, not both"
    if not args.action and not command:
        return "nothing to do: submit with `-- fit [flags]`, or use status, logs, stop or list"
    if args.action in ("status", "logs", "stop") and not args.job_id:
        return f"{args.action} needs a JOB_ID (`list` shows them)"
    if args.action == "list" and args.job_id:
        return "list takes no JOB_ID"
    if args.follow and args.action != "logs":
        return "--follow goes with logs"
    if (args.no_wait or args.env) and not command:
        return "--no-wait and --env go with submitting a command"
    if args.json and args.action != "list":
        return "--json goes with list"
    return None


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _self(url: str) -> str:
    return f"python -m raytrain_mnist.submit --address {url}"


def follow(client, url: str, job_id: str) -> int:
    """Stream the job's output to stdout until it ends; its outcome as an exit status."""

    def write(chunk: str) -> None:
        sys.stdout.write(printable(chunk))
        sys.stdout.flush()

    _say(f"following job {job_id} (Ctrl-C: stop it or detach)")
    try:
        status = jobs.follow(client, url, job_id, write)
    except KeyboardInterrupt:
        return interrupted(client, url, job_id)
    return outcome(client, url, job_id, status)


def outcome(client, url: str, job_id: str, status) -> int:
    jobs.outcome(client, url, job_id, status, f"{_self(url)} logs --follow {job_id}")
    _say(f"job {job_id} succeeded")
    return 0


def interrupted(client, url: str, job_id: str, stdin=None) -> int:
    """Ctrl-C while following: stop the job, or leave it running (the default)."""
    stdin = stdin or sys.stdin
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
    _say(
        f"detached; job {job_id} keeps running; follow it with: {_self(url)} logs --follow "
        f"{job_id}; stop it with: {_self(url)} stop {job_id}"
    )
    return EXIT_INTERRUPTED


def status(client, url: str, job_id: str) -> int:
    with jobs.one_line_errors(url, job_id):
        info = client.get_job_info(job_id)
    message = f"  {jobs.last_line(info.message)}" if info.message else ""
    print(printable(f"{job_id}: {info.status}{message}"))
    return 0


def logs(client, url: str, job_id: str, keep_following: bool) -> int:
    if keep_following:
        return follow(client, url, job_id)
    with jobs.one_line_errors(url, job_id):
        sys.stdout.write(printable(client.get_job_logs(job_id)))
    return 0


def stop(client, url: str, job_id: str) -> int:
    final = jobs.stop(client, url, job_id)
    _say(f"job {job_id}: {final}")
    return 0 if final.is_terminal() else EXIT_FAILURE


def list_jobs(client, url: str) -> int:
    records = jobs.job_records(client, url)
    emit_result({"address": url, "jobs": records})  # --json: these records, as they are
    print(f"{'job':<32} {'status':<10} {'started':<20} entrypoint")
    for job in records:
        row = f"{job['job_id'] or '-':<32} {job['status']:<10} {job['started'] or '-':<20} "
        print(printable(row + job["entrypoint"], lines=False))
    return 0


def run(options: SubmitOptions) -> int:
    _warnings_to_stderr()
    client, url = jobs.connect(options.address)
    if options.entrypoint:
        resource = jobs.driver_placement(url, options.driver_resource)
        where = f"a node offering {resource}" if resource else "the head"
        job_id = jobs.submit_job(
            client, url, options.entrypoint, resource, options.serve_token_hash, options.env
        )
        if options.no_wait:
            print(job_id)
            _say(
                f"submitted {job_id} to {url} (driver on {where}); follow it with: "
                f"{_self(url)} logs --follow {job_id}"
            )
            return 0
        _say(f"submitted {job_id} to {url} (driver on {where}): {options.entrypoint}")
        return follow(client, url, job_id)
    if options.action == "status":
        return status(client, url, options.job_id)
    if options.action == "logs":
        return logs(client, url, options.job_id, options.follow)
    if options.action == "stop":
        return stop(client, url, options.job_id)
    return list_jobs(client, url)


class _WarningLines(logging.Handler):
    """The client's warnings (a token kept back, a log stream that broke), one line each on
    stderr, where everything about the job goes (stdout is the job's output)."""

    def emit(self, record: logging.LogRecord) -> None:
        line = printable(record.getMessage(), lines=False)
        print(f"raytrain-mnist: warning: {line}", file=sys.stderr, flush=True)


def _warnings_to_stderr() -> None:
    log = logging.getLogger(jobs.__name__)
    if not any(isinstance(h, _WarningLines) for h in log.handlers):
        log.addHandler(_WarningLines(logging.WARNING))
    log.propagate = False


COMMAND = Command("submit", build_parser, parse, run, json=True)
cli = COMMAND.main


if __name__ == "__main__":
    exit_now(COMMAND.main())
