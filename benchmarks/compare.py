"""Ray Train against plain PyTorch and torchrun, side by side, in one run.

    python -m benchmarks.compare --data-dir ../shared/data/mnist --out benchmarks/results

Variants (same ConvNet, data, global batch size, optimizer, CPU threads):

    plain         one process, no Ray, no DDP: the floor (all cores as torch threads)
    torchrun      torchrun --nproc_per_node N, DDP over Gloo (1 thread each)
    fit-1         python -m raytrain_mnist.fit --num-workers 1 (all cores as threads)
    fit-N         python -m raytrain_mnist.fit --num-workers N (the default command)
    ray-example   Ray's documented pattern: torchvision dataset, per-sample ToTensor,
                  plain DataLoader, prepare_data_loader (1 worker, all cores as threads)

Each is measured from command start: steady-state images/s (the last epoch, after warm-up),
start-up (command start to the first training step), time to 99.0 % test accuracy (for
`fit`, command start to exit: the whole user experience) and peak memory of the process
tree (Ray's processes included). Medians over ``--repeats``; the spread between repeats is
printed as the noise. Writes ``results.json`` and ``results.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def _tree_rss_mb(pid: int) -> float:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def run_measured(command: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run ``command``; return (result, wall seconds, peak RSS of its process tree in MB)."""
    start = time.time()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=REPO, env={**env, "BENCH_T0": repr(start)})
    peak = [0.0]

    def sample() -> None:
        while process.poll() is None:
            peak[0] = max(peak[0], _tree_rss_mb(process.pid))
            time.sleep(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = process.communicate()
    sampler.join()
    wall = time.time() - start
    result = subprocess.CompletedProcess(command, process.returncode, out, "")
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out[-3000:]}")
    return result, wall, peak[0]


def _parse_result(out: str) -> dict:
    for line in out.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"no RESULT line in:\n{out[-2000:]}")


def measure_variant(name: str, args, env: dict, storage: Path) -> dict:
    py = sys.executable
    common = ["--data-dir", args.data_dir, "--epochs", str(args.epochs),
              "--batch-size", str(args.batch_size)]
    cores, n = args.cores, args.workers
    if name.startswith("fit"):
        workers = 1 if name == "fit-1" else n
        run_name = f"{name}-{time.time_ns()}"
        command = [py, "-m", "raytrain_mnist.fit", "--num-workers", str(workers),
                   "--cpus-per-worker", str(max(1, cores // workers)), "--dataset", "mnist",
                   "--storage-path", str(storage), "--name", run_name, *common]
        spawned = time.time()
        _, wall, peak = run_measured(command, env)
        summary = json.loads((storage / run_name / "summary.json").read_text())
        history = summary["history"]
        return {
            "images_per_s": history[-1]["images_per_s"],
            "startup_s": summary["worker_started_at"] - spawned,
            "time_to_99_s": wall if summary["val_accuracy"] >= 0.99 else None,
            "final_val_accuracy": summary["val_accuracy"],
            "peak_rss_mb": peak,
        }
    if name == "plain":
        command = [py, "-m", "benchmarks.variants", "plain", "--threads", str(cores), *common]
    elif name == "torchrun":
        command = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                   "-m", "benchmarks.variants", "torchrun", "--threads", str(max(1, cores // n)),
                   *common]
    else:
        command = [py, "-m", "benchmarks.variants", "ray_example", "--workers", "1",
                   "--threads", str(cores), "--storage", str(storage), *common]
    result, wall, peak = run_measured(command, env)
    data = _parse_result(result.stdout)
    epochs = data["epochs"]
    hit = next((e["eval_done_s"] for e in epochs if e["val_accuracy"] >= 0.99), None)
    return {"images_per_s": epochs[-1]["images_per_s"], "startup_s": data["first_step_s"],
            "time_to_99_s": hit, "final_val_accuracy": epochs[-1]["val_accuracy"],
            "peak_rss_mb": peak}


VARIANTS = ["plain", "torchrun", "fit-1", "fit-N", "ray-example"]


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _spread(values):
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / statistics.median(values)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True, help="folder with MNIST/raw/*-ubyte")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2, help="N for torchrun and fit-N")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="CPU threads in all")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
           "PYTHONUNBUFFERED": "1"}

    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="raytrain_bench_") as storage:
        for repeat in range(args.repeats):
            for variant in variants:  # interleaved, so drift hits every variant alike
                row = measure_variant(variant, args, env, Path(storage))
                runs[variant].append(row)
                print(f"[{repeat + 1}/{args.repeats}] {variant:<12} "
                      f"{row['images_per_s']:7.0f} img/s  start-up {row['startup_s']:5.1f} s  "
                      f"to 99% {row['time_to_99_s'] or float('nan'):6.1f} s  "
                      f"peak {row['peak_rss_mb']:6.0f} MB", flush=True)

    table = {v: {k: _median([r[k] for r in rows]) for k in rows[0]} | {
        "throughput_spread": _spread([r["images_per_s"] for r in rows])}
        for v, rows in runs.items()}

    def ratio(a, b, key="images_per_s"):
        if a in table and b in table and table[a][key] and table[b][key]:
            return table[a][key] / table[b][key]
        return None

    ratios = {
        "fit1_vs_plain": ratio("fit-1", "plain"),
        "fit2_vs_torchrun": ratio("fit-N", "torchrun"),
        "data_path_vs_ray_example": ratio("fit-1", "ray-example"),
        "fit_time_to_99_s": table.get("fit-N", {}).get("time_to_99_s"),
        "fit1_time_to_99_s": table.get("fit-1", {}).get("time_to_99_s"),
        "fit_vs_plain_time_to_99": ratio("fit-N", "plain", "time_to_99_s"),
    }
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, "
               f"{psutil.virtual_memory().total / 2**30:.0f} GiB, Python "
               f"{platform.python_version()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine, "settings": vars(args), "variants": table,
              "ratios": ratios, "runs": runs}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(render_markdown(result))
    print(render_markdown(result))
    return 0


