"""`serve` under sustained load and a killed replica: memory over a soak, failures and
recovery after a fault.

    python -m benchmarks.serve_faults RUN_DIR_OR_CHECKPOINT [--soak 20000] [--sample-every 1000]
        [--concurrency 8] [--before-s 10] [--after-s 40] [--out benchmarks/results]

One local Ray on 127.0.0.1 (its dashboard on a free loopback port, for Ray's state API);
the checkpoint is deployed with :func:`raytrain_mnist.driver.deployment.serving`, exactly
as the command deploys it, with 2 replicas behind Serve's proxy (what ``--ingress auto``
picks for 2). The load is bounded: ``--concurrency`` asyncio
clients (aiohttp, as in ``benchmarks/serve_load.py``), each sending its next request when
its answer has come, one test image each, ``Content-Type: application/json`` and a loopback
``Host``.

1. **Soak**: ``--soak`` requests; every ``--sample-every`` answers, the memory of each
   replica process (RSS, PSS, USS from ``/proc/PID/smaps_rollup`` through psutil).
2. **Fault**: ``--before-s`` seconds of the same load, then one replica's process is
   SIGKILLed, and the load goes on for ``--after-s`` seconds. The replica processes are
   found through the state API (the actors of the Serve deployment, alive) and only a
   process whose environment carries this script's marker is ever signalled. Reported:
   the requests that failed (not a 200 with a prediction: an error status, a connection
   error, a timeout), when the last one failed, when answers were normal again
   (from then on, no failure and every second's p99 within twice the p99 before the kill),
   when Serve had 2 replicas running again, and p99 before, during and after.

An answer whose prediction differs from the reference (each image's answer asked once before
the soak) is counted apart, as a wrong answer: every replica holds the same weights, so there
should be none. Writes ``serve_faults.json`` into ``--out``. The clients share the machine's cores with the
proxy and the replicas: compare the phases with one another, not with another machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import signal
import socket
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MARKER_VAR = "RAYTRAIN_MNIST_BENCH_SERVE"
MB = 1024 * 1024


@dataclass
class Answer:
    """One request: when it was sent and answered (perf_counter), and how it ended."""

    sent: float
    done: float
    status: int  # HTTP status; 0 for a connection error or timeout
    ok: bool  # a 200 with a prediction in it
    what: str  # "ok", "status 503", "ClientOSError", "wrong answer" (a 200, counted apart)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours(pid: int, marker: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{MARKER_VAR}={marker}".encode() in environ


def replicas(api: str, marker: str) -> list:
    """The live replica actors of the deployment, ours only, by PID."""
    from ray.util.state import list_actors

    from raytrain_mnist.serving.app import DEPLOYMENT_NAME

    actors = list_actors(address=api, filters=[("state", "=", "ALIVE")], timeout=30)
    return sorted(
        (
            a
            for a in actors
            if a.class_name.startswith("ServeReplica:")
            and a.class_name.endswith(DEPLOYMENT_NAME)
            and ours(a.pid, marker)
        ),
        key=lambda a: a.pid,
    )


def memory(pid: int) -> dict:
    import psutil

    info = psutil.Process(pid).memory_full_info()
    return {
        "rss_mb": round(info.rss / MB, 1),
        "pss_mb": round(info.pss / MB, 1),
        "uss_mb": round(info.uss / MB, 1),
    }


class Load:
    """``concurrency`` clients sending one image per request until told to stop, each
    answer recorded; ``on_answer(count)`` runs (on the loop) after every answer."""

    def __init__(self, url: str, port: int, images: np.ndarray, reference: list[int] | None):
        self.url, self.port = url, port
        self.bodies = [json.dumps({"images": [image.tolist()]}) for image in images]
        self.reference = reference
        self.answers: list[Answer] = []

    async def run(self, concurrency: int, until, on_answer=None) -> list[Answer]:
        import aiohttp

        headers = {"Content-Type": "application/json", "Host": f"127.0.0.1:{self.port}"}
        timeout = aiohttp.ClientTimeout(total=30)
        next_index = 0
        answers: list[Answer] = []

        async def client(session) -> None:
            nonlocal next_index
            while not until(len(answers)):
                i = next_index % len(self.bodies)
                next_index += 1
                sent = time.perf_counter()
                status, ok, what = 0, False, ""
                try:
                    async with session.post(
                        self.url + "predict", data=self.bodies[i], headers=headers
                    ) as response:
                        status = response.status
                        body = await response.read()
                    if status != 200:
                        what = f"status {status}"
                    else:
                        prediction = json.loads(body)["predictions"][0]
                        ok = True
                        right = self.reference is None or prediction == self.reference[i]
                        what = "ok" if right else "wrong answer"
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
                    what = exc.__class__.__name__
                answers.append(Answer(sent, time.perf_counter(), status, ok, what))
                if on_answer is not None:
                    on_answer(len(answers))

        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return answers


def latency(answers: list[Answer]) -> dict:
    if not answers:
        return {"requests": 0}
    ms = sorted(1000 * (a.done - a.sent) for a in answers)
    span = max(a.done for a in answers) - min(a.sent for a in answers)
    return {
        "requests": len(ms),
        "failed": sum(not a.ok for a in answers),
        "wrong_answers": sum(a.what == "wrong answer" for a in answers),
        "requests_per_s": round(len(ms) / span, 1) if span > 0 else None,
        "p50_ms": round(statistics.median(ms), 1),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1),
        "max_ms": round(ms[-1], 1),
    }


def p99_ms(answers: list[Answer]) -> float:
    ms = sorted(1000 * (a.done - a.sent) for a in answers)
    return ms[min(len(ms) - 1, int(0.99 * len(ms)))]


def normal_again(answers: list[Answer], kill: float, baseline_p99: float) -> float | None:
    """The first second boundary after ``kill`` from which no request failed and every
    second's p99 (by answer time) stays within twice ``baseline_p99``."""
    after = [a for a in answers if a.done >= kill]
    if not after:
        return None
    end = max(a.done for a in after)
    seconds = int(end - kill) + 1
    buckets: list[list[Answer]] = [[] for _ in range(seconds)]
    for a in after:
        buckets[min(seconds - 1, int(a.done - kill))].append(a)
    bad = [
        s
        for s, bucket in enumerate(buckets)
        if any(not a.ok for a in bucket) or (bucket and p99_ms(bucket) > 2 * baseline_p99)
    ]
    # A request sent before the kill and answered in a later second still counts there.
    last_bad = max(bad, default=-1)
    return float(last_bad + 1) if last_bad + 1 < seconds else None


