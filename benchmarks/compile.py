"""``--compile`` against eager, for the plain loop and for ``fit``, in one run.

    python -m benchmarks.compile --data-dir ../shared/data/mnist --out benchmarks/results

Variants (fit's default recipe, one epoch of full MNIST, all cores as torch threads):

    plain              benchmarks.variants plain: the product's loop, no Ray
    plain-compile      the same with --compile, Inductor's on-disk cache empty (a first run)
    plain-compile-warm the same again on the cache the run before it filled
    fit-1              raytrain_mnist.fit --num-workers 1
    fit-1-compile      fit --compile, an empty cache; fit-1-compile-warm on the filled one
    fit-2, fit-2-compile   --num-workers 2 (the default command), 1 thread each

Compile time included: start-up (command start to the first optimizer step done: the first
step compiles), the epoch's training seconds, time to 99 % and wall. Excluded: the
steady-state step, the epoch's steps after its first ((train s - first step s) / (steps - 1)).
Repeats are interleaved and ratios paired (compare.py's helpers). ``eval`` adds one
in-process figure: scoring the 10,000 test digits eagerly against compiled (first call
included), which is why fit evaluates eagerly under ``--compile``. Writes ``compile.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.compare import (
    _median,
    _parse_result,
    fit_command,
    fit_history,
    paired_ratio,
    run_measured,
)

VARIANTS = [
    "plain",
    "plain-compile",
    "plain-compile-warm",
    "fit-1",
    "fit-1-compile",
    "fit-1-compile-warm",
    "fit-2",
    "fit-2-compile",
]
#: (name, compiled variant, eager variant, metric): paired, median over repeats.
RATIOS = [
    (f"{c}_vs_{e}_{m}", c, e, m)
    for c, e in [
        ("plain-compile", "plain"),
        ("plain-compile-warm", "plain"),
        ("fit-1-compile", "fit-1"),
        ("fit-1-compile-warm", "fit-1"),
        ("fit-2-compile", "fit-2"),
    ]
    for m in ("steady_step_s", "train_s", "startup_s", "wall_s")
]


def _row(
    first_step_in_epoch_s: float,
    train_s: float,
    steps: int,
    startup_s: float,
    time_to_99_s: float | None,
    wall_s: float,
    val_accuracy: float,
    peak_mb: float,
    batch_size: int,
) -> dict:
    steady = (train_s - first_step_in_epoch_s) / max(steps - 1, 1)
    return {
        "startup_s": startup_s,
        "first_step_s": first_step_in_epoch_s,
        "steady_step_s": steady,
        "steady_images_per_s": batch_size / steady,
        "train_s": train_s,
        "steps": steps,
        "time_to_99_s": time_to_99_s,
        "wall_s": wall_s,
        "val_accuracy": val_accuracy,
        "peak_rss_mb": peak_mb,
    }


def measure(name: str, args, env: dict, storage: Path, cache: Path) -> dict:
    """One run of variant ``name``; the compiled ones use Inductor's cache in ``cache``."""
    compiled = "compile" in name
    env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)} if compiled else env
    if name.startswith("plain"):
        command = [
            sys.executable,
            "-m",
            "benchmarks.variants",
            "plain",
            "--threads",
            str(args.cores),
            "--data-dir",
            args.data_dir,
            "--epochs",
            "1",
            "--batch-size",
            str(args.batch_size),
            "--dataset",
            args.dataset,
            *(["--compile"] if compiled else []),
        ]
        result, _, wall, peak, _ = run_measured(command, env)
        data = _parse_result(result.stdout)
        epoch = data["epochs"][0]
        return _row(
            epoch["first_step_in_epoch_s"],
            epoch["train_s"],
            epoch["steps"],
            data["first_step_s"],
            epoch["eval_done_s"] if epoch["val_accuracy"] >= 0.99 else None,
            wall,
            epoch["val_accuracy"],
            peak,
            args.batch_size,
        )
    workers = int(name.split("-")[1])
    run_name = f"{name}-{time.time_ns()}"
    extra = ["--cpus-per-worker", str(max(1, args.cores // workers))]
    command = fit_command(args, workers, storage, run_name, extra + (["--compile"] * compiled))
    _, start, wall, peak, _ = run_measured(command, env)
    summary = json.loads((storage / run_name / "summary.json").read_text())
    if [w.get("compiled") for w in summary["workers"]] != [compiled] * workers:
        raise RuntimeError(f"{name}: the workers say compiled {summary['workers']}")
    h = fit_history(summary)[0]
    epoch_start = h["evaluated_at"] - h["epoch_time_s"]
    steps = round(h["images_per_s"] * h["train_s"] / args.batch_size)
    return _row(
        h["first_step_at"] - epoch_start,
        h["train_s"],
        steps,
        h["first_step_at"] - start,
        h["evaluated_at"] - start if h["val_accuracy"] >= 0.99 else None,
        wall,
        h["val_accuracy"],
        peak,
        args.batch_size,
    )


def eval_cost(data_dir: str, dataset: str, threads: int) -> dict:
    """Seconds to score the test set with the ConvNet eager (after one warm-up batch) and
    compiled (the first call, which compiles the eval-mode graph, included), in a fresh
    Inductor cache."""
    import torch

    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.nn.model import ConvNet
    from raytrain_mnist.nn.score import evaluate
    from raytrain_mnist.worker.setup import to_device

    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    data = to_device(load_mnist(data_dir, dataset), cpu)
    model = ConvNet()
    evaluate(model, data.test_images[:1000], data.test_labels[:1000], cpu)  # warm-up
    started = time.perf_counter()
    evaluate(model, data.test_images, data.test_labels, cpu)
    eager = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read when Inductor first compiles
        model.compile()
        started = time.perf_counter()
        evaluate(model, data.test_images, data.test_labels, cpu)
        first = time.perf_counter() - started
        started = time.perf_counter()
        evaluate(model, data.test_images, data.test_labels, cpu)
        again = time.perf_counter() - started
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]
    return {"eager_s": eager, "compiled_first_s": first, "compiled_again_s": again}


def step_cost(data_dir: str, dataset: str, threads: int, blocks: int, steps: int) -> dict:
    """The steady-state step, eager against compiled, in one process: fit's train step
    (default recipe, batch 128) on full-MNIST batches, the two models alternating in
    ``blocks`` blocks of ``steps`` steps after one warm-up block each (the compiled one's
    first step compiles, in a fresh Inductor cache), so a change in the machine's load hits
    both alike. Returns the medians of the per-block means and the compile step's seconds."""
    import math
    import statistics

    import torch

    from raytrain_mnist.config import TrainConfig
    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.worker.setup import keep_freed_memory, to_device
    from raytrain_mnist.worker.training import as_is, prepare_training

    keep_freed_memory()
    torch.set_num_threads(threads)
    data = to_device(load_mnist(data_dir, dataset), torch.device("cpu"))
    # fit's default recipe, its schedule long enough for every step taken here (and more).
    per_epoch = len(data.train_labels) // TrainConfig().batch_size
    cfg = TrainConfig(epochs=math.ceil(10 * (blocks + 1) * steps / per_epoch))
    trainings = {
        name: prepare_training(
            cfg,
            data,
            torch.device("cpu"),
            compile=name == "compiled",
            prepare_model=as_is,
            prepare_data_loader=as_is,
        )
        for name in ("eager", "compiled")
    }
    loader = trainings["eager"].loader  # one stream of batches for both
    batches = iter(loader)

    def next_batch():
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:
            batches = iter(loader)
            return next(batches)

    def run(name: str, n: int) -> float:
        step = trainings[name].steps.step  # fit's train step, on this training's parts
        step.model.train()
        started = time.perf_counter()
        for _ in range(n):
            step(*next_batch())
        return (time.perf_counter() - started) / n

    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        compile_step_s = run("compiled", 1)
        run("eager", steps)
        run("compiled", steps)
        times = {"eager": [], "compiled": []}
        for _ in range(blocks):
            for name in times:
                times[name].append(run(name, steps))
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]
    eager, compiled = (statistics.median(times[n]) for n in ("eager", "compiled"))
    return {
        "blocks": blocks,
        "steps_per_block": steps,
        "eager_step_s": eager,
        "compiled_step_s": compiled,
        "compiled_vs_eager": compiled / eager,
        "compile_first_step_s": compile_step_s,
        "block_means_s": times,
    }


def _compiler() -> str:
    name = os.environ.get("CXX") or "g++"
    try:
        out = subprocess.run([name, "--version"], capture_output=True, text=True, check=True)
        return out.stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return f"{name}: not found"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True, help="folder with MNIST/raw/*-ubyte")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="CPU threads in all")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dataset", default="mnist", choices=["mnist", "sample"])
    parser.add_argument("--eval", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--step-blocks",
        type=int,
        default=6,
        help="in-process steady-state step, eager and compiled alternating (0: skip)",
    )
    parser.add_argument("--steps-per-block", type=int, default=25)
    parser.set_defaults(epochs=1)  # one epoch: fit's default recipe (fit_command reads it)
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    env = {
        **os.environ,
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
        "PYTHONUNBUFFERED": "1",
    }
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    load_before = os.getloadavg()
    scoring = eval_cost(args.data_dir, args.dataset, args.cores) if args.eval else None
    steps = (
        step_cost(args.data_dir, args.dataset, args.cores, args.step_blocks, args.steps_per_block)
        if args.step_blocks
        else None
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="raytrain_compile_") as scratch:
        storage = Path(scratch) / "runs"
        for repeat in range(args.repeats):
            # One cache per repeat and kind: the cold run fills it, the warm run reuses it.
            caches = {k: Path(scratch) / f"inductor-{k}-{repeat}" for k in ("plain", "fit")}
            for variant in variants:
                cache = caches["plain" if variant.startswith("plain") else "fit"]
                row = measure(variant, args, env, storage, cache)
                runs[variant].append(row)
                print(
                    f"[{repeat + 1}/{args.repeats}] {variant:<19} start-up "
                    f"{row['startup_s']:5.1f} s  first step {row['first_step_s']:5.2f} s  "
                    f"steady {1000 * row['steady_step_s']:6.1f} ms/step  train "
                    f"{row['train_s']:5.1f} s  wall {row['wall_s']:5.1f} s  acc "
                    f"{100 * row['val_accuracy']:.2f} %",
                    flush=True,
                )
                # After every run: one cut short keeps what it measured.
                result = summarize(runs, args, load_before, scoring, steps)
                (out / "compile.json").write_text(json.dumps(result, indent=2))
    result = summarize(runs, args, load_before, scoring, steps)
    (out / "compile.json").write_text(json.dumps(result, indent=2))
    print(render(result))
    return 0