def render_markdown(result: dict) -> str:
    t = result["variants"]
    s = result["settings"]
    lines = [f"Machine: {result['machine']}. Full MNIST, {s['epochs']} epochs, global batch "
             f"{s['batch_size']}, {s['cores']} CPU threads per variant, median of "
             f"{s['repeats']} run(s).", "",
             "| variant | images/s | vs plain | vs torchrun | start-up s | time to 99 % s "
             "| final acc | peak MB | noise |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def fmt(value, spec):
        return "—" if value is None else format(value, spec)

    for name, row in t.items():
        vs_plain = row["images_per_s"] / t["plain"]["images_per_s"] if "plain" in t else None
        vs_torchrun = (row["images_per_s"] / t["torchrun"]["images_per_s"]
                       if "torchrun" in t else None)
        lines.append(
            f"| {name} | {row['images_per_s']:.0f} | {fmt(vs_plain, '.2f')} | "
            f"{fmt(vs_torchrun, '.2f')} | {row['startup_s']:.1f} | "
            f"{fmt(row['time_to_99_s'], '.1f')} | {100 * row['final_val_accuracy']:.2f} % | "
            f"{row['peak_rss_mb']:.0f} | {fmt(row['throughput_spread'], '.1%')} |")
    r = result["ratios"]
    lines += ["", "| ratio | value | target |", "|---|---:|---|",
              f"| fit1_vs_plain | {fmt(r['fit1_vs_plain'], '.3f')} | ≥ 0.97 |",
              f"| fit2_vs_torchrun | {fmt(r['fit2_vs_torchrun'], '.3f')} | ≥ 0.97 |",
              f"| data_path_vs_ray_example | {fmt(r['data_path_vs_ray_example'], '.2f')} | ≥ 1.5 |",
              f"| fit_time_to_99_s (default command) | {fmt(r['fit_time_to_99_s'], '.1f')} | ≤ 45 |",
              f"| fit_vs_plain_time_to_99 | {fmt(r['fit_vs_plain_time_to_99'], '.2f')} | ≤ 1.5 |",
              "", "Noise: the spread (max − min) / median of throughput across repeats."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
