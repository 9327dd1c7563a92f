"""Load on `serve` beside a plain process: requests/s and latency, and their ratio.

    python -m benchmarks.serve_load RUN_DIR_OR_CHECKPOINT [--data-dir ../shared/data/mnist]
        [--requests 2000] [--rounds 3] [--concurrency 16] [--variants default,...]
        [--out benchmarks/results]

**plain** is the same checkpoint and the same request handling code (the package's own
limits, parsing and model: :class:`raytrain_mnist.serving.app.DigitClassifier`, one image per
forward pass) behind a bare uvicorn process, one torch thread, no Ray. Each **variant** is the
real command, ``python -m raytrain_mnist serve`` with the variant's flags (and environment),
started on 127.0.0.1 with its own local Ray; ``plain-bounded`` is not the command but a
second plain process whose uvicorn runs serve's bounded HTTP protocol
(:mod:`raytrain_mnist.serving.http`), so its ratio is what the connection bounds cost. The
plain process runs all along; for each
variant the rounds alternate between plain and the variant (the order swapped every round),
so each serve figure has a plain figure taken within the same minute, on the same machine
state: the ratio is the result, the absolute figures move with the machine's other load.

Load: ``--concurrency`` asyncio clients (aiohttp) in this process, each sending its next
request (one test image as 28x28 JSON integers, ``Content-Type: application/json``) when its
answer has come; ``--requests`` a round after a warm-up that is not counted, and a round stops
after ``--round-s`` seconds whatever the count. Latency is measured per request at the client,
from send to parsed answer.

Writes ``serve.json`` and ``serve.md`` (``--stem``) into ``--out``, after each variant. Beside
the figures, the CPU seconds each kind of process (client, proxy, HAProxy, replica, the rest
of the serve's Ray; the plain process) spent a round, per request: what the cost is made of,
and a measure that the machine's other load moves far less than requests/s. The clients share the machine's cores
with the servers: on a small machine they are part of what is measured, for plain and for
serve alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PLAIN_BOUNDED = "plain-bounded"
#: name -> (serve flags, extra environment, what it is). ``default`` is the command as a
#: user runs it; the rest are the choices docs/serve.md weighs.
VARIANTS: dict[str, tuple[list[str], dict, str]] = {
    "proxy": (
        ["--ingress", "proxy"],
        {},
        "Ray Serve's Python proxy, 1 replica (the default before)",
    ),
    "proxy-throughput": (
        ["--ingress", "proxy"],
        {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
        "the same, RAY_SERVE_THROUGHPUT_OPTIMIZED=1",
    ),
    "default": ([], {}, "serve's defaults: direct ingress, 1 replica"),
    "direct-b1": (
        ["--ingress", "direct", "--max-batch-size", "1"],
        {},
        "direct ingress, no batching (as plain)",
    ),
    "proxy-2": (["--ingress", "proxy", "--replicas", "2"], {}, "the Python proxy, 2 replicas"),
    "haproxy-2": (["--ingress", "haproxy", "--replicas", "2"], {}, "HAProxy, 2 replicas"),
    "haproxy-1": (["--ingress", "haproxy"], {}, "HAProxy, 1 replica"),
    # Not the command: plain's process again, its uvicorn running serve's bounded protocol
    # (raytrain_mnist.serving.http): what the connection bounds cost, paired with plain.
    PLAIN_BOUNDED: ([], {}, "plain with serve's HTTP bounds (serving.http)"),
}
DEFAULT_VARIANTS = f"{PLAIN_BOUNDED},proxy,default,haproxy-2"
_WARMUP = 200


# --------------------------------------------------------------------------- the load


async def load(
    url: str,
    bodies: list[bytes],
    labels: np.ndarray,
    requests: int,
    concurrency: int,
    round_s: float = 120.0,
    warmup: int = _WARMUP,
) -> dict:
    """``requests`` POST /predict from ``concurrency`` clients (after ``warmup`` more),
    stopping after ``round_s`` seconds whatever the count."""
    import aiohttp

    latencies: list[float] = []
    correct = errors = 0
    next_index = 0
    deadline = float("inf")

    async def client(session, count: int, record: bool) -> None:
        nonlocal next_index, correct, errors
        while next_index < count and time.perf_counter() < deadline:
            index = next_index
            next_index += 1
            i = index % len(bodies)
            start = time.perf_counter()
            async with session.post(
                url + "predict", data=bodies[i], headers={"Content-Type": "application/json"}
            ) as response:
                status = response.status
                answer = await response.read()
            if not record:
                continue
            latencies.append(time.perf_counter() - start)
            if status != 200:
                errors += 1
            elif json.loads(answer)["predictions"][0] == labels[i]:
                correct += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        deadline = time.perf_counter() + round_s
        await asyncio.gather(*(client(session, warmup, False) for _ in range(concurrency)))
        next_index = 0
        start = time.perf_counter()
        deadline = start + round_s
        await asyncio.gather(*(client(session, requests, True) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ms = sorted(1000 * t for t in latencies)
    return {
        "requests": len(ms),
        "errors": errors,
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(ms) / wall, 1),
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2),
        "accuracy": round(correct / len(ms), 4),
    }


# --------------------------------------------------------------------------- the servers


def plain_server(checkpoint: str, port: int, bounded: bool = False) -> None:
    """The baseline: the package's request handling behind bare uvicorn, no Ray; with
    ``bounded``, uvicorn runs serve's bounded HTTP protocol (as every serve ingress does)."""
    import uvicorn

    from raytrain_mnist.driver.evaluation import load_checkpoint
    from raytrain_mnist.serving import app, http

    state, model = load_checkpoint(checkpoint)
    classifier = app.DigitClassifier(
        model.state_dict(),
        amp=(state.get("config") or {}).get("amp", "off"),
        info={"epoch": state.get("epoch")},
        max_batch_size=1,
        use_gpu=False,
    )
    uvicorn.run(
        app.asgi(classifier),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        **({"http": http.bounded_protocol(http.Limits())} if bounded else {}),
    )


