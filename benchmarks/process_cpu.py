"""The CPU seconds a command costs, by process kind, Ray's processes included.

    python -m benchmarks.process_cpu -- raytrain-mnist fit --epochs 1 --num-workers 1

The command runs with a marker in its environment, which every process it starts inherits
(Ray's raylet, its workers and actors too: a Ray the command starts is its child). Every
process that carries the marker is sampled from /proc four times a second; a process's CPU
is its last sample (user + system), summed by kind (the actor's name, as Ray sets the
process title, or the program). Processes that live less than a sample are missed, so the
total is a floor. Linux only.

``--threads KIND`` also splits that kind's CPU by thread name (``/proc/PID/task``, digits
as N): whether the seconds of Ray Train's workers are the training loop's own (the main
thread) or Ray's threads beside it (gRPC, the core worker's io threads) or Gloo's.

    python -m benchmarks.process_cpu --threads ray::RayTrainWorker -- raytrain-mnist fit
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
import uuid

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_MARKER_VAR = "RAYTRAIN_MNIST_PROCESS_CPU"


def _kind(cmdline: list[bytes]) -> str:
    words = [w.decode(errors="replace") for w in cmdline if w]
    if not words:
        return "?"
    if words[0].startswith("ray::"):
        return words[0].split()[0]  # ray::RayTrainWorker, ray::IDLE, ...
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1]
    scripts = [w for w in words if w.endswith(".py") or "raylet" in w or "gcs_server" in w]
    return os.path.basename(scripts[0] if scripts else words[0])


def _cpu(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _read(path: str, mode: str = "r"):
    with open(path, mode) as f:
        return f.read()


def _sample(marker: bytes, seen: dict, threads_of: frozenset, by_thread: dict) -> None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if marker not in _read(f"/proc/{entry}/environ", "rb"):
                continue
            cpu = _cpu(_read(f"/proc/{entry}/stat"))
            kind = _kind(_read(f"/proc/{entry}/cmdline", "rb").split(b"\0"))
        except OSError:
            continue
        pid = int(entry)
        seen[pid] = (kind, max(cpu, seen.get(pid, ("", 0.0))[1]))
        if kind not in threads_of:
            continue
        try:
            tasks = os.listdir(f"/proc/{entry}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                name = _read(f"/proc/{entry}/task/{tid}/comm").strip()
                cpu = _cpu(_read(f"/proc/{entry}/task/{tid}/stat"))
            except OSError:
                continue
            by_thread[(pid, int(tid))] = (kind, re.sub(r"[0-9]+", "N", name), cpu)


def measure(command: list[str], threads_of: tuple[str, ...] = ()) -> dict:
    """Run ``command``; its wall, exit status and CPU seconds by process kind (and, for the
    kinds in ``threads_of``, by thread name)."""
    marker = uuid.uuid4().hex
    env = {**os.environ, _MARKER_VAR: marker}
    seen: dict[int, tuple[str, float]] = {}
    by_thread: dict[tuple[int, int], tuple[str, str, float]] = {}
    started = time.monotonic()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    needle, split = f"{_MARKER_VAR}={marker}".encode(), frozenset(threads_of)
    while proc.poll() is None:
        _sample(needle, seen, split, by_thread)
        time.sleep(0.25)
    wall = time.monotonic() - started
    by_kind: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter = collections.Counter()
    for kind, cpu in seen.values():
        by_kind[kind] += cpu
        count[kind] += 1
    threads: dict[str, dict[str, float]] = {k: collections.defaultdict(float) for k in threads_of}
    for kind, name, cpu in by_thread.values():
        threads[kind][name] += cpu
    kinds = sorted(by_kind, key=lambda k: -by_kind[k])
    return {
        "command": command,
        "returncode": proc.returncode,
        "stderr_tail": proc.stderr.read().decode(errors="replace")[-500:],
        "wall_s": round(wall, 2),
        "cpu_s": round(sum(by_kind.values()), 2),
        "processes": sum(count.values()),
        "by_kind": {k: {"cpu_s": round(by_kind[k], 2), "processes": count[k]} for k in kinds},
        "threads": {
            kind: {n: round(c, 2) for n, c in sorted(names.items(), key=lambda i: -i[1])}
            for kind, names in threads.items()
        },
        "load_average": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the result as JSON to this file")
    parser.add_argument(
        "--threads",
        action="append",
        default=[],
        metavar="KIND",
        help="also split this process kind's CPU by thread name (repeatable)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    result = measure(command, tuple(args.threads))
    print(f"wall {result['wall_s']:.1f} s, cpu {result['cpu_s']:.1f} s, rc {result['returncode']}")
    for kind, item in result["by_kind"].items():
        print(f"  {item['cpu_s']:6.2f} s  x{item['processes']:<2d} {kind}")
        for name, cpu in result["threads"].get(kind, {}).items():
            if cpu >= 0.01:
                print(f"      {cpu:6.2f} s  thread {name}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