class ReplicaWatch(threading.Thread):
    """Polls Serve's status twice a second: when the deployment had how many replicas
    running (perf_counter time, count)."""

    def __init__(self) -> None:
        super().__init__(name="replica-watch", daemon=True)
        self.stop = threading.Event()
        self.seen: list[tuple[float, int]] = []

    def run(self) -> None:
        from ray import serve

        from raytrain_mnist.driver.deployment import APP_NAME
        from raytrain_mnist.serving.app import DEPLOYMENT_NAME

        while not self.stop.wait(0.5):
            try:
                app = serve.status().applications[APP_NAME]
                counts = app.deployments[DEPLOYMENT_NAME].replica_states
                self.seen.append((time.perf_counter(), int(counts.get("RUNNING", 0))))
            except Exception:  # the status call itself failed: nothing seen this round
                continue


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="run directory or checkpoint to serve")
    parser.add_argument("--data-dir", help="MNIST in torchvision's layout (default: the sample)")
    parser.add_argument("--soak", type=int, default=20_000, help="requests of the soak")
    parser.add_argument("--sample-every", type=int, default=1000, help="answers between samples")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--before-s", type=float, default=10.0)
    parser.add_argument("--after-s", type=float, default=40.0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)

    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        os.environ.pop(var, None)  # only the Ray this script starts
    marker = uuid.uuid4().hex
    os.environ[MARKER_VAR] = marker
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import ray

    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.driver.cluster import LOOPBACK, loopback_node
    from raytrain_mnist.driver.deployment import serving
    from raytrain_mnist.driver.targets import resolve_target
    from raytrain_mnist.serving.settings import ServeConfig

    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    checkpoint = resolve_target(args.target).checkpoint
    data = load_mnist(args.data_dir, "mnist" if args.data_dir else "sample", download=False)
    images = data.test_images
    dashboard_port, port = free_port(), free_port()
    api = f"http://127.0.0.1:{dashboard_port}"
    with loopback_node():
        ray.init(
            address="local",
            num_cpus=max(os.cpu_count() or 1, 3),
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=dashboard_port,
            _node_ip_address=LOOPBACK,
            logging_level="WARNING",
            log_to_driver=False,
        )
    # Serve's proxy, as `serve --replicas 2` picks it: results/serve_faults.json's ingress.
    cfg = ServeConfig(host="127.0.0.1", port=port, replicas=2, ingress="proxy")
    report: dict = {}
    try:
        with serving(cfg, checkpoint) as url:
            report = measure(url, port, images, api, marker, args)
    finally:
        ray.shutdown()
    report["meta"] = {
        "command": "python -m benchmarks.serve_faults " + " ".join(argv or sys.argv[1:]),
        "checkpoint": str(checkpoint),
        "test_images": f"{len(images)} from {data.source}",
        "replicas": 2,
        "max_batch_size": cfg.max_batch_size,
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "when": time.strftime("%Y-%m-%d %H:%M"),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_faults.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "soak"}, indent=2))
    print(f"wrote {out / 'serve_faults.json'}")
    return 0