#: Process kinds the CPU accounting names, by the start of the process's name (Ray names
#: its workers ``ray::<actor class>``); the rest of a serve's processes are "ray".
_KINDS = (
    ("ray::ServeReplica", "replica"),
    ("ray::ProxyActor", "proxy"),
    ("ray::HAProxyMan", "haproxy manager"),
    ("haproxy", "haproxy"),
    ("ray::ServeController", "controller"),
)
_MARK = "SERVE_LOAD_MARK"


def cpu_seconds(mark: str) -> dict[str, float]:
    """CPU seconds (user + system) so far of every process whose environment holds
    ``SERVE_LOAD_MARK=mark`` (a Ray passes it down to all it starts), by kind."""
    import psutil

    needle = f"{_MARK}={mark}".encode()
    totals: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            process = psutil.Process(int(entry.name))
            name, times = process.name(), process.cpu_times()
        except (OSError, psutil.Error):
            continue
        kind = next((k for prefix, k in _KINDS if name.startswith(prefix)), "ray")
        if mark.endswith(("-plain", f"-{PLAIN_BOUNDED}")):
            kind = "plain"
        totals[kind] = totals.get(kind, 0.0) + times.user + times.system
    return totals


def _cpu_ms_per_request(before: dict, after: dict, client_s: float, requests: int) -> dict:
    per = {k: 1000 * (after.get(k, 0.0) - before.get(k, 0.0)) / requests for k in after}
    per["client"] = 1000 * client_s / requests
    return {k: round(v, 3) for k, v in sorted(per.items()) if v >= 0.0005}


