"""The one home of defaults and validation, and the import path of every settings class.

* :class:`TrainConfig` — what a run computes (hyperparameters, precision, seed). It crosses
  the Ray boundary as a dict and is the only input of the worker loop; a resumed run must
  match it. Its named :data:`RECIPES` are here too.
* :class:`RunSettings` — where and how it runs, in sections shaped like Ray's configs
  (defined in :mod:`raytrain_mnist.run_settings`).

:class:`FitConfig` holds both and checks the rules that need both. The CLI (`fit`, `tune`),
the notebook and job submission all build these; none restates a default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from raytrain_mnist.errors import ConfigError
from raytrain_mnist.fields import (
    check_choice,
    check_float,
    check_int,
    flag_fields,
    flags_of,
    option,
)
from raytrain_mnist.run_settings import (
    BACKEND_CHOICES,
    CUDA_GRAPHS_CHOICES,
    DATASET_CHOICES,
    INIT_METHOD_CHOICES,
    NAME_MAX,
    PLACEMENT_CHOICES,
    PROGRESS_CHOICES,
    RUN_NAME_RULE,
    CheckpointSettings,
    DataSettings,
    FailureSettings,
    OutputSettings,
    RunSettings,
    ScalingSettings,
    StorageSettings,
    TorchSettings,
    WorkerRange,
    check_ray_address,
    check_run_name,
    check_workers,
    parse_workers,
)
from raytrain_mnist.toolchain import check_compiler

__all__ = [
    "AMP_CHOICES",
    "BACKEND_CHOICES",
    "CHECKPOINT_METRIC",
    "CUDA_GRAPHS_CHOICES",
    "DATASET_CHOICES",
    "DEFAULT_EPOCHS",
    "DEFAULT_RECIPE",
    "FULL_TRAIN_SIZE",
    "INIT_METHOD_CHOICES",
    "MAX_CHECKPOINT_BYTES",
    "MAX_SHIFT",
    "NAME_MAX",
    "OPTIMIZER_CHOICES",
    "PLACEMENT_CHOICES",
    "PROGRESS_CHOICES",
    "RECIPES",
    "RECIPE_SUMMARY",
    "RUN_NAME_RULE",
    "SCHEDULE_CHOICES",
    "SEED_MAX",
    "SYNC_BN_CHOICES",
    "CheckpointSettings",
    "ConfigError",
    "DataSettings",
    "FailureSettings",
    "FitConfig",
    "OutputSettings",
    "RunSettings",
    "ScalingSettings",
    "StorageSettings",
    "TorchSettings",
    "TrainConfig",
    "WorkerRange",
    "check_data_fits",
    "check_int",
    "check_ray_address",
    "check_run_name",
    "check_workers",
    "epochs_for",
    "finite_number",
    "flag_fields",
    "flags_of",
    "graph_blocker",
    "option",
    "parse_workers",
    "recipe_config",
    "settings_digest",
    "steps_per_epoch",
]

_opt = option

AMP_CHOICES = ("off", "bf16", "fp16")
SYNC_BN_CHOICES = ("auto", "on", "off")
SCHEDULE_CHOICES = ("onecycle", "constant")
OPTIMIZER_CHOICES = ("sgd", "adamw")
#: The largest seed ``torch.manual_seed`` and ``torch.Generator.manual_seed`` accept.
SEED_MAX = 2**64 - 1
#: The largest ``--max-shift``: a shift of half an image moves most of a digit out of it.
MAX_SHIFT = 13
#: The training set TrainConfig's defaults are sized for: full MNIST.
FULL_TRAIN_SIZE = 60_000
#: The metric that ranks a run's checkpoints (Ray keeps the best by it) and Tune's trials.
CHECKPOINT_METRIC = "val_accuracy"
#: The most one checkpoint may hold: its ``state.pt`` on disk and unpacked
#: (worker/checkpoint.py), and a checkpoint directory downloaded from an object store
#: (driver/runs/storage.py). Ours hold the ConvNet with its optimizer state (under 2 MB);
#: 256 MiB leaves room for a model a hundred times larger, while a planted or runaway file
#: or prefix can neither fill memory or the local disk nor keep a command downloading for
#: an hour.
MAX_CHECKPOINT_BYTES = 256 * 2**20


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of one training run; identical on every worker."""

    epochs: int = _opt(1, "number of passes over the training set")
    batch_size: int = _opt(128, "global batch size, split evenly across the workers")
    optimizer: str = _opt(
        "adamw", "AdamW (decoupled weight decay) or SGD (Nesterov momentum)", OPTIMIZER_CHOICES
    )
    lr: float = _opt(0.02, "peak learning rate (the one-cycle schedule warms up to it)")
    momentum: float = _opt(
        0.7,
        "AdamW's beta1, or SGD's momentum (one-cycle SGD cycles it from 0.95 to 0.85 and "
        "back instead, as PyTorch's OneCycleLR does)",
    )
    beta2: float = _opt(0.9, "AdamW's beta2 (the average of squared gradients); SGD ignores it")
    weight_decay: float = _opt(0.05, "weight decay: decoupled with AdamW, L2 with SGD")
    schedule: str = _opt(
        "onecycle",
        "learning-rate schedule: one-cycle warm-up and anneal, or constant",
        SCHEDULE_CHOICES,
    )
    warmup_pct: float = _opt(0.25, "share of all steps the one-cycle schedule warms up over")
    label_smoothing: float = _opt(
        0.1, "label smoothing of the training loss (0: plain cross-entropy)"
    )
    max_shift: int = _opt(
        1,
        "shift each training image by a random -N..N pixels along each axis, on its "
        "device (0: no augmentation)",
    )
    amp: str = _opt(
        "off", "mixed precision: bf16 runs on CPU and GPU, fp16 needs a GPU", AMP_CHOICES
    )
    sync_bn: str = _opt(
        "auto",
        "SyncBatchNorm: auto = on for GPU runs with more than one worker",
        SYNC_BN_CHOICES,
    )
    seed: int = _opt(0, "seed of weight initialisation and data order")

    def __post_init__(self) -> None:
        check_int("epochs", self.epochs, 1)
        check_int("batch-size", self.batch_size, 1)
        check_float("lr", self.lr, positive=True)
        check_float("momentum", self.momentum)
        if self.momentum >= 1:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        check_float("weight-decay", self.weight_decay)
        check_choice("optimizer", self.optimizer, OPTIMIZER_CHOICES)
        check_float("beta2", self.beta2)
        if self.beta2 >= 1:
            raise ConfigError(f"--beta2 must be in [0, 1), got {self.beta2}")
        check_float("warmup-pct", self.warmup_pct, positive=True)
        if self.warmup_pct >= 1:
            raise ConfigError(f"--warmup-pct must be in (0, 1), got {self.warmup_pct}")
        check_float("label-smoothing", self.label_smoothing)
        if self.label_smoothing >= 1:
            raise ConfigError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        check_int("max-shift", self.max_shift, 0, MAX_SHIFT)
        check_int("seed", self.seed, 0)
        # The order of epoch e is seeded with seed + e, and torch takes 64-bit seeds.
        if self.seed + self.epochs - 1 > SEED_MAX:
            raise ConfigError(
                f"--seed must be at most {SEED_MAX - self.epochs + 1} (torch "
                f"seeds are 64-bit, each epoch uses seed + epoch), got {self.seed}"
            )
        check_choice("schedule", self.schedule, SCHEDULE_CHOICES)
        check_choice("amp", self.amp, AMP_CHOICES)
        check_choice("sync-bn", self.sync_bn, SYNC_BN_CHOICES)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown training setting(s): {', '.join(unknown)}")
        return cls(**values)