def summarize(runs: dict, args, load_before, scoring: dict | None, steps: dict | None) -> dict:
    """compile.json: the medians, the paired ratios, the runs, and where they ran."""
    import torch

    done = {v: rows for v, rows in runs.items() if rows}
    table = {v: {k: _median([r[k] for r in rows]) for k in rows[0]} for v, rows in done.items()}
    ratios = {name: paired_ratio(done, a, b, key) for name, a, b, key in RATIOS}
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}, {_compiler()}",
        "settings": vars(args),
        # The machine is shared: its load (1, 5, 15 min) when the run began and now.
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "runs_done": {v: len(rows) for v, rows in runs.items()},
        "variants": table,
        "ratios": {k: v for k, v in ratios.items() if v is not None},
        "eval": scoring,
        "steps": steps,
        "runs": runs,
    }


def render(result: dict) -> str:
    """The variants table and the eval figure, as benchmarks/README.md shows them."""
    lines = [
        "| variant | start-up s | first step s | steady ms/step | train s | "
        "time to 99 % s | wall s | acc |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in result["variants"].items():
        to99 = "—" if r["time_to_99_s"] is None else f"{r['time_to_99_s']:.1f}"
        lines.append(
            f"| {name} | {r['startup_s']:.1f} | {r['first_step_s']:.2f} | "
            f"{1000 * r['steady_step_s']:.1f} | {r['train_s']:.1f} | {to99} | "
            f"{r['wall_s']:.1f} | {100 * r['val_accuracy']:.2f} % |"
        )
    lines += ["", "| paired ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in result["ratios"].items()]
    e = result.get("eval")
    if e:
        lines += [
            "",
            f"Scoring the test set: eager {e['eager_s']:.2f} s, compiled {e['compiled_first_s']:.2f}"
            f" s the first time (compiling), {e['compiled_again_s']:.2f} s after.",
        ]
    t = result.get("steps")
    if t:
        lines += [
            "",
            f"Steady-state step in one process, alternating ({t['blocks']} x "
            f"{t['steps_per_block']} steps each): eager {1000 * t['eager_step_s']:.1f} ms, "
            f"compiled {1000 * t['compiled_step_s']:.1f} ms ({t['compiled_vs_eager']:.3f}x); "
            f"the compiling step {t['compile_first_step_s']:.1f} s.",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
