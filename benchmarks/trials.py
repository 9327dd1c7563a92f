"""What each Tune trial pays outside its training, beside the plain loop.

    python -m benchmarks.trials --data-dir ../shared/data/mnist --trials 4 --repeats 2 \\
        --out benchmarks/results/trials

Runs ``raytrain-mnist tune`` with ``--trials`` trials of ``--epochs`` epoch(s) (FIFO, the
default search space, its own local Ray) interleaved with the plain loop
(``benchmarks.variants plain``, all cores). On a machine whose cores hold one trial's workers,
the trials run one after another, so every second between one trial's last evaluation and the
next one's first optimizer step is what a trial costs besides its training: Tune ends the
trial, its Train controller and workers shut down, the next trial's actor, controller, worker
actors and process group start. Each trial's moments come from its own Train run's latest
checkpoint (the loop's ``first_step_at`` and ``evaluated_at``, unix times); the command's
start and exit from here.

Per repeat: the search's start-up (command start to the first trial's first step), each
trial's training (first step to last evaluation), each gap between trials, the teardown
(last evaluation to exit), the wall, and the plain loop's start-up, training and wall.
Writes ``results.json`` and ``results.md`` into ``--out``.

With ``--service`` it compares instead the same ASHA search (``--trials`` trials of up to
``--epochs`` epochs, one worker each, ``--search-seed``) on one running head, interleaved:
today's ``tune --address`` (a TorchTrainer per trial, one trial at a time) against ``tune
--address --service`` through a one-group service started on that head (docs/service.md,
"Searching through a service"). Per search: the wall, the start-up, each gap between two
trials (one at a time: what a trial pays besides its training), the teardown, the trials
stopped early, the best trial and its accuracy::

    python -m benchmarks.trials --service --data-dir ../shared/data/mnist --trials 8 \
        --epochs 2 --repeats 2 --out benchmarks/results/trials_service

With ``--service --groups K`` it compares the same search through a service of K groups of
one worker x cores/K CPUs (K trials at once) against one group of one worker x all the cores,
in images trained per second of the search's wall (the issue's "several worker groups behind
one queue")::

    python -m benchmarks.trials --service --groups 2 --data-dir ../shared/data/mnist \
        --trials 8 --epochs 2 --out benchmarks/results/trials_groups
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.compare import (
    _median,
    _parse_result,
    loop_row,
    machine,
    run_measured,
    warm_head,
)


def tune_command(args, storage: Path, name: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "raytrain_mnist.tune",
        "--num-samples",
        str(args.trials),
        "--scheduler",
        "fifo",
        "--epochs",
        str(args.epochs),
        "--dataset",
        args.dataset,
        "--data-dir",
        args.data_dir,
        "--storage-path",
        str(storage),
        "--name",
        name,
        "--progress",
        "off",
        "--no-tensorboard",
        "--json",
    ]


def trial_moments(storage: Path, name: str) -> list[dict]:
    """Every trial's train function start, first step and last evaluation (unix times), in
    the order they trained, from the latest checkpoint of each trial's Train run
    (``<search>/runs/<trial>``) and its report."""
    from raytrain_mnist.driver.runs import RUNS_DIR, Run
    from raytrain_mnist.nn import checkpoint

    runs_root = Path(storage) / name / RUNS_DIR
    trials = []
    for run_dir in sorted(p for p in runs_root.iterdir() if p.is_dir()):
        run = Run(str(runs_root), run_dir.name)
        latest = run.latest_checkpoint()
        if latest is None:
            continue
        history = checkpoint.load(latest)["history"]
        trials.append(
            {
                "trial": run_dir.name,
                # When its worker group's train function began (the last report says; one
                # worker group per trial here).
                "started_at": run.latest_metrics()["started_at"],
                "first_step_at": history[0]["first_step_at"],
                "evaluated_at": history[-1]["evaluated_at"],
                "epochs": len(history),
            }
        )
    return sorted(trials, key=lambda t: t["first_step_at"])


def written(out: str, result: dict, table: str) -> int:
    """``results.json`` and ``results.md`` (``table``) into ``out``, the table printed."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(result, indent=2))
    (folder / "results.md").write_text(table)
    print(table)
    return 0