#: ``--epochs`` when it is not given (one home: the field's default).
DEFAULT_EPOCHS: int = TrainConfig.__dataclass_fields__["epochs"].default

#: Named recipes for ``--recipe``: TrainConfig values that train the ConvNet well together,
#: spelled in full so that a name keeps its meaning when the defaults move on (flags given
#: beside ``--recipe`` change its values). benchmarks/recipes.py measures them over seeds.
RECIPES: dict[str, dict[str, Any]] = {
    # TrainConfig's defaults: >= 99 % after one epoch of full MNIST, 99.29 % on average.
    "one-epoch": {
        "epochs": 1,
        "batch_size": 128,
        "optimizer": "adamw",
        "lr": 0.02,
        "momentum": 0.7,
        "beta2": 0.9,
        "weight_decay": 0.05,
        "schedule": "onecycle",
        "warmup_pct": 0.25,
        "label_smoothing": 0.1,
        "max_shift": 1,
    },
    # The defaults before it: SGD with Nesterov momentum, 2 epochs to 99.1 %.
    "classic": {
        "epochs": 2,
        "batch_size": 128,
        "optimizer": "sgd",
        "lr": 0.1,
        "momentum": 0.9,
        "beta2": 0.9,
        "weight_decay": 5e-4,
        "schedule": "onecycle",
        "warmup_pct": 0.25,
        "label_smoothing": 0.0,
        "max_shift": 0,
    },
}
DEFAULT_RECIPE = "one-epoch"
#: One line on each recipe, for ``--help``.
RECIPE_SUMMARY = {
    "one-epoch": "AdamW, label smoothing, 1-pixel shifts, 1 epoch",
    "classic": "the earlier defaults, SGD, 2 epochs",
}


