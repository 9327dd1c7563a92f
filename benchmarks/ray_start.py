"""What starting and stopping a local Ray costs: ours against Ray's own.

    python -m benchmarks.ray_start --repeats 5 --out benchmarks/results/ray_start

Each trial is a new Python that starts a single-node Ray the way ``fit`` does
(``driver.cluster.start_local``: loopback, no dashboard), runs one task, and shuts it down.
Variant ``ours`` is that; ``ray-dashboard-process`` is the same with Ray's own
``Node.start_api_server`` put back, i.e. the dashboard process that Ray starts even without
a dashboard, to report usage statistics (``compat.lean_local_ray``). Trials alternate, so
the machine's drift falls on both. Per trial: ``ray.init``'s wall, the whole trial's wall
(import, start, one task, shutdown) and the machine's CPU-seconds over the trial and the
second after it (``/proc/stat``: the Ray's own processes included, and whatever else runs
here, so run it on a quiet machine). Writes ``results.json`` and ``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("ours", "ray-dashboard-process")

_TRIAL = """
import json, sys, time
started = time.monotonic()
import ray
from raytrain_mnist import compat
from raytrain_mnist.driver import cluster
if sys.argv[1] == "ray-dashboard-process":
    import contextlib
    from ray._private.node import Node
    ray_own, lean = Node.start_api_server, compat.lean_local_ray
    @contextlib.contextmanager
    def lean_but_ray_dashboard(log_monitor=False):
        with lean(log_monitor):  # restores Node.start_api_server as it ends
            Node.start_api_server = ray_own
            yield
    compat.lean_local_ray = lean_but_ray_dashboard
before = time.monotonic()
cluster.start_local(num_cpus=1, num_gpus=0, dashboard=False, log_to_driver=False)
init_s = time.monotonic() - before
assert ray.get(ray.remote(lambda: 1).remote()) == 1
ray.shutdown()
print(json.dumps({"init_s": init_s, "wall_s": time.monotonic() - started}))
"""


def _machine_cpu_s() -> float:
    with open("/proc/stat") as stat:
        user, nice, system = (int(v) for v in stat.readline().split()[1:4])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def trial(variant: str) -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    cpu = _machine_cpu_s()
    done = subprocess.run(
        [sys.executable, "-c", _TRIAL, variant],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"{variant} trial failed:\n{done.stderr[-2000:]}")
    time.sleep(1.0)  # what the Ray's processes still do as they exit
    return {**json.loads(done.stdout.splitlines()[-1]), "cpu_s": _machine_cpu_s() - cpu}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "ray_start"))
    args = parser.parse_args(argv)
    trials: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            trials[variant].append(trial(variant))
            print(variant, trials[variant][-1], flush=True)
    rows = ["| variant | `ray.init` s | trial wall s | machine CPU-s |", "|---|---:|---:|---:|"]
    for variant, runs in trials.items():
        median = {k: statistics.median(r[k] for r in runs) for k in ("init_s", "wall_s", "cpu_s")}
        rows.append(
            f"| {variant} | {median['init_s']:.2f} | {median['wall_s']:.2f} | "
            f"{median['cpu_s']:.2f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (out / "results.json").write_text(json.dumps({"at": stamp, "trials": trials}, indent=1))
    table = "\n".join(rows)
    (out / "results.md").write_text(
        f"Medians of {args.repeats} interleaved trials, {stamp}, {os.cpu_count()} cores.\n\n"
        f"{table}\n"
    )
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
