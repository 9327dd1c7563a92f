"""Load on `serve`: requests/s and latency for 1 and 2 replicas, batches of 1 and 32.

    python -m benchmarks.serve_load RUN_DIR_OR_CHECKPOINT [--data-dir ../shared/data/mnist]
        [--requests 2000] [--concurrency 16] [--out benchmarks/results]

One local Ray (no dashboard) for the whole benchmark; each configuration is deployed with
:func:`raytrain_mnist.driver.deployment.serving`, exactly as the command deploys it, on
127.0.0.1 only. ``--concurrency`` asyncio clients (aiohttp, which Ray brings) share
``--requests`` requests, one test image each (28x28 integers, the JSON form), after a
warm-up that is not counted.
Latency is measured per request at the client, from send to parsed answer.

Writes ``serve.json`` and ``serve.md`` into ``--out``. The clients run on the same machine
as the proxy and the replicas and compete with them for its cores: on a small shared
machine the figures are noisy and say more about one another than in absolute terms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CONFIGS = [(1, 1), (1, 32), (2, 1), (2, 32)]  # (replicas, max batch size)
_WARMUP = 100


async def load(
    url: str, images: np.ndarray, labels: np.ndarray, requests: int, concurrency: int
) -> dict:
    import aiohttp

    bodies = [json.dumps({"images": [image.tolist()]}) for image in images]
    latencies: list[float] = []
    correct = errors = 0
    next_index = 0

    async def client(session, count: int | None, record: bool) -> None:
        nonlocal next_index, correct, errors
        while True:
            index = next_index
            if count is not None and index >= count:
                return
            next_index += 1
            i = index % len(bodies)
            start = time.perf_counter()
            async with session.post(
                url + "predict", data=bodies[i], headers={"Content-Type": "application/json"}
            ) as response:
                answer = await response.json()
            if not record:
                continue
            latencies.append(time.perf_counter() - start)
            if response.status != 200:
                errors += 1
            elif answer["predictions"][0] == labels[i]:
                correct += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session, _WARMUP, False) for _ in range(concurrency)))
        next_index = 0
        start = time.perf_counter()
        await asyncio.gather(*(client(session, requests, True) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ms = sorted(1000 * t for t in latencies)
    return {
        "requests": len(ms),
        "errors": errors,
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(ms) / wall, 1),
        "p50_ms": round(statistics.median(ms), 1),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1),
        "accuracy": round(correct / len(ms), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="run directory or checkpoint to serve")
    parser.add_argument(
        "--data-dir",
        help="MNIST in torchvision's layout (default: the bundled sample's test digits)",
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)

    import ray

    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.driver.deployment import serving
    from raytrain_mnist.driver.targets import resolve_target
    from raytrain_mnist.serving.settings import ServeConfig

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # one line per row is enough
    checkpoint = resolve_target(args.target).checkpoint
    data = load_mnist(args.data_dir, "mnist" if args.data_dir else "sample", download=False)
    images, labels = data.test_images.numpy(), data.test_labels.numpy()
    replicas_most = max(r for r, _ in CONFIGS)
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, replicas_most),
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
    )
    rows = []
    try:
        for replicas, batch in CONFIGS:
            cfg = ServeConfig(
                host="127.0.0.1", port=args.port, replicas=replicas, max_batch_size=batch
            )
            with serving(cfg, checkpoint) as url:
                result = asyncio.run(load(url, images, labels, args.requests, args.concurrency))
            row = {
                "replicas": replicas,
                "max_batch_size": batch,
                **result,
                "load_average_after": round(os.getloadavg()[0], 1),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        ray.shutdown()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "checkpoint": str(checkpoint),
        "test_images": f"{len(labels)} from {data.source}",
        "requests": args.requests,
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "machine": platform.machine(),
    }
    (out / "serve.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    (out / "serve.md").write_text(markdown(meta, rows))
    print(f"wrote {out / 'serve.json'} and {out / 'serve.md'}")
    return 0


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# `serve` under load",
        "",
        f"`python -m benchmarks.serve_load`: {meta['requests']} requests of one image each "
        f"(JSON pixels), {meta['concurrency']} concurrent asyncio clients, on 127.0.0.1; Ray "
        f"{meta['ray']}, {meta['cpus']} CPUs, each replica 1 CPU and 1 torch thread.",
        "",
        "| replicas | max batch | requests/s | p50 ms | p99 ms | errors | accuracy | load avg |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['replicas']} | {r['max_batch_size']} | {r['requests_per_s']} | "
            f"{r['p50_ms']} | {r['p99_ms']} | {r['errors']} | {r['accuracy']:.4f} | "
            f"{r['load_average_after']} |"
        )
    lines += [
        "",
        "Accuracy is the share of answers that match the label (images taken in test-set "
        "order): the same in every row, since batching changes no answer.",
        "",
        "Noisy figures: the clients, Serve's proxy and the replicas share this machine's "
        f"{meta['cpus']} cores, which other work was using at the same time (the load "
        "average, 1 min, is shown after each row). With 16 clients sending one image each, a "
        "batch can hold at most 16 images, whatever the maximum. Compare the rows with one "
        "another, not with another machine.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