def recipe_config(name: str, **changes: Any) -> TrainConfig:
    """The TrainConfig of recipe ``name``, with ``changes`` on top."""
    check_choice("recipe", name, tuple(RECIPES))
    return TrainConfig(**{**RECIPES[name], **changes})


@dataclass(frozen=True)
class FitConfig:
    """Everything one `fit` needs; checks the rules that span both halves."""

    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunSettings = field(default_factory=RunSettings)
    #: ``--epochs`` was not given: on a smaller training set (the bundled sample), fit
    #: trains as many steps as the recipe's epochs take on full MNIST (:func:`epochs_for`).
    auto_epochs: bool = False
    #: The ``--recipe`` ``train`` started from (its flags may have changed some values).
    recipe: str = DEFAULT_RECIPE
    #: ``--num-workers`` was not given: a run on a service (``--service``) takes its count.
    auto_workers: bool = False

    def __post_init__(self) -> None:
        t, r = self.train, self.run.scaling
        tc = self.run.torch
        check_choice("recipe", self.recipe, tuple(RECIPES))
        if r.elastic:
            _check_batch_splits(t.batch_size, r.num_workers)
        elif t.batch_size < r.num_workers:
            raise ConfigError(
                f"--batch-size {t.batch_size} is smaller than --num-workers {r.num_workers}: "
                "every worker needs at least one sample per step"
            )
        elif t.batch_size % r.num_workers:
            lo = t.batch_size // r.num_workers * r.num_workers
            raise ConfigError(
                f"--batch-size {t.batch_size} does not split evenly over {r.num_workers} "
                f"workers; use a multiple of {r.num_workers}, e.g. {lo} or {lo + r.num_workers}"
            )
        if t.amp == "fp16" and not r.use_gpu:
            raise ConfigError("--amp fp16 needs --use-gpu; on CPU use --amp bf16")
        if t.sync_bn == "on" and not r.use_gpu:
            raise ConfigError(
                "--sync-bn on needs --use-gpu: PyTorch's SyncBatchNorm runs only on GPUs "
                "(use --sync-bn auto or off on CPU)"
            )
        if tc.backend == "nccl" and not r.use_gpu:
            raise ConfigError("--backend nccl needs --use-gpu; on CPU use --backend gloo")
        if tc.compile and self.run.address is None and not os.environ.get("RAY_ADDRESS"):
            check_compiler(r.use_gpu)  # a local run trains here; a cluster's workers check
        blocked = graph_blocker(t.optimizer, r.use_gpu, self.run.resolved_backend, tc.compile)
        if tc.cuda_graphs == "on" and blocked:
            raise ConfigError(
                f"--cuda-graphs on cannot capture this run's step: {blocked}; "
                "use --cuda-graphs auto (it captures where it can) or off"
            )

    @property
    def captures_step(self) -> bool:
        """Each worker's training step is one CUDA graph (``--cuda-graphs``)."""
        tc, r = self.run.torch, self.run
        blocked = graph_blocker(
            self.train.optimizer, r.scaling.use_gpu, r.resolved_backend, tc.compile
        )
        return tc.cuda_graphs != "off" and blocked is None


def graph_blocker(optimizer: str, gpu: bool, backend: str | None, compiled: bool) -> str | None:
    """Why a run's training step cannot be captured in one CUDA graph, or None when it can:
    the one rule, for the driver's check of ``--cuda-graphs on`` and the workers' choice
    (``backend``: the process group's, None without one)."""
    if not gpu:
        return "it trains on CPUs (a CUDA graph needs --use-gpu)"
    if backend not in (None, "nccl"):
        return (
            "its workers talk over Gloo, which copies through host memory and cannot run "
            "inside a CUDA graph (NCCL needs one GPU per worker)"
        )
    if optimizer != "adamw":
        return "the captured step's optimizer is fused AdamW, not SGD (--optimizer adamw)"
    if compiled:
        return "--compile's model is compiled, not captured"
    return None