def measure(url: str, port: int, images: np.ndarray, api: str, marker: str, args) -> dict:
    # The reference answers, one per test image, from the replicas before anything happens
    # (every replica holds the same weights). This is also the warm-up.
    warm = Load(url, port, images, None)
    answers = asyncio.run(warm.run(args.concurrency, lambda n: n >= len(images)))
    if not all(a.ok for a in answers):
        raise SystemExit(f"warm-up failed: {[a.what for a in answers if not a.ok][:5]}")
    reference = _reference(url, port, images)
    load = Load(url, port, images, reference)

    # 1. Soak: memory of each replica every --sample-every answers.
    pids = [a.pid for a in replicas(api, marker)]
    if len(pids) != 2:
        raise SystemExit(f"expected 2 replicas of ours, found {pids}")
    samples: list[dict] = []

    def sample(count: int) -> None:
        if count % args.sample_every == 0 or count == 1:
            samples.append({"requests": count, **{str(pid): memory(pid) for pid in pids}})

    sample(0)
    started = time.perf_counter()
    soak = asyncio.run(load.run(args.concurrency, lambda n: n >= args.soak, sample))
    soak_wall = time.perf_counter() - started
    print(f"soak: {latency(soak)}", flush=True)

    # 2. Fault: the same load; one replica's process is killed after --before-s.
    watch = ReplicaWatch()
    watch.start()
    victim = min(pids)
    begin = time.perf_counter()
    kill_at: list[float] = []

    def kill_on_time(count: int) -> None:
        if not kill_at and time.perf_counter() - begin >= args.before_s:
            if not ours(victim, marker):
                raise SystemExit(f"replica {victim} is not a process of this benchmark's Ray")
            os.kill(victim, signal.SIGKILL)
            kill_at.append(time.perf_counter())
            print(f"killed replica {victim} at {kill_at[0] - begin:.1f} s", flush=True)

    total_s = args.before_s + args.after_s
    fault = asyncio.run(
        load.run(args.concurrency, lambda n: time.perf_counter() - begin >= total_s, kill_on_time)
    )
    watch.stop.set()
    watch.join()
    kill = kill_at[0]
    before = [a for a in fault if a.done < kill]
    baseline = p99_ms(before)
    normal = normal_again(fault, kill, baseline)
    failed = [a for a in fault if not a.ok]
    kinds: dict[str, int] = {}
    for a in failed:
        kinds[a.what] = kinds.get(a.what, 0) + 1
    running_again = next(
        (t - kill for t, n in watch.seen if t > kill and n >= 2 and _was_down(watch, kill, t)),
        None,
    )
    normal_at = None if normal is None else kill + normal
    during = [a for a in fault if a.done >= kill and (normal_at is None or a.done < normal_at)]
    after = [] if normal_at is None else [a for a in fault if a.done >= normal_at]
    new_pids = [a.pid for a in replicas(api, marker)]
    return {
        "soak": {
            "wall_s": round(soak_wall, 1),
            **latency(soak),
            "failures": _kinds(soak),
            "replica_pids": pids,
            "memory": samples,
            "memory_growth_mb": _growth(samples, pids),
        },
        "fault": {
            "killed_pid": victim,
            "killed_at_s": round(kill - begin, 1),
            "replicas_after": new_pids,
            # Every replica once the fault phase is over: the survivor after its share of
            # the load, the new one after its first tens of seconds.
            "memory_after": {str(pid): memory(pid) for pid in new_pids if ours(pid, marker)},
            "requests": len(fault),
            "failed": len(failed),
            "failures": kinds,
            "in_flight_at_kill": sum(a.sent < kill <= a.done for a in fault),
            "last_failure_s": round(max(a.done for a in failed) - kill, 1) if failed else None,
            "normal_again_s": normal,
            "two_replicas_running_again_s": (
                None if running_again is None else round(running_again, 1)
            ),
            "before": latency(before),
            "during": latency(during),
            "after": latency(after),
            "serve_replicas_running": [
                (round(t - kill, 1), n) for t, n in watch.seen if t > kill - 2
            ],
        },
    }


