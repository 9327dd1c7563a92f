"""Requests back to back from one shell on a warm service, beside the plain loop.

    python -m benchmarks.service_burst --data-dir ../shared/data/mnist --requests 10 \\
        --out benchmarks/results/service_burst

Starts ``raytrain-mnist service start`` (one worker, every core, its own local Ray; as
``benchmarks.compare``'s fit-service), then runs ``--requests`` one-epoch ``fit --service``
commands one after another, each a new run (another seed), and the plain loop
(``benchmarks.variants plain``, all cores) before the first and after the last. Per request:
the command's wall, its start-up (command start to first step), its training images/s, its
teardown (last evaluation to exit) and its accuracy. The figure of merit is the burst's
images/s over its whole wall (every request's 60,000 images over the sum of the requests'
walls) against the plain loop's training images/s: what a user sending runs one after
another gets, start-ups and teardowns included. Writes ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.compare import (
    SERVICE,
    _median,
    _parse_result,
    fit_row,
    loop_row,
    machine,
    run_measured,
    warm_service,
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    parser.add_argument("--dataset", default="mnist", choices=["mnist", "sample"])
    parser.add_argument("--out", default="benchmarks/results/service_burst")
    args = parser.parse_args(argv)
    args.epochs, args.batch_size = 1, 128
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    plain_command = [sys.executable, "-m", "benchmarks.variants", "plain", "--threads",
                     str(args.cores), "--data-dir", args.data_dir, "--epochs", "1",
                     "--batch-size", "128", "--dataset", args.dataset]  # fmt: skip
    plain, requests = [], []
    storage = tempfile.mkdtemp(prefix="raytrain_burst_")
    with warm_service(args, env, Path(storage)) as service_env:
        plain.append(_plain(plain_command, env))
        for i in range(args.requests):
            name = f"burst-{i}"
            command = [sys.executable, "-m", "raytrain_mnist.fit", "--service", SERVICE,
                       "--epochs", "1", "--seed", str(i), "--storage-path", storage,
                       "--name", name]  # fmt: skip
            _, start, wall, peak, _ = run_measured(command, service_env)
            summary = json.loads((Path(storage) / name / "summary.json").read_text())
            row = fit_row(summary, start, wall, peak)
            requests.append(row)
            print(f"request {i + 1:>2}: wall {wall:5.1f} s  start-up {row['startup_s']:4.1f} s"
                  f"  {row['images_per_s']:6.0f} img/s  teardown {row['teardown_s']:4.2f} s"
                  f"  acc {100 * row['final_val_accuracy']:.2f}%", flush=True)  # fmt: skip
        plain.append(_plain(plain_command, env))
    shutil.rmtree(storage, ignore_errors=True)
    result = _summarize(args, plain, requests)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


def _plain(command: list[str], env: dict) -> dict:
    result, _, wall, peak, _ = run_measured(command, env)
    row = loop_row(_parse_result(result.stdout), wall, peak)
    print(f"plain:      wall {wall:5.1f} s  {row['images_per_s']:6.0f} img/s", flush=True)
    return row


def _summarize(args, plain: list[dict], requests: list[dict]) -> dict:
    images = 60000 if args.dataset == "mnist" else 4000
    walls = [r["wall_s"] for r in requests]
    burst = images * len(requests) / sum(walls)
    plain_ips = _median([p["images_per_s"] for p in plain])
    accuracies = [r["final_val_accuracy"] for r in requests]
    return {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "load_1min": os.getloadavg()[0],
        "requests": requests,
        "plain": plain,
        "burst_images_per_s": burst,
        "plain_images_per_s": plain_ips,
        "burst_vs_plain_images_per_s": burst / plain_ips,
        # Like for like: the burst over its walls against the plain loop over its own walls,
        # and each request's training images/s against the plain loop's.
        "burst_vs_plain_wall_images_per_s": burst
        / (images / _median([p["wall_s"] for p in plain])),
        "request_training_vs_plain_images_per_s": _median([r["images_per_s"] for r in requests])
        / plain_ips,
        "request_wall_vs_plain_wall": _median(walls) / _median([p["wall_s"] for p in plain]),
        "median_startup_s": _median([r["startup_s"] for r in requests]),
        "median_teardown_s": _median([r["teardown_s"] for r in requests]),
        "mean_accuracy": sum(accuracies) / len(accuracies),
        "min_accuracy": min(accuracies),
    }


def _markdown(r: dict) -> str:
    return "\n".join([
        f"# {len(r['requests'])} requests back to back on a warm service ({r['when']})",
        "",
        f"{r['machine']}; load {r['load_1min']:.1f} at the end.",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| burst images/s (all requests' images over their walls) | {r['burst_images_per_s']:.0f} |",
        f"| plain loop's training images/s (median of 2) | {r['plain_images_per_s']:.0f} |",
        f"| burst / plain loop's training images/s | {r['burst_vs_plain_images_per_s']:.2f}x |",
        f"| burst / plain loop's images over its wall | **{r['burst_vs_plain_wall_images_per_s']:.2f}x** |",
        f"| a request's training images/s / the plain loop's (medians) | **{r['request_training_vs_plain_images_per_s']:.2f}x** |",
        f"| a request's wall / the plain loop's wall (medians) | {r['request_wall_vs_plain_wall']:.2f}x |",
        f"| start-up: command to first step (median) | {r['median_startup_s']:.2f} s |",
        f"| teardown: last evaluation to exit (median) | {r['median_teardown_s']:.2f} s |",
        f"| accuracy after one epoch, mean / min over the seeds | {100 * r['mean_accuracy']:.2f} / {100 * r['min_accuracy']:.2f} % |",
        "",
    ])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