def _check_batch_splits(batch_size: int, workers: WorkerRange) -> None:
    """Every size an elastic run may take splits the global batch evenly, so a resize
    changes the per-worker batch and nothing else."""
    sizes = range(workers[0], workers[1] + 1)
    bad = [n for n in sizes if batch_size % n]
    if not bad:
        return
    good = [n for n in sizes if not batch_size % n]
    lcm = math.lcm(*sizes)
    suggestion = f"--batch-size {max(lcm, batch_size // lcm * lcm)}"
    raise ConfigError(
        f"--batch-size {batch_size} does not split evenly over {', '.join(map(str, bad))} "
        f"worker(s), which --num-workers {workers} may run on; sizes that work: "
        f"{', '.join(map(str, good)) or 'none'} (or use {suggestion})"
    )


def epochs_for(train: TrainConfig, train_size: int) -> int:
    """Epochs over ``train_size`` images that take about as many optimizer steps as
    ``train.epochs`` take over full MNIST at ``train``'s batch size (never fewer epochs)."""
    default = train.epochs
    if train_size >= FULL_TRAIN_SIZE:
        return default
    steps = max(1, train_size // train.batch_size)
    return max(default, math.ceil(default * (FULL_TRAIN_SIZE // train.batch_size) / steps))


def steps_per_epoch(train_size: int, batch_size: int, num_workers: int) -> int:
    """Optimizer steps in one epoch: each worker takes ``batch_size // num_workers`` samples
    per step from its share of the training set, and drops a last partial batch. Several
    workers share through a DistributedSampler, which pads every share to ceil(N / workers)."""
    per_worker = batch_size // num_workers
    share = train_size if num_workers == 1 else -(-train_size // num_workers)
    return share // per_worker if per_worker else 0


def check_data_fits(train: TrainConfig, run: RunSettings, train_size: int) -> None:
    """Refuse, before anything starts, a run that the training set cannot feed: an epoch of
    no step, or a one-cycle schedule whose step count PyTorch cannot split. ``run``'s
    workers may be a count or an elastic (min, max) range: every size in it is checked."""
    workers = run.scaling.num_workers
    low, high = (workers, workers) if isinstance(workers, int) else workers
    for count in range(low, high + 1):
        if train.batch_size < count:
            raise ConfigError(
                f"--batch-size {train.batch_size} is smaller than {count} "
                "workers: every worker needs at least one sample per step"
            )
        steps = steps_per_epoch(train_size, train.batch_size, count)
        share = train_size if count == 1 else -(-train_size // count)
        if steps < 1:
            largest = share * count
            on = f" over {count} workers" if count > 1 else ""
            raise ConfigError(
                f"--batch-size {train.batch_size} is larger than the {train_size} training "
                f"images{on} can fill: an epoch would have no step; use --batch-size "
                f"{largest} or less"
            )
        total = train.epochs * steps
        # OneCycleLR divides by its warm-up length in steps, warmup_pct * total - 1.
        if train.schedule == "onecycle" and train.warmup_pct * total - 1 == 0:
            raise ConfigError(
                f"--epochs {train.epochs} x {steps} step(s) per epoch is {total} steps, a "
                "one-cycle warm-up of no step (PyTorch's OneCycleLR fails on it); change "
                "--epochs, --batch-size or --warmup-pct, or use --schedule constant"
            )
    # A resize restores the schedule from the checkpoint, its length included: every size
    # must take the same steps per epoch (padded shares can add one at large sizes).
    by_size = {n: steps_per_epoch(train_size, train.batch_size, n) for n in range(low, high + 1)}
    if len(set(by_size.values())) > 1:
        usual = by_size[low]
        good = ", ".join(str(n) for n, s in by_size.items() if s == usual)
        other = ", ".join(f"{s} on {n}" for n, s in by_size.items() if s != usual)
        raise ConfigError(
            f"--num-workers {low}-{high}: an epoch of {train_size} images takes {usual} steps "
            f"on {low} worker(s) but {other}, and a resize must keep the schedule; sizes "
            f"that work: {good}"
        )


def finite_number(value: Any) -> float | None:
    """``value`` as a float when it is a finite real number (not a bool), else None: how a
    metric read back from a report, a trial or a file is taken."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value) if math.isfinite(value) else None
    except OverflowError:  # an int too large for a float (a record's 400-digit number)
        return None


def settings_digest(settings: dict) -> str:
    """Eight hex digits that stand for ``settings`` (JSON-able): the deterministic part of a
    default run or experiment name (no timestamp: the same command finds the same run)."""
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