def _reference(url: str, port: int, images: np.ndarray) -> list[int]:
    """Each test image's prediction, asked for in batches of 32 (the model's own answer)."""
    import urllib.request

    predictions: list[int] = []
    for start in range(0, len(images), 32):
        body = json.dumps({"images": images[start : start + 32].tolist()}).encode()
        request = urllib.request.Request(
            url + "predict",
            data=body,
            headers={"Content-Type": "application/json", "Host": f"127.0.0.1:{port}"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            predictions += json.loads(response.read())["predictions"]
    return predictions


def _was_down(watch: ReplicaWatch, kill: float, until: float) -> bool:
    """Serve saw fewer than 2 running replicas at some point between the kill and ``until``
    (else the count of 2 was seen before Serve noticed the death)."""
    return any(kill < t <= until and n < 2 for t, n in watch.seen)


def _kinds(answers: list[Answer]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for a in answers:
        if not a.ok:
            kinds[a.what] = kinds.get(a.what, 0) + 1
    return kinds


def _growth(samples: list[dict], pids: list[int]) -> dict:
    """Per replica: the change of RSS, PSS and USS from the first sample after the first
    --sample-every answers (warm caches) to the last, in MB."""
    first = next((s for s in samples if s["requests"] >= samples[-1]["requests"] / 20), None)
    if first is None or first is samples[-1]:
        return {}
    last = samples[-1]
    return {
        str(pid): {
            key: round(last[str(pid)][key] - first[str(pid)][key], 1)
            for key in ("rss_mb", "pss_mb", "uss_mb")
        }
        | {"from_requests": first["requests"], "to_requests": last["requests"]}
        for pid in pids
    }


if __name__ == "__main__":
    sys.exit(main())