def tune_row(trials: list[dict], start: float, wall: float) -> dict:
    """The search's seconds: start-up, each trial's training, the gaps between trials."""
    pairs = list(itertools.pairwise(trials))
    gaps = [b["first_step_at"] - a["evaluated_at"] for a, b in pairs]
    overlapping = any(g < 0 for g in gaps)
    return {
        "trials": len(trials),
        "startup_s": trials[0]["first_step_at"] - start,
        "training_s": [t["evaluated_at"] - t["first_step_at"] for t in trials],
        "between_trials_s": gaps,
        # Of each gap: Ray's (the trial ends, Tune starts the next, its Train controller,
        # workers and process group) and ours (the data fetch, model and prepare_*).
        "to_train_function_s": [b["started_at"] - a["evaluated_at"] for a, b in pairs],
        "to_first_step_s": [b["first_step_at"] - b["started_at"] for _, b in pairs],
        "overlapping": overlapping,
        "teardown_s": start + wall - trials[-1]["evaluated_at"],
        "wall_s": wall,
    }


def measure(args, env: dict, storage: Path, repeat: int) -> tuple[dict, dict]:
    name = f"search-{repeat}-{time.time_ns()}"
    _, start, wall, _, _ = run_measured(tune_command(args, storage, name), env)
    search = tune_row(trial_moments(storage, name), start, wall)
    plain_command = [
        sys.executable, "-m", "benchmarks.variants", "plain", "--threads", str(args.cores),
        "--data-dir", args.data_dir, "--epochs", str(args.epochs), "--dataset", args.dataset,
    ]  # fmt: skip
    result, _, plain_wall, peak, _ = run_measured(plain_command, env)
    row = loop_row(_parse_result(result.stdout), plain_wall, peak)
    plain = {
        "startup_s": row["startup_s"],
        "training_s": row["steps"].get("training and evaluation"),
        "wall_s": plain_wall,
    }
    return search, plain


def render(result: dict) -> str:
    s = result["settings"]
    searches, plains = result["searches"], result["plain"]
    gaps = [g for r in searches for g in r["between_trials_s"]]
    training = [t for r in searches for t in r["training_s"]]

    def cell(values, spec=".1f"):
        values = [v for v in values if v is not None]
        if not values:
            return "—"
        return f"{_median(values):{spec}} ({min(values):{spec}}-{max(values):{spec}})"

    lines = [
        f"Machine: {result['machine']}. {s['dataset']}, {s['trials']} trials of "
        f"{s['epochs']} epoch(s) per search (FIFO, one trial at a time), {s['repeats']} "
        "search(es) interleaved with the plain loop; median (min-max) over every trial "
        "or run.",
        "",
        "| seconds | search | plain loop |",
        "|---|---:|---:|",
        f"| start-up (command start to the first step) | "
        f"{cell([r['startup_s'] for r in searches])} | "
        f"{cell([p['startup_s'] for p in plains])} |",
        f"| a trial's training (first step to last evaluation) | {cell(training)} | "
        f"{cell([p['training_s'] for p in plains])} |",
        f"| **between two trials** (last evaluation to the next first step) | "
        f"**{cell(gaps)}** | — |",
        "| of which Ray's: the trial ends; the next one's actor, controller, workers, process "
        f"group | {cell([g for r in searches for g in r.get('to_train_function_s', [])])} | — |",
        "| of which ours: data fetch, model, prepare_* | "
        f"{cell([g for r in searches for g in r.get('to_first_step_s', [])])} | — |",
        f"| teardown (last evaluation to exit) | {cell([r['teardown_s'] for r in searches])} | — |",
        f"| wall | {cell([r['wall_s'] for r in searches])} | "
        f"{cell([p['wall_s'] for p in plains])} |",
    ]
    if any(r["overlapping"] for r in searches):
        lines += ["", "Some trials overlapped: the gaps are not a trial's cost."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True, help="folder with MNIST/raw/*-ubyte")
    parser.add_argument("--out", default="benchmarks/results/trials")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    parser.add_argument("--dataset", default="mnist", choices=["mnist", "sample"])
    parser.add_argument("--service", action="store_true", help="compare tune --service")
    parser.add_argument("--search-seed", type=int, default=0)
    parser.add_argument(
        "--groups",
        type=int,
        default=1,
        help="with --service: compare a service of this many groups against one group",
    )
    args = parser.parse_args(argv)
    if args.groups < 1 or args.cores % args.groups:
        parser.error("--groups must be at least 1 and divide --cores")
    if args.groups > 1 and not args.service:
        parser.error("--groups compares services: add --service")
    if args.trials < 2:
        parser.error("--trials must be at least 2: the gaps between trials are the point")
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    env["PYTHONUNBUFFERED"] = "1"
    if args.service and args.groups > 1:
        return compare_groups(args, env)
    if args.service:
        return compare_service(args, env)
    searches, plains = [], []
    with tempfile.TemporaryDirectory(prefix="raytrain_trials_") as storage:
        for repeat in range(args.repeats):
            load = os.getloadavg()[0]
            search, plain = measure(args, env, Path(storage), repeat)
            search["load_1min"] = plain["load_1min"] = (load + os.getloadavg()[0]) / 2
            searches.append(search)
            plains.append(plain)
            print(f"[{repeat + 1}/{args.repeats}] {json.dumps(search)}", flush=True)
            print(f"[{repeat + 1}/{args.repeats}] plain {json.dumps(plain)}", flush=True)
    result = {
        "machine": machine(),
        "settings": {**vars(args), "repeats": len(searches)},
        "searches": searches,
        "plain": plains,
    }
    return written(args.out, result, render(result))


