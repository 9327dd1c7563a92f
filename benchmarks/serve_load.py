"""Load on `serve` beside a plain process: requests/s and latency, and their ratio.

    python -m benchmarks.serve_load RUN_DIR_OR_CHECKPOINT [--data-dir ../shared/data/mnist]
        [--requests 2000] [--rounds 3] [--concurrency 16] [--variants default,...]
        [--out benchmarks/results]

**plain** is the same checkpoint and the same request handling code (the package's own
limits, parsing and model: :class:`raytrain_mnist.serving.app.DigitClassifier`, one image per
forward pass) behind a bare uvicorn process, one torch thread, no Ray. Each **variant** is the
real command, ``python -m raytrain_mnist serve`` with the variant's flags (and environment),
started on 127.0.0.1 with its own local Ray. The plain process runs all along; for each
variant the rounds alternate between plain and the variant (the order swapped every round),
so each serve figure has a plain figure taken within the same minute, on the same machine
state: the ratio is the result, the absolute figures move with the machine's other load.

Load: ``--concurrency`` asyncio clients (aiohttp) in this process, each sending its next
request (one test image as 28x28 JSON integers, ``Content-Type: application/json``) when its
answer has come; ``--requests`` a round after a warm-up that is not counted, and a round stops
after ``--round-s`` seconds whatever the count. Latency is measured per request at the client,
from send to parsed answer.

Writes ``serve.json`` and ``serve.md`` into ``--out``. The clients share the machine's cores
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
#: name -> (serve flags, extra environment, what it is). ``default`` is the command as a
#: user runs it; the rest are the choices docs/serve.md weighs.
VARIANTS: dict[str, tuple[list[str], dict, str]] = {
    "default": ([], {}, "serve's defaults"),
    "proxy": (["--ingress", "proxy"], {}, "Ray Serve's Python proxy (the defaults before)"),
    "proxy-throughput": (
        ["--ingress", "proxy"],
        {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
        "the Python proxy, RAY_SERVE_THROUGHPUT_OPTIMIZED=1",
    ),
    "direct": (["--ingress", "direct"], {}, "direct ingress, 1 replica, batches up to 64"),
    "direct-b1": (
        ["--ingress", "direct", "--max-batch-size", "1"],
        {},
        "direct ingress, 1 replica, no batching",
    ),
    "haproxy-2": (
        ["--ingress", "haproxy", "--replicas", "2"],
        {},
        "HAProxy in front of 2 replicas (direct ingress behind it)",
    ),
    "haproxy-1": (
        ["--ingress", "haproxy", "--replicas", "1"],
        {},
        "HAProxy in front of 1 replica",
    ),
}
DEFAULT_VARIANTS = "proxy,default"
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


def plain_server(checkpoint: str, port: int) -> None:
    """The baseline: the package's request handling behind bare uvicorn, no Ray."""
    import uvicorn

    from raytrain_mnist.driver.evaluation import load_checkpoint
    from raytrain_mnist.serving import app

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
    )


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
    parser.add_argument("--plain-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain_server:
        plain_server(args.target, args.port)
        return 0
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")

    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.driver.targets import resolve_target

    checkpoint = resolve_target(args.target).checkpoint
    data = load_mnist(args.data_dir, "mnist" if args.data_dir else "sample", download=False)
    images, labels = data.test_images.numpy(), data.test_labels.numpy()
    bodies = [json.dumps({"images": [image.tolist()]}).encode() for image in images]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_load-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)

    def run_load(url: str) -> dict:
        return asyncio.run(load(url, bodies, labels, args.requests, args.concurrency, args.round_s))

    plain_port = args.port + 1
    plain = Server(
        [sys.executable, "-m", "benchmarks.serve_load", str(checkpoint), "--plain-server"]
        + ["--port", str(plain_port)],
        {},
        logs / "plain.log",
        "",
        f"http://127.0.0.1:{plain_port}/",
    )
    rows = []
    try:
        plain.wait_ready()
        for name in names:
            flags, env, what = VARIANTS[name]
            serve = Server(
                [sys.executable, "-m", "raytrain_mnist", "serve", str(checkpoint)]
                + ["--port", str(args.port), *flags],
                {k: v for k, v in env.items()},
                logs / f"{name}.log",
                "serving ",
                f"http://127.0.0.1:{args.port}/",
            )
            try:
                serve.wait_ready()
                started = time.time()
                sides: dict[str, list[dict]] = {"plain": [], "serve": []}
                for round_ in range(args.rounds):
                    order = ("plain", "serve") if round_ % 2 == 0 else ("serve", "plain")
                    for side in order:
                        url = plain.url if side == "plain" else serve.url
                        sides[side].append(run_load(url))
                row = {
                    "variant": name,
                    "what": what,
                    "flags": flags,
                    "env": env,
                    **_pair(sides["plain"], sides["serve"]),
                    "rounds": sides,
                    "load_average": round(os.getloadavg()[0], 1),
                    "measured_s": round(time.time() - started, 1),
                }
            finally:
                code = serve.stop()
            if code not in (0, None):
                print(f"{name}: serve exited {code}; see {serve.log}", file=sys.stderr)
            summary = {k: v for k, v in row.items() if k not in ("rounds", "flags", "env")}
            print(json.dumps(summary), flush=True)
            rows.append(row)
    finally:
        plain.stop(timeout=30)

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
    (out / "serve.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    (out / "serve.md").write_text(markdown(meta, rows))
    print(f"wrote {out / 'serve.json'} and {out / 'serve.md'}")
    return 0


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
    for r in rows:
        lines.append(
            f"| {r['variant']}: {r['what']} | {r['requests_per_s']:.0f} | {r['p50_ms']:.1f} | "
            f"{r['p99_ms']:.1f} | {r['plain_requests_per_s']:.0f} | {r['plain_p99_ms']:.1f} | "
            f"{r['throughput_of_plain']:.2f} | {r['p99_over_plain']:.1f} | {r['errors']} | "
            f"{r['load_average']} |"
        )
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
