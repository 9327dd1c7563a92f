"""What the live progress bar costs in training throughput: ``fit --progress bar`` against
``fit --progress off``, interleaved, paired.

    python -m benchmarks.progress_cost --dataset sample --epochs 2 --repeats 2

With ``bar`` rank 0 streams a few updates a second to the driver, which redraws a rich bar
(forced even into the pipe this script reads, so the drawing is paid for); with ``off``
there is no stream at all. Each repeat runs both (in alternating order, so drift hits both
alike); the figure is the median over repeats of bar/off, each side's throughput being the
median of its epochs' images/s (``summary.json``). Writes ``progress.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_fit(mode: str, name: str, storage: str, args: argparse.Namespace) -> dict:
    command = [
        sys.executable,
        "-m",
        "raytrain_mnist",
        "fit",
        "--progress",
        mode,
        "--dataset",
        args.dataset,
        "--epochs",
        str(args.epochs),
        "--num-workers",
        str(args.num_workers),
        "--storage-path",
        storage,
        "--name",
        name,
        "--no-tensorboard",
    ]
    if args.data_dir:
        command += ["--data-dir", args.data_dir]
    started = time.perf_counter()
    # Bytes: text mode would turn the bar's carriage returns into newlines.
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"}
    )
    stdout = done.stdout.decode(errors="replace")
    if done.returncode != 0:
        sys.exit(
            f"{mode} run failed:\n{stdout[-2000:]}\n{done.stderr.decode(errors='replace')[-2000:]}"
        )
    summary = json.loads((Path(storage) / name / "summary.json").read_text())
    rates = [h["images_per_s"] for h in summary["history"]]
    return {
        "mode": mode,
        "images_per_s": statistics.median(rates),
        "epochs": rates,
        "wall_s": round(time.perf_counter() - started, 1),
        "carriage_returns": stdout.count("\r"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="sample", choices=("auto", "mnist", "sample"))
    parser.add_argument("--data-dir")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)

    runs, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="progress-cost-") as storage:
        for repeat in range(args.repeats):
            order = ("bar", "off") if repeat % 2 == 0 else ("off", "bar")
            pair = {}
            for mode in order:
                result = run_fit(mode, f"{mode}-{repeat}", storage, args)
                print(
                    f"repeat {repeat + 1}/{args.repeats} {mode:>3}: "
                    f"{result['images_per_s']:7.0f} img/s ({result['wall_s']} s wall)",
                    flush=True,
                )
                pair[mode] = result
                runs.append({"repeat": repeat, **result})
            ratios.append(pair["bar"]["images_per_s"] / pair["off"]["images_per_s"])
    report = {
        "what": "fit --progress bar vs off: training images/s, bar/off (paired, median)",
        "ratio_bar_over_off": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "progress.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"bar/off throughput: {report['ratio_bar_over_off']:.3f} "
        f"(per repeat: {', '.join(f'{r:.3f}' for r in ratios)}); "
        f"written to {out / 'progress.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