# --------------------------------------------------------------------------- --service

#: The benchmark's service, on its head.
SERVICE = "bench-trials"


def search_command(
    args, address: str, storage: Path, name: str, service: bool, groups: int = 1
) -> list[str]:
    """The ASHA search of both sides: the same trials, one worker each, one at a time (or
    through a service of ``groups`` groups, as many at once)."""
    flags = shlex.split(
        f"--num-samples {args.trials} --max-epochs {args.epochs} --scheduler asha "
        f"--search-seed {args.search_seed} --num-workers 1 "
        f"--cpus-per-worker {args.cores // groups} "
        f"--dataset {args.dataset} --progress off --no-tensorboard --json"
    )
    where = ["--address", address, "--data-dir", args.data_dir, "--storage-path", str(storage)]
    at_once = ["--max-concurrent-trials", str(groups)]
    side = ["--service", SERVICE, *at_once] if service else at_once
    return [sys.executable, "-m", "raytrain_mnist.tune", *flags, *where, "--name", name, *side]


@contextlib.contextmanager
def service_on(args, env: dict, address: str, storage: Path, groups: int = 1):
    """A service of ``groups`` groups of one worker x ``args.cores // groups`` CPUs on the
    head at ``address``, as a user starts one, ready; stopped with ``service stop``
    afterwards."""
    base = [sys.executable, "-m", "raytrain_mnist", "service"]
    where = ["--name", SERVICE, "--address", address]
    size = shlex.split(
        f"--num-workers 1 --cpus-per-worker {args.cores // groups} --groups {groups} "
        f"--dataset {args.dataset}"
    )
    data = ["--data-dir", args.data_dir, "--storage-path", str(storage)]
    driver = subprocess.Popen(
        [*base, "start", *where, *size, *data],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        for line in driver.stdout:
            if f"service '{SERVICE}' ready" in line:
                break
        else:
            raise RuntimeError("the benchmark's service ended before it was ready")
        yield
        subprocess.run([*base, "stop", *where], env=env, capture_output=True, timeout=300)
        driver.wait(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)


def measure_search(
    args, env: dict, address: str, storage: Path, name: str, service: bool, groups: int = 1
):
    """One search, timed from its command's start to its exit; its trials as they ended."""
    command = search_command(args, address, storage, name, service, groups)
    _, start, wall, _, _ = run_measured(command, env)
    best = json.loads((storage / name / "best.json").read_text())
    search = json.loads((storage / name / "search.json").read_text())
    epochs = sum(t["epochs_run"] for t in best["trials"])
    row = tune_row(trial_moments(storage, name), start, wall) if groups == 1 else {}
    row.update(
        wall_s=wall, epochs=epochs, images_per_s=epochs * search["data"]["train_size"] / wall
    )
    if service and groups == 1:  # its worker group started long before: no such parts
        del row["to_train_function_s"], row["to_first_step_s"]
    row.update(
        stopped_early=sorted(t["trial_id"] for t in best["trials"] if t["stopped_early"]),
        best_trial=best["best_trial"],
        best_val_accuracy=best["best_val_accuracy"],
    )
    return row


def compare_service(args, env: dict) -> int:
    """``--service``: the same ASHA search on one head, today's and through a service."""
    sides: dict[str, list[dict]] = {"tune": [], "tune --service": []}
    # The head holds the service's worker and a plain trial's at once (the service's idles
    # while the plain search trains), plus the trial actors' slivers.
    head_args = argparse.Namespace(cores=2 * args.cores + 1)
    with tempfile.TemporaryDirectory(prefix="raytrain_trials_svc_") as storage:
        storage = Path(storage)
        bench_env = {**env, "RAYTRAIN_MNIST_CACHE": str(storage / "cache")}
        with (
            warm_head(head_args, bench_env) as address,
            service_on(args, bench_env, address, storage),
        ):
            for repeat in range(args.repeats):
                # Same names, other storage: the trials' names come from the settings.
                for side in sides if repeat % 2 == 0 else reversed(sides):
                    root = storage / side.replace(" ", "").replace("-", "") / str(repeat)
                    row = measure_search(args, bench_env, address, root, "asha", side != "tune")
                    sides[side].append(row)
                    print(f"[{repeat + 1}/{args.repeats}] {side} {json.dumps(row)}")
    result = {"machine": machine(), "settings": vars(args), "sides": sides}
    return written(args.out, result, render_service(result))


def compare_groups(args, env: dict) -> int:
    """``--service --groups K``: the same ASHA search through a service of K groups of one
    worker x cores/K CPUs (K trials at once) and through one group of one worker x all the
    cores (one at a time), on one head, interleaved: images trained per second of the
    search's wall."""
    sides: dict[str, list[dict]] = {"1 group": [], f"{args.groups} groups": []}
    head_args = argparse.Namespace(cores=args.cores + 1)  # the services one at a time
    with tempfile.TemporaryDirectory(prefix="raytrain_trials_groups_") as storage:
        storage = Path(storage)
        bench_env = {**env, "RAYTRAIN_MNIST_CACHE": str(storage / "cache")}
        with warm_head(head_args, bench_env) as address:
            for repeat in range(args.repeats):
                for side in sides if repeat % 2 == 0 else reversed(sides):
                    groups = 1 if side == "1 group" else args.groups
                    root = storage / f"g{groups}" / str(repeat)
                    with service_on(args, bench_env, address, root, groups):
                        row = measure_search(args, bench_env, address, root, "asha", True, groups)
                    sides[side].append(row)
                    print(f"[{repeat + 1}/{args.repeats}] {side} {json.dumps(row)}", flush=True)
    result = {"machine": machine(), "settings": vars(args), "sides": sides}
    return written(args.out, result, render_groups(result))


def render_groups(result: dict) -> str:
    s, sides = result["settings"], result["sides"]
    (one, one_rows), (many, many_rows) = sides.items()

    def med(rows, key):
        return _median([r[key] for r in rows])

    ratio = med(many_rows, "images_per_s") / med(one_rows, "images_per_s")
    return "\n".join(
        [
            f"Machine: {result['machine']}. {s['dataset']}, an ASHA search of {s['trials']} "
            f"trials of up to {s['epochs']} epoch(s), search seed {s['search_seed']}, through "
            f"a service on one running head: {one} of one worker x {s['cores']} CPU(s) (one "
            f"trial at a time) against {many} of one worker x {s['cores'] // s['groups']} "
            f"CPU(s) each ({s['groups']} trials at once); {len(one_rows)} search(es) a side, "
            "interleaved; medians.",
            "",
            f"| | {one} | {many} |",
            "|---|---:|---:|",
            f"| wall (s) | {med(one_rows, 'wall_s'):.1f} | {med(many_rows, 'wall_s'):.1f} |",
            f"| epochs trained | {med(one_rows, 'epochs'):.0f} | {med(many_rows, 'epochs'):.0f} |",
            f"| **images/s** | {med(one_rows, 'images_per_s'):.0f} | "
            f"{med(many_rows, 'images_per_s'):.0f} |",
            "",
            f"Images/s ratio ({many} / {one}): {ratio:.2f}.",
            "",
        ]
    )


def render_service(result: dict) -> str:
    s, sides = result["settings"], result["sides"]
    plain, served = sides["tune"], sides["tune --service"]

    def med(rows, key):
        values = [v for r in rows for v in (r[key] if isinstance(r[key], list) else [r[key]])]
        return _median(values) if values else None

    def cell(rows, key):
        value = med(rows, key)
        return "—" if value is None else f"{value:.1f}"

    ratio = med(served, "wall_s") / med(plain, "wall_s")
    same = all(
        (a["stopped_early"], a["best_trial"], a["best_val_accuracy"])
        == (b["stopped_early"], b["best_trial"], b["best_val_accuracy"])
        for a, b in zip(plain, served, strict=True)
    )
    rows = [
        ("wall", "wall_s"),
        ("start-up (command start to the first step)", "startup_s"),
        ("**between two trials** (a trial's cost besides its training)", "between_trials_s"),
        ("a trial's training", "training_s"),
        ("teardown (last evaluation to exit)", "teardown_s"),
    ]
    lines = [
        f"Machine: {result['machine']}. {s['dataset']}, an ASHA search of {s['trials']} "
        f"trials of up to {s['epochs']} epoch(s), one worker x {s['cores']} CPU each, "
        f"search seed {s['search_seed']}, on one running head; {len(plain)} search(es) a "
        "side, interleaved; seconds, median over searches (between trials: over every gap).",
        "",
        "| seconds | tune | tune --service |",
        "|---|---:|---:|",
        *(f"| {label} | {cell(plain, key)} | {cell(served, key)} |" for label, key in rows),
        "",
        f"Wall ratio (service / today's): {ratio:.2f}. The same trials stopped early and the "
        f"same best trial and accuracy on both sides: {'yes' if same else 'NO'}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