class Server:
    """A server process (plain, or the serve command) and its log; ``url`` once it answers."""

    def __init__(self, argv: list[str], env: dict, log: Path, ready: str, url: str) -> None:
        self.log, self.url, self.ready = log, url, ready
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**os.environ, **env},
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 300) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log} ended early:\n{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.log}: not ready in {timeout} s")
            if self.ready in self.log.read_text():
                try:
                    with urllib.request.urlopen(self.url + "health", timeout=5) as answer:
                        if answer.status == 200:
                            return
                except OSError:
                    pass
            time.sleep(0.3)

    def stop(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def _pair(plain: list[dict], serve: list[dict]) -> dict:
    """Medians over the rounds of each side, and the median of the per-round ratios."""

    def med(rows: list[dict], key: str) -> float:
        return round(statistics.median(r[key] for r in rows), 2)

    def cpu(rows: list[dict]) -> dict:
        kinds = sorted({k for r in rows for k in r["cpu_ms_per_request"]})
        per = {
            k: round(statistics.median(r["cpu_ms_per_request"].get(k, 0.0) for r in rows), 3)
            for k in kinds
        }
        return {**per, "total": round(sum(per.values()), 3)}

    rps = [s["requests_per_s"] / p["requests_per_s"] for p, s in zip(plain, serve, strict=True)]
    p99 = [s["p99_ms"] / p["p99_ms"] for p, s in zip(plain, serve, strict=True)]
    return {
        "plain_requests_per_s": med(plain, "requests_per_s"),
        "plain_p50_ms": med(plain, "p50_ms"),
        "plain_p99_ms": med(plain, "p99_ms"),
        "requests_per_s": med(serve, "requests_per_s"),
        "p50_ms": med(serve, "p50_ms"),
        "p99_ms": med(serve, "p99_ms"),
        "throughput_of_plain": round(statistics.median(rps), 3),
        "p99_over_plain": round(statistics.median(p99), 2),
        "cpu_ms_per_request": cpu(serve),
        "plain_cpu_ms_per_request": cpu(plain),
        "errors": sum(r["errors"] for r in serve),
        "accuracy": serve[0]["accuracy"],
        "plain_accuracy": plain[0]["accuracy"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="run directory or checkpoint to serve")
    parser.add_argument(
        "--data-dir",
        help="MNIST in torchvision's layout (default: the bundled sample's test digits)",
    )
    parser.add_argument("--requests", type=int, default=2000, help="counted requests a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per variant, each side")
    parser.add_argument("--round-s", type=float, default=60.0, help="a round's time limit")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help=f"comma-separated, of: {', '.join(VARIANTS)} (default: {DEFAULT_VARIANTS})",
    )
    parser.add_argument("--port", type=int, default=8031, help="serve's port (plain: +1)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--stem", default="serve", help="output file names: STEM.json, STEM.md")
    parser.add_argument("--plain-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bounded", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain_server:
        plain_server(args.target, args.port, args.bounded)
        return 0
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")

    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.driver.targets import resolve_target

    checkpoint = resolve_target(args.target).checkpoint
    data = load_mnist(args.data_dir, "mnist" if args.data_dir else "sample", download=False)
    images, labels = data.test_images, data.test_labels
    bodies = [json.dumps({"images": [image.tolist()]}).encode() for image in images]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_load-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)

    def run_load(url: str, mark: str) -> dict:
        """One round, with the CPU each kind of process spent on it, per request."""
        before, client_before = cpu_seconds(mark), time.process_time()
        result = asyncio.run(
            load(url, bodies, labels, args.requests, args.concurrency, args.round_s)
        )
        after, client_s = cpu_seconds(mark), time.process_time() - client_before
        # The warm-up's requests are in the CPU figures too.
        done = result["requests"] + _WARMUP
        return {**result, "cpu_ms_per_request": _cpu_ms_per_request(before, after, client_s, done)}

    import ray

    meta = {
        "checkpoint": str(checkpoint),
        "test_images": f"{len(labels)} from {data.source}",
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    plain_port = args.port + 1
    plain = Server(
        [sys.executable, "-m", "benchmarks.serve_load", str(checkpoint), "--plain-server"]
        + ["--port", str(plain_port)],
        {_MARK: f"{os.getpid()}-plain"},
        logs / "plain.log",
        "",
        f"http://127.0.0.1:{plain_port}/",
    )
    rows: list[dict] = []
    try:
        plain.wait_ready()
        for index, name in enumerate(names):
            # A port of its own each: a stopped serve's replica can hold its port a moment.
            port = args.port + 2 + index
            rows.append(measure_variant(name, port, checkpoint, plain, logs, run_load, args))
            summary = {k: v for k, v in rows[-1].items() if k not in ("rounds", "flags", "env")}
            print(json.dumps(summary), flush=True)
            write(out / args.stem, meta, rows)  # after each variant: a failure keeps the rest
    finally:
        plain.stop(timeout=30)
    print(f"wrote {out / args.stem}.json and .md")
    return 0


def measure_variant(name, port, checkpoint, plain, logs, run_load, args) -> dict:
    """One variant's serve started, its rounds alternated with plain's, and stopped; a
    serve that does not start is a row with its error."""
    flags, env, what = VARIANTS[name]
    if name == PLAIN_BOUNDED:
        argv = [sys.executable, "-m", "benchmarks.serve_load", str(checkpoint), "--plain-server"]
        argv += ["--bounded", "--port", str(port)]
        ready = ""
    else:
        argv = [sys.executable, "-m", "raytrain_mnist", "serve", str(checkpoint)]
        argv += ["--port", str(port), *flags]
        ready = "serving "
    serve = Server(
        argv,
        {**env, _MARK: f"{os.getpid()}-{name}"},
        logs / f"{name}.log",
        ready,
        f"http://127.0.0.1:{port}/",
    )
    try:
        serve.wait_ready()
        started = time.time()
        sides: dict[str, list[dict]] = {"plain": [], "serve": []}
        for round_ in range(args.rounds):
            order = ("plain", "serve") if round_ % 2 == 0 else ("serve", "plain")
            for side in order:
                url = plain.url if side == "plain" else serve.url
                mark = f"{os.getpid()}-{'plain' if side == 'plain' else name}"
                sides[side].append(run_load(url, mark))
    except RuntimeError as exc:
        return {"variant": name, "what": what, "flags": flags, "env": env, "error": str(exc)}
    finally:
        code = serve.stop()
    if code not in (0, None):
        print(f"{name}: serve exited {code}; see {serve.log}", file=sys.stderr)
    return {
        "variant": name,
        "what": what,
        "flags": flags,
        "env": env,
        **_pair(sides["plain"], sides["serve"]),
        "rounds": sides,
        "load_average": round(os.getloadavg()[0], 1),
        "measured_s": round(time.time() - started, 1),
    }


def write(stem: Path, meta: dict, rows: list[dict]) -> None:
    stem.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "results": rows}, indent=2) + "\n"
    )
    stem.with_suffix(".md").write_text(markdown(meta, rows))


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# `serve` under load, beside a plain process",
        "",
        f"`python -m benchmarks.serve_load` ({meta['date']}): {meta['concurrency']} concurrent "
        f"asyncio clients on 127.0.0.1, one image a request (JSON pixels), "
        f"{meta['requests_per_round']} requests a round, {meta['rounds']} rounds a side, plain "
        f"and serve alternating; Ray {meta['ray']}, {meta['cpus']} CPUs. Medians over the "
        "rounds; the ratio is the median of the per-round ratios.",
        "",
        "| variant | serve req/s | p50 ms | p99 ms | plain req/s | plain p99 ms | "
        "of plain | p99 / plain | errors | load avg |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    for r in rows:
        lines.append(
            f"| {r['variant']}: {r['what']} | {r['requests_per_s']:.0f} | {r['p50_ms']:.1f} | "
            f"{r['p99_ms']:.1f} | {r['plain_requests_per_s']:.0f} | {r['plain_p99_ms']:.1f} | "
            f"{r['throughput_of_plain']:.2f} | {r['p99_over_plain']:.1f} | {r['errors']} | "
            f"{r['load_average']} |"
        )
    kinds = ["client", "proxy", "haproxy", "replica", "controller", "ray"]
    lines += [
        "",
        "CPU milliseconds per request, by process (user + system, every process of the "
        "serve's Ray; `ray`: the rest of them, GCS, raylet, dashboard, the command itself):",
        "",
        "| variant | " + " | ".join(kinds) + " | total | plain's total |",
        "|---|" + "---:|" * (len(kinds) + 2),
    ]
    for r in rows:
        cpu = r["cpu_ms_per_request"]
        cells = [f"{cpu[k]:.2f}" if k in cpu else "" for k in kinds]
        lines.append(
            f"| {r['variant']} | " + " | ".join(cells) + f" | {cpu['total']:.2f} | "
            f"{r['plain_cpu_ms_per_request']['total']:.2f} |"
        )
    for r in failed:
        lines += ["", f"{r['variant']} did not run: {r['error'].splitlines()[-1][:300]}"]
    lines += [
        "",
        "plain: the same checkpoint and request handling code (limits, parsing, model; one "
        "image a forward pass) behind bare uvicorn, one process, no Ray. The clients run on "
        "the same machine and compete with the servers for its cores, for plain and serve "
        "alike. Compare the ratios; the absolute figures move with the machine's other load.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
