"""``raytrain-mnist service start|status|stop``: a warm training service.

``service start`` runs one Ray Train worker group that takes ``fit --service NAME``
requests one after another (:mod:`raytrain_mnist.driver.service`): each run then pays for
its own training, not for a controller, workers and a process group of its own. It runs in
the foreground until Ctrl-C (SIGTERM is one) or ``service stop``; ``--detach`` starts it in
the background, its output in a log file, and returns once it is ready. ``service status``
shows its workers, device, queue and what it has served; ``service stop`` ends it (the
queued requests first with ``--drain``).
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from raytrain_mnist._cli import (
    ArgumentParser,
    Command,
    add_dataclass_args,
    add_json_arg,
    emit_result,
    exit_now,
    interrupted,
    setup_logging,
)
from raytrain_mnist.config import RunSettings, check_run_name
from raytrain_mnist.display import TEXT, printable
from raytrain_mnist.errors import EXIT_FAILURE, EXIT_USAGE, UserError
from raytrain_mnist.uris import check_no_credentials

ACTIONS = ("start", "status", "stop")
#: The run settings a service takes: how its workers run and what data they hold.
SERVICE_FLAGS = (
    "num_workers",
    "use_gpu",
    "gpus_per_worker",
    "cpus_per_worker",
    "backend",
    "init_method",
    "socket_ifname",
    "dataset",
    "data_dir",
    "storage_path",
    "address",
    "max_failures",
    "max_preemptions",
    "placement_strategy",
)


def build_parser(action: str = "start") -> ArgumentParser:
    parser = ArgumentParser(
        prog=f"raytrain-mnist service {action}",
        usage="raytrain-mnist service start [--name NAME] [--num-workers N] [--use-gpu] "
        "[--storage-root PATH_OR_URI ...] [--detach] ...\n"
        "       raytrain-mnist service status [--name NAME] [--address ADDRESS] [--json]\n"
        "       raytrain-mnist service stop [--name NAME] [--address ADDRESS] [--drain]",
        description="A warm training service: one Ray Train worker group that trains "
        "`fit --service NAME` runs one after another, so each pays for its training only.",
    )
    parser.add_argument("--name", default="mnist", help="the service's name (default: mnist)")
    if action == "start":
        add_dataclass_args(
            parser,
            RunSettings,
            "workers and data",
            only=SERVICE_FLAGS,
            helps={
                "storage_path": "where the service's own Train run lives; also the storage "
                "root of requests unless --storage-root is given",
            },
        )
        parser.add_argument(
            "--groups",
            type=int,
            default=1,
            metavar="K",
            help="worker groups of --num-workers each, every one its own TorchTrainer and "
            "process group, all taking requests from the one queue: K requests train at once "
            "(default: 1)",
        )
        parser.add_argument(
            "--storage-root",
            action="append",
            default=[],
            metavar="PATH_OR_URI",
            help="a storage path runs trained by the service may live under (repeat for "
            "more; default: --storage-path)",
        )
        parser.add_argument(
            "--detach",
            action="store_true",
            help="start in the background (output in --log-file) and return once it is ready",
        )
        parser.add_argument(
            "--log-file",
            help="with --detach: where its output goes (default: NAME.service.log in the "
            "current directory)",
        )
    else:
        parser.add_argument("--address", help="the Ray cluster the service runs on")
        if action == "stop":
            parser.add_argument(
                "--drain",
                action="store_true",
                help="serve the queued requests first (default: cancel the one in flight, "
                "which stays resumable, and what waits)",
            )
        add_json_arg(parser)
    return parser


@dataclass(frozen=True)
class ServiceOptions:
    action: str
    name: str
    run: RunSettings | None = None  # start
    roots: tuple[str, ...] = ()
    groups: int = 1
    detach: bool = False
    log_file: str | None = None
    address: str | None = None  # status, stop
    drain: bool = False
    json: bool = False


def parse_options(argv: Sequence[str]) -> ServiceOptions:
    words = list(argv)
    if words[:1] in (["-h"], ["--help"]):
        build_parser().parse_args(["--help"])  # start's flags; the usage shows all three
    if not words or words[0] not in ACTIONS:
        build_parser().error(f"say what to do: {' | '.join(ACTIONS)}")
    action = words[0]
    args = build_parser(action).parse_args(words[1:])
    # It names the service's registry file and its queue actor: one plain name.
    check_run_name(args.name, "--name", "service")
    if action != "start":
        return ServiceOptions(
            action,
            args.name,
            address=args.address,
            drain=getattr(args, "drain", False),
            json=args.json,
        )
    for root in args.storage_root:
        check_no_credentials(root, "--storage-root")
    if args.log_file is not None and not args.detach:
        raise UserError("--log-file goes with --detach", EXIT_USAGE)
    return ServiceOptions(
        action,
        args.name,
        run=RunSettings.from_flags(**{f: getattr(args, f) for f in SERVICE_FLAGS}),
        roots=tuple(args.storage_root),
        groups=args.groups,
        detach=args.detach,
        log_file=args.log_file,
    )


def run(options: ServiceOptions) -> int:
    setup_logging()
    if options.action == "start":
        return _detach(options) if options.detach else _start(options)
    from raytrain_mnist.driver import service

    if options.action == "status":
        info = finite(service.status(options.name, options.address))
        emit_result(info)
        print(format_status(info))
        return 0
    info = finite(
        service.stop(options.name, options.address, "drain" if options.drain else "cancel")
    )
    emit_result(info)
    print(f"service '{TEXT(options.name)}' stopped after {info['served']} request(s)")
    return 0


def _start(options: ServiceOptions) -> int:
    from raytrain_mnist.console import Renderer
    from raytrain_mnist.driver import service

    spec = service.ServiceSpec(options.name, options.run, options.roots, options.groups)
    renderer = Renderer("lines")

    def ready(info: dict) -> None:
        print(
            f"service '{info['name']}' ready on Ray at {info['address']}: train with "
            f"`raytrain-mnist fit --service {info['name']}`",
            flush=True,
        )

    try:
        result = service.run_service(spec, renderer, ready)
    finally:
        renderer.close()
    if result.status == "failed":
        raise UserError(f"the service failed: {result.error}", EXIT_FAILURE)
    print(f"service '{TEXT(options.name)}' stopped after {result.served} request(s)")
    return interrupted() if result.interrupted else 0


def _detach(options: ServiceOptions) -> int:
    """Start the same command without ``--detach`` in its own session, its output in the
    log file, and return once the service says it is ready (or the child has ended)."""
    log = Path(options.log_file or f"{options.name}.service.log")
    words = [w for w in sys.argv[1:] if w != "--detach"]
    if "--log-file" in words:
        i = words.index("--log-file")
        del words[i : i + 2]
    words = [w for w in words if not w.startswith("--log-file=")]
    if words[:1] != ["service"]:
        words = ["service", *words]
    with open(log, "ab") as out:
        before = out.tell()  # the log may hold an earlier service's lines
        child = subprocess.Popen(
            [sys.executable, "-m", "raytrain_mnist", *words],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    while child.poll() is None:
        with open(log, "rb") as written:
            written.seek(before)
            ready = f"service '{options.name}' ready".encode() in written.read()
        if ready:
            print(f"service '{TEXT(options.name)}' started (pid {child.pid}); log: {log}")
            return 0
        time.sleep(0.2)
    raise UserError(
        f"the service ended before it was ready (exit {child.returncode}); see {log}",
        EXIT_FAILURE,
    )


def finite(value):
    """``value`` with every number that is not finite as None: ``--json`` prints JSON, and
    JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def format_status(info: dict) -> str:
    """``service status`` for people: every value as the service's queue reported it,
    escaped for the terminal, one row each (a line feed in a value never makes a row)."""
    data = info.get("data") or {}
    rows = [
        ("service", info.get("name")),
        ("workers", f"{info.get('workers', '-')} on {info.get('device', '-')}"),
        ("backend", info.get("backend")),
        ("data", f"{data.get('kind')}, {data.get('source')}"),
        ("storage roots", ", ".join(map(str, info.get("storage_roots", [])))),
        ("in flight", ", ".join(map(str, info.get("in_flight") or [])) or "-"),
        ("queue", info.get("queue")),
        ("served", info.get("served")),
        ("restarts", info.get("restarts", 0)),
        ("uptime", f"{info.get('uptime_s', 0)} s"),
        ("ray", info.get("address")),
        ("worker logs", info.get("logs") or "-"),
    ]
    groups = info.get("group_states") or []
    if len(groups) > 1:
        rows.append(("free groups", info.get("free_groups")))
        for g in groups:
            rows.append(
                (
                    f"group {g.get('group')}",
                    f"{g.get('workers')} worker(s) on {g.get('device')}, request "
                    f"{g.get('request') or '-'}, served {g.get('served')}, "
                    f"restarts {g.get('restarts')}",
                )
            )
    for key in ("stopping", "failed"):
        if info.get(key):
            rows.append((key, info[key]))
    return "\n".join(
        f"{printable(k + ':', lines=False):<15}{printable(str(v), lines=False)}" for k, v in rows
    )


COMMAND = Command("service", build_parser, parse_options, run, json=True)
cli = COMMAND.main


if __name__ == "__main__":
    exit_now(COMMAND.main())
