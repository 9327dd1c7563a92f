"""Training recipes, one epoch at a time: test accuracy per named recipe and seed.

    python -m benchmarks.recipes --data-dir ../shared/data/mnist \\
        --recipes default,seed-2ep:2,tutorial:3 --seeds 0-4 --out benchmarks/results/recipes.json

A recipe is a set of :class:`~raytrain_mnist.config.TrainConfig` values (optimizer, learning
rate and schedule, batch size, label smoothing, ...). Each run is the plain loop of
``benchmarks/variants.py``: one process, no Ray, the package's own loader, optimizer and
schedule (``nn.optim.build_optimizer``), train step and evaluation, so a recipe's figure
is what ``fit`` gets with the same flags (the global batch is the batch of one process, so 1
and 2 workers run the same recipe). The data is loaded once for every run.

Per run: the test accuracy after each epoch, the training seconds (evaluations excluded),
and, with ``--eval-at``, the accuracy at those shares of every epoch as well (the model in
eval mode; training is not changed by it), so that *seconds to 99 %* is the training time up
to the first evaluation at >= 99.0 % and *epochs to 99 %* its place in epochs. Accuracy is deterministic for a recipe, seed and thread
count; seconds depend on the machine and its load.

``--set NAME=VALUE`` changes a recipe for one invocation (its name then carries the change):
how a search screens a variant before it becomes a named recipe. The JSON accumulates: a run
replaces the earlier one of the same recipe, settings, seed and epochs, and the summary (mean,
min, max over seeds per recipe) is recomputed over everything the file holds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

from raytrain_mnist.config import RECIPES as PRODUCT_RECIPES

#: fit's recipes (``--recipe``) without their epochs, which a run here sets with --epochs:
#: ``seed-2ep`` is ``classic`` (the defaults before the one-epoch recipe: SGD with Nesterov
#: momentum, one-cycle to 0.1 over 25 % of the steps, global batch 128), ``fast-1ep`` is
#: ``one-epoch``, the defaults.
SEED_2EP = {k: v for k, v in PRODUCT_RECIPES["classic"].items() if k != "epochs"}
FAST_1EP = {k: v for k, v in PRODUCT_RECIPES["one-epoch"].items() if k != "epochs"}

#: AdamW as tuomaso/train_mnist_fast runs it (betas 0.7 / 0.9, one-cycle without cycling
#: beta1, peak 0.01), on this ConvNet and batch.
ADAMW_TUOMASO = {**SEED_2EP, "optimizer": "adamw", "lr": 0.01, "momentum": 0.7, "beta2": 0.9}

#: Named recipes, spelled in full (not as changes to TrainConfig's defaults, which follow the
#: winner), so that each name keeps its meaning. ``default`` is TrainConfig's own.
RECIPES: dict[str, dict] = {
    "seed-2ep": SEED_2EP,
    # The seed tutorial's own (yangkky/distributed_tutorial's mnist-distributed.py): plain SGD
    # at a constant 1e-4, no momentum or weight decay, batch 100 (per GPU there; global here).
    "tutorial": {
        **SEED_2EP,
        "batch_size": 100,
        "lr": 1e-4,
        "momentum": 0.0,
        "weight_decay": 0.0,
        "schedule": "constant",
    },
    "sgd-b64-ls": {**SEED_2EP, "batch_size": 64, "lr": 0.15, "label_smoothing": 0.1},
    "adamw-tuomaso": ADAMW_TUOMASO,
    "adamw-ls": {**ADAMW_TUOMASO, "lr": 0.02, "label_smoothing": 0.1},
    "adamw-ls-wd": {**ADAMW_TUOMASO, "lr": 0.02, "label_smoothing": 0.1, "weight_decay": 0.05},
    "fast-1ep": FAST_1EP,
}


def recipe(name: str) -> dict:
    """The TrainConfig values of recipe ``name`` (``default``: TrainConfig's own)."""
    from raytrain_mnist.config import TrainConfig

    if name == "default":
        values = TrainConfig().to_dict()
        return {k: values[k] for k in FAST_1EP}  # the recipe's fields, not amp or seed
    if name not in RECIPES:
        raise SystemExit(f"no recipe {name!r}; known: default, {', '.join(RECIPES)}")
    return dict(RECIPES[name])


def parse_set(items: list[str]) -> dict:
    """``--set lr=0.2`` items as TrainConfig values, typed by the field."""
    import typing

    from raytrain_mnist.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    values = {}
    for item in items:
        name, _, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if name not in hints or not text:
            raise SystemExit(f"--set {item!r}: write FIELD=VALUE with a TrainConfig field")
        values[name] = hints[name](text)
    return values


def parse_seeds(text: str) -> list[int]:
    """``0-4`` or ``0,3,7``."""
    seeds: list[int] = []
    for part in text.split(","):
        low, sep, high = part.partition("-")
        seeds += list(range(int(low), int(high) + 1)) if sep else [int(low)]
    return seeds


def run_one(
    data, settings: dict, seed: int, epochs: int, eval_at: list[float], verbose: bool = False
) -> dict:
    """Train ``settings`` for ``epochs`` from ``seed`` on the plain loop; return the run's
    record (accuracy per epoch and at the ``eval_at`` shares of epoch 1, training seconds)."""
    import torch

    from raytrain_mnist.config import TrainConfig
    from raytrain_mnist.nn.score import evaluate
    from raytrain_mnist.worker.batches import set_epoch
    from raytrain_mnist.worker.training import as_is, prepare_training

    cfg = TrainConfig(**settings, epochs=epochs, seed=seed)
    device = torch.device("cpu")
    # The very training a fit worker prepares, in one process without Ray.
    training = prepare_training(cfg, data, device, prepare_model=as_is, prepare_data_loader=as_is)
    model, loader = training.module, training.loader
    steps = len(loader)
    marks = {max(1, round(share * steps)): share for share in eval_at if 0 < share < 1}
    evals: list[dict] = []
    eval_s = [0.0]
    clock = {"started": 0.0}

    def score(epoch: int, step: int, share: float) -> None:
        started = time.perf_counter()
        val = evaluate(model, data.test_images, data.test_labels, device)
        now = time.perf_counter()
        evals.append(
            {
                "epoch": epoch,
                "step": step,
                "share": share,
                "val_accuracy": val["val_accuracy"],
                "val_loss": val["val_loss"],
                "train_s": clock["trained"] + (started - clock["started"]) - eval_s[0],
            }
        )
        eval_s[0] += now - started
        if verbose:
            print(f"  epoch {epoch} step {step}: {100 * val['val_accuracy']:.2f} %", flush=True)

    def on_step(step: int, _sums) -> None:
        if step in marks:
            score(clock["epoch"], step, marks[step])
            model.train()

    clock["trained"] = 0.0
    for epoch in range(cfg.epochs):
        set_epoch(loader, epoch, cfg.seed)
        clock.update(epoch=epoch + 1, started=time.perf_counter())
        eval_s[0] = 0.0
        train = training.train_one_epoch(on_step=on_step)
        score(epoch + 1, steps, 1.0)
        clock["trained"] = evals[-1]["train_s"]
        evals[-1]["train_loss"] = train["train_loss"]
    reached = next((e for e in evals if e["val_accuracy"] >= 0.99), None)
    return {
        "seed": seed,
        "epochs": epochs,
        "val_accuracy": evals[-1]["val_accuracy"],
        "epoch_accuracy": [e["val_accuracy"] for e in evals if e["share"] == 1.0],
        "train_s": evals[-1]["train_s"],
        "s_to_99": None if reached is None else reached["train_s"],
        "epochs_to_99": None if reached is None else reached["epoch"] - 1 + reached["share"],
        "steps_per_epoch": steps,
        "evals": evals,
    }


def summarize(runs: list[dict]) -> dict:
    """Per recipe and epochs: mean, min, max test accuracy over its seeds, and seconds."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(f"{run['recipe']} / {run['epochs']} ep", []).append(run)
    summary = {}
    for key, group in groups.items():
        group.sort(key=lambda r: r["seed"])
        accuracy = [r["val_accuracy"] for r in group]
        reached = [r["s_to_99"] for r in group if r["s_to_99"] is not None]
        summary[key] = {
            "recipe": group[0]["recipe"],
            "epochs": group[0]["epochs"],
            "settings": group[0]["settings"],
            "seeds": [r["seed"] for r in group],
            "mean": statistics.fmean(accuracy),
            "min": min(accuracy),
            "max": max(accuracy),
            "train_s_median": statistics.median(r["train_s"] for r in group),
            "reached_99": f"{len(reached)}/{len(group)}",
            "s_to_99_median": statistics.median(reached) if reached else None,
            "s_to_99": _spread(reached),
            "epochs_to_99": _spread([r["epochs_to_99"] for r in group if r["s_to_99"]]),
        }
    return summary


def _spread(values: list[float]) -> dict | None:
    """Mean, min and max, or None for no values."""
    if not values:
        return None
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def time_to_99_table(summary: dict, rows: list[tuple[str, str]]) -> str:
    """The markdown table of ``rows`` (summary key, label): epochs to 99.0 %, mean (min-max)
    over the seeds that reached it, the median training seconds to it (the median: a loaded
    machine slows some runs many times over), and the final accuracy."""
    lines = [
        "| recipe | seeds | reached 99 % | epochs to 99 % | training s to 99 %, median "
        "| final accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for key, label in rows:
        row = summary.get(key)
        if row is None:
            continue

        def cell(spread, digits):
            if spread is None:
                return "–"
            lo, hi = f"{spread['min']:.{digits}f}", f"{spread['max']:.{digits}f}"
            return f"{spread['mean']:.{digits}f} ({lo}–{hi})"

        final = {k: 100 * row[k] for k in ("mean", "min", "max")}
        seconds = row["s_to_99_median"]
        lines.append(
            f"| {label} | {len(row['seeds'])} | {row['reached_99']} | "
            f"{cell(row['epochs_to_99'], 2)} | {'–' if seconds is None else f'{seconds:.1f}'} | "
            f"{cell(final, 2)} % after {row['epochs']} |"
        )
    return "\n".join(lines)


def _same(a: dict, b: dict) -> bool:
    keys = ("recipe", "settings", "seed", "epochs")
    return all(a[k] == b[k] for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument(
        "--recipes",
        default="default",
        help="comma-separated recipe names, each with its own epochs as NAME:EPOCHS if needed",
    )
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,3,7")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--eval-at",
        default="0.5,0.75,0.9",
        help="shares of each epoch at which to evaluate too ('' for none)",
    )
    parser.add_argument("--out", help="JSON file the runs accumulate in")
    parser.add_argument("--verbose", action="store_true", help="print every evaluation")
    args = parser.parse_args()

    import torch

    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.worker.setup import keep_freed_memory, to_device

    keep_freed_memory()  # as in every fit worker
    torch.set_num_threads(args.threads)
    changes = parse_set(args.set)
    suffix = "".join(f" {k}={v}" for k, v in changes.items())
    plan = []  # (name, settings, epochs); "name:epochs" overrides --epochs for one recipe
    for item in args.recipes.split(","):
        name, _, epochs = item.partition(":")
        plan.append((name + suffix, {**recipe(name), **changes}, int(epochs or args.epochs)))
    eval_at = [float(x) for x in args.eval_at.split(",") if x.strip()]
    seeds = parse_seeds(args.seeds)
    data = to_device(load_mnist(args.data_dir, "mnist"), torch.device("cpu"))

    out = Path(args.out) if args.out else None
    saved = json.loads(out.read_text()) if out and out.exists() else {"runs": []}
    # Seed by seed, the recipes in turn: the machine's drift hits every recipe alike.
    for seed in seeds:
        for name, settings, epochs in plan:
            record = run_one(data, settings, seed, epochs, eval_at, args.verbose)
            record = {"recipe": name, "settings": settings, **record}
            record["threads"] = args.threads
            record["date"] = datetime.date.today().isoformat()
            marks = " ".join(
                f"{e['share']:.2f}:{100 * e['val_accuracy']:.2f}"
                for e in record["evals"]
                if e["epoch"] == 1
            )
            s99 = record["s_to_99"]
            print(
                f"{name:40s} seed {seed}: {100 * record['val_accuracy']:.2f} %  "
                f"train {record['train_s']:.1f} s  to 99 %: "
                f"{'-' if s99 is None else f'{s99:.1f} s'}  [{marks}]",
                flush=True,
            )
            if out:
                saved["runs"] = [r for r in saved["runs"] if not _same(r, record)] + [record]
                saved["summary"] = summarize(saved["runs"])
                saved["machine"] = {
                    "platform": platform.platform(),
                    "cores": os.cpu_count(),
                    "torch": torch.__version__,
                    "note": "seconds measured on a shared, loaded machine: noisy",
                }
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(saved, indent=1) + "\n")
    for key, row in summarize(
        [r for r in saved["runs"] if r["recipe"] in {n for n, _, _ in plan}] if out else []
    ).items():
        print(
            f"{key:44s} mean {100 * row['mean']:.3f}  min {100 * row['min']:.2f}  "
            f"max {100 * row['max']:.2f}  seeds {row['seeds']}  99 % reached {row['reached_99']}"
        )


if __name__ == "__main__":
    main()
