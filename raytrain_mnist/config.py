"""The one home of defaults and validation.

Two dataclasses, one per concern:

* :class:`TrainConfig` — what a run computes (hyperparameters, precision, seed). It crosses
  the Ray boundary as a dict and is the only input of the worker loop; a resumed run must
  match it.
* :class:`RunSettings` — where and how it runs (workers, cluster, data, storage).

:class:`FitConfig` holds both and checks the rules that need both. The CLI (`fit`, `tune`),
the notebook and job submission all build these; none restates a default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from raytrain_mnist.errors import ConfigError


def option(default: Any, help: str, choices: tuple | None = None, flag: str | None = None):
    """A dataclass field whose metadata also drives the command line (its help, its choices):
    the one way a settings dataclass of this package declares a flag."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


_opt = option


AMP_CHOICES = ("off", "bf16", "fp16")
SYNC_BN_CHOICES = ("auto", "on", "off")
SCHEDULE_CHOICES = ("onecycle", "constant")
OPTIMIZER_CHOICES = ("sgd", "adamw")
BACKEND_CHOICES = ("auto", "nccl", "gloo")
INIT_METHOD_CHOICES = ("env", "tcp")
DATASET_CHOICES = ("auto", "mnist", "sample")
PLACEMENT_CHOICES = ("PACK", "SPREAD", "STRICT_SPREAD")
PROGRESS_CHOICES = ("auto", "bar", "lines", "off")
#: The largest seed ``torch.manual_seed`` and ``torch.Generator.manual_seed`` accept.
SEED_MAX = 2**64 - 1
#: The largest ``--max-shift``: a shift of half an image moves most of a digit out of it.
MAX_SHIFT = 13
#: Longest run name: a file name, with room for the ``.previous-N`` of ``--fresh``.
NAME_MAX = 200
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
        _check_int("epochs", self.epochs, 1)
        _check_int("batch-size", self.batch_size, 1)
        _check_float("lr", self.lr, positive=True)
        _check_float("momentum", self.momentum)
        if self.momentum >= 1:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        _check_float("weight-decay", self.weight_decay)
        _check_choice("optimizer", self.optimizer, OPTIMIZER_CHOICES)
        _check_float("beta2", self.beta2)
        if self.beta2 >= 1:
            raise ConfigError(f"--beta2 must be in [0, 1), got {self.beta2}")
        _check_float("warmup-pct", self.warmup_pct, positive=True)
        if self.warmup_pct >= 1:
            raise ConfigError(f"--warmup-pct must be in (0, 1), got {self.warmup_pct}")
        _check_float("label-smoothing", self.label_smoothing)
        if self.label_smoothing >= 1:
            raise ConfigError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        _check_int("max-shift", self.max_shift, 0, MAX_SHIFT)
        _check_int("seed", self.seed, 0)
        # The order of epoch e is seeded with seed + e, and torch takes 64-bit seeds.
        if self.seed + self.epochs - 1 > SEED_MAX:
            raise ConfigError(
                f"--seed must be at most {SEED_MAX - self.epochs + 1} (torch "
                f"seeds are 64-bit, each epoch uses seed + epoch), got {self.seed}"
            )
        _check_choice("schedule", self.schedule, SCHEDULE_CHOICES)
        _check_choice("amp", self.amp, AMP_CHOICES)
        _check_choice("sync-bn", self.sync_bn, SYNC_BN_CHOICES)

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
    _check_choice("recipe", name, tuple(RECIPES))
    return TrainConfig(**{**RECIPES[name], **changes})


@dataclass(frozen=True)
class ScalingSettings:
    """How many workers and what each holds (Ray's ``ScalingConfig``)."""

    num_workers: int = _opt(
        2,
        "training workers (Ray actors), one per GPU or CPU slot; fit also takes a range "
        "MIN-MAX (e.g. 2-4): an elastic run that starts once MIN fit and grows or shrinks as "
        "nodes come and go, from its latest checkpoint",
    )
    resize_check_s: float = _opt(
        60.0,
        "with a --num-workers range: seconds between Ray's checks for room to grow",
    )
    use_gpu: bool = _opt(
        False,
        "train on GPUs, one per worker unless --gpus-per-worker says "
        "otherwise (NCCL backend by default)",
    )
    gpus_per_worker: Optional[float] = _opt(
        None,
        "GPUs per worker with --use-gpu (default 1): a fraction such as 0.25 puts "
        "several workers on one GPU (their traffic then goes over Gloo), or a whole number",
    )
    cpus_per_worker: Optional[int] = _opt(
        None,
        "CPUs (and torch threads) per worker; default: this machine's cores / workers "
        "on a local Ray, 1 on a cluster",
    )
    placement_strategy: str = _opt(
        "PACK",
        "how workers are placed on nodes: PACK fills nodes first, SPREAD and "
        "STRICT_SPREAD put them on different nodes",
        PLACEMENT_CHOICES,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_workers", check_workers(self.num_workers))
        _check_float("resize-check-s", self.resize_check_s, positive=True)
        if self.cpus_per_worker is not None:
            _check_int("cpus-per-worker", self.cpus_per_worker, 1)
        self._check_gpus_per_worker()
        _check_choice("placement-strategy", self.placement_strategy, PLACEMENT_CHOICES)

    def _check_gpus_per_worker(self) -> None:
        f = self.gpus_per_worker
        if f is None:
            return
        if not self.use_gpu:
            raise ConfigError("--gpus-per-worker needs --use-gpu")
        ok = isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f)
        # Ray's rules: a fraction of one GPU in steps of 0.0001, or whole GPUs (it cannot
        # split 1.5 over devices).
        if not ok or f <= 0 or (f > 1 and f != int(f)) or round(f, 4) != f:
            raise ConfigError(
                f"--gpus-per-worker must be in (0, 1] (at most 4 decimals) or "
                f"a whole number, e.g. 0.5 (2 workers per GPU) or 2; got {f!r}"
            )

    @property
    def elastic(self) -> bool:
        """A worker range: Ray sizes the run between ``min_workers`` and ``max_workers``."""
        return isinstance(self.num_workers, WorkerRange)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if self.elastic else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if self.elastic else self.num_workers

    @property
    def gpus(self) -> float:
        """GPUs each worker asks Ray for: 0 without --use-gpu."""
        if not self.use_gpu:
            return 0
        return 1 if self.gpus_per_worker is None else self.gpus_per_worker

    @property
    def shares_gpus(self) -> bool:
        """Several workers on one GPU (a fractional --gpus-per-worker)."""
        return 0 < self.gpus < 1


@dataclass(frozen=True)
class TorchSettings:
    """How the workers' torch runs and talks (Ray's ``TorchConfig``, and torch.compile)."""

    backend: str = _opt(
        "auto",
        "process-group backend: auto = NCCL with a GPU per worker, Gloo on CPUs or on shared GPUs",
        BACKEND_CHOICES,
    )
    init_method: str = _opt(
        "env",
        "process-group initialisation: env:// (MASTER_ADDR/PORT) or tcp://host:port",
        INIT_METHOD_CHOICES,
    )
    socket_ifname: Optional[str] = _opt(
        None,
        "network interface for Gloo/NCCL traffic (sets GLOO_SOCKET_IFNAME and "
        "NCCL_SOCKET_IFNAME on every worker)",
    )
    # How a run executes, not what it computes (so not TrainConfig): Inductor's kernels
    # change float rounding no more than the worker or thread count does, the checkpoints
    # are an eager run's, and a run may resume with or without it (same identity and name).
    compile: bool = _opt(
        False,
        "torch.compile the ConvNet (Inductor) before DDP wraps it: the first step "
        "compiles (14-47 s on 2 CPU cores), and on CPU the compiled steps measured "
        "1.2-1.3x slower than eager ones (benchmarks/README.md); needs a C++ compiler on CPU "
        "($CXX or g++), a C one on GPU",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            raise ConfigError(f"--compile is on or off (true or false), got {self.compile!r}")
        _check_choice("backend", self.backend, BACKEND_CHOICES)
        _check_choice("init-method", self.init_method, INIT_METHOD_CHOICES)
        if self.socket_ifname is not None and not self.socket_ifname.strip():
            raise ConfigError("--socket-ifname must name a network interface, e.g. eth0")


@dataclass(frozen=True)
class DataSettings:
    """Which training and test images the run reads."""

    dataset: str = _opt(
        "auto",
        "auto: full MNIST, else the bundled 5,000-image sample; mnist: full MNIST "
        "or fail; sample: the bundled sample",
        DATASET_CHOICES,
    )
    data_dir: Optional[str] = _opt(
        None, "directory holding MNIST in torchvision's layout (DIR/MNIST/raw/*-ubyte[.gz])"
    )

    def __post_init__(self) -> None:
        _check_choice("dataset", self.dataset, DATASET_CHOICES)
        if self.data_dir is not None:
            check_no_credentials(self.data_dir, "--data-dir")


@dataclass(frozen=True)
class StorageSettings:
    """Where the run's directory lives and which run it is (Ray's ``RunConfig``)."""

    storage_path: str = _opt(
        os.environ.get("RAYTRAIN_MNIST_STORAGE_PATH") or "runs",
        "where run directories live: a local path or a URI such as s3://bucket/runs; "
        "$RAYTRAIN_MNIST_STORAGE_PATH sets the default",
    )
    name: Optional[str] = _opt(
        None, "run name; the same name resumes that run (default: derived from the settings)"
    )
    fresh: bool = _opt(
        False,
        "train this run again from scratch; its previous directory is kept as NAME.previous-N",
    )

    def __post_init__(self) -> None:
        if not self.storage_path:
            raise ConfigError("--storage-path must not be empty")
        check_no_credentials(self.storage_path, "--storage-path")
        if self.name is not None:
            check_run_name(self.name)


@dataclass(frozen=True)
class FailureSettings:
    """What the run survives (Ray's ``FailureConfig``)."""

    max_failures: int = _opt(
        2, "worker-group restarts allowed after a worker failure (-1 = unlimited)"
    )
    max_preemptions: int = _opt(
        -1,
        "worker-group restarts allowed after a node is preempted (drained with a notice, "
        "as a spot reclaim is), counted apart from --max-failures (-1 = unlimited)",
    )

    def __post_init__(self) -> None:
        for flag, value in (("failures", self.max_failures), ("preemptions", self.max_preemptions)):
            if isinstance(value, bool) or not isinstance(value, int) or value < -1:
                raise ConfigError(
                    f"--max-{flag} must be -1 (unlimited) or a count >= 0, got {value}"
                )


@dataclass(frozen=True)
class CheckpointSettings:
    """Which checkpoints the run keeps (Ray's ``CheckpointConfig``)."""

    keep_checkpoints: int = _opt(2, "checkpoints kept, ranked by validation accuracy")

    def __post_init__(self) -> None:
        _check_int("keep-checkpoints", self.keep_checkpoints, 1)


@dataclass(frozen=True)
class OutputSettings:
    """What the run shows and records beside its checkpoints."""

    progress: str = _opt(
        "auto",
        "live progress: a bar within each epoch (bar), start-up phases and epoch lines "
        "without redraws (lines), epoch lines only (off); auto = bar on a terminal, else lines",
        PROGRESS_CHOICES,
    )
    no_tensorboard: bool = _opt(
        False, "do not write TensorBoard event files into the run directory"
    )
    mlflow: bool = _opt(
        False,
        "also log to MLflow (pip install 'raytrain-mnist[mlflow]'); store: file:<run_dir>/mlruns",
    )
    mlflow_uri: Optional[str] = _opt(None, "MLflow tracking URI (implies --mlflow)")

    def __post_init__(self) -> None:
        _check_choice("progress", self.progress, PROGRESS_CHOICES)
        if self.mlflow_uri is not None:
            check_no_credentials(self.mlflow_uri, "--mlflow-uri")


@dataclass(frozen=True)
class RunSettings:
    """Where a run executes and where its data and results live, in sections shaped like
    Ray's own configs. The command line writes them flat (``--num-workers``, not
    ``--scaling.num-workers``): :meth:`from_flags` and :meth:`to_dict` take and give them so,
    as run records store them."""

    scaling: ScalingSettings = field(default_factory=ScalingSettings)
    torch: TorchSettings = field(default_factory=TorchSettings)
    data: DataSettings = field(default_factory=DataSettings)
    storage: StorageSettings = field(default_factory=StorageSettings)
    failure: FailureSettings = field(default_factory=FailureSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    output: OutputSettings = field(default_factory=OutputSettings)
    address: Optional[str] = _opt(
        None,
        "Ray cluster address (host:port or auto); default: $RAY_ADDRESS, else start a local Ray",
    )

    #: The flags' order in --help, resume commands and run records (the order they had as
    #: one flat class); a flag not named here follows, in its section's order.
    flag_order = (
        "num_workers", "resize_check_s", "progress", "use_gpu", "gpus_per_worker",
        "cpus_per_worker", "backend", "init_method", "dataset", "data_dir", "storage_path",
        "name", "fresh", "address", "max_failures", "max_preemptions", "keep_checkpoints",
        "placement_strategy", "no_tensorboard", "mlflow", "mlflow_uri", "socket_ifname", "compile",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.address is not None:
            check_ray_address(self.address)
        f = self.scaling.gpus_per_worker
        if f is not None and self.torch.backend == "nccl" and f < 1:
            raise ConfigError(
                f"--backend nccl cannot run workers that share a GPU (--gpus-per-worker {f:g}): "
                "NCCL refuses two ranks on one device; use --backend auto or gloo"
            )

    @classmethod
    def from_flags(cls, **values: Any) -> RunSettings:
        """RunSettings from values named as their flags are (``num_workers=2``,
        ``dataset="sample"``): a command line's, a run record's (:meth:`to_dict`), a test's."""
        unknown = sorted(set(values) - set(flag_fields(cls)))
        if unknown:
            raise ConfigError(f"unknown run setting(s): {', '.join(unknown)}")
        given = {}
        for f in dataclasses.fields(cls):
            section = _section(f)
            if section is None:
                if f.name in values:
                    given[f.name] = values[f.name]
                continue
            names = {s.name for s in dataclasses.fields(section)}
            given[f.name] = section(**{n: v for n, v in values.items() if n in names})
        return cls(**given)

    def to_dict(self) -> dict[str, Any]:
        """Every setting by its flag's name, in :attr:`flag_order`: :meth:`from_flags`'s input."""
        return flag_values(self)

    @property
    def resolved_backend(self) -> str:
        """The process-group backend this run uses: "nccl" or "gloo"."""
        if self.torch.backend != "auto":
            return self.torch.backend
        return "nccl" if self.scaling.use_gpu and not self.scaling.shares_gpus else "gloo"

    @property
    def backend_description(self) -> str:
        """``resolved_backend`` and why, for the start line."""
        name = {"nccl": "NCCL", "gloo": "Gloo"}[self.resolved_backend]
        if self.torch.backend != "auto":
            return f"{name} (--backend {self.torch.backend})"
        if self.scaling.shares_gpus:
            return f"{name} on CUDA tensors (workers share a GPU; NCCL needs one GPU per rank)"
        return f"{name} (auto: {'GPUs' if self.scaling.use_gpu else 'CPUs'})"


def _section(f: dataclasses.Field) -> type | None:
    """The settings dataclass a field holds (a section of its class), or None for a flag."""
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def flag_fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """The flags of settings dataclass ``cls`` by name, each with its field and type: its
    own fields, and in place of a section (a field holding a settings dataclass) that
    section's, in ``cls.flag_order`` where it has one."""
    found: dict[str, tuple[dataclasses.Field, Any]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        section = _section(f)
        if section is None:
            found[f.name] = (f, hints[f.name])
        else:
            found.update(flag_fields(section))
    order = [n for n in getattr(cls, "flag_order", ()) if n in found]
    return {n: found[n] for n in [*order, *(n for n in found if n not in order)]}


def flag_values(config: Any) -> dict[str, Any]:
    """The value of each of ``config``'s flags (:func:`flag_fields`), by name."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        values.update(flag_values(value) if _section(f) else {f.name: value})
    return {n: values[n] for n in flag_fields(type(config))}


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

    def __post_init__(self) -> None:
        t, r = self.train, self.run.scaling
        tc = self.run.torch
        _check_choice("recipe", self.recipe, tuple(RECIPES))
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


def compiler_missing(use_gpu: bool) -> str | None:
    """What ``torch.compile`` lacks on this machine to build its kernels, or None: on CPU
    Inductor compiles C++ with ``$CXX``, else ``g++``; on GPU Triton builds its launchers with
    ``$CC``, else ``gcc`` or ``clang``. Without one the first step fails."""
    if use_gpu:
        cc = os.environ.get("CC", "").strip()
        names = [cc] if cc else ["gcc", "clang"]
        what = f"a C compiler for Triton ({f'$CC is {cc!r}' if cc else 'gcc or clang, or $CC'})"
    else:
        cxx = os.environ.get("CXX", "").strip()
        names = [cxx or "g++"]
        what = f"a C++ compiler for Inductor ({f'$CXX is {cxx!r}' if cxx else 'g++, or $CXX'})"
    return None if any(shutil.which(name.split()[0]) for name in names) else what


def check_compiler(use_gpu: bool) -> None:
    """Refuse ``--compile`` where :func:`compiler_missing` finds no compiler, in one line."""
    missing = compiler_missing(use_gpu)
    if missing is not None:
        raise ConfigError(
            f"--compile needs {missing} and finds none here; install one "
            "(Debian: apt-get install g++), set the variable, or drop --compile"
        )


class WorkerRange(tuple):
    """An elastic worker count ``(min, max)``, as ``--num-workers MIN-MAX`` writes it."""

    def __new__(cls, values) -> WorkerRange:
        low, high = values
        return super().__new__(cls, (low, high))

    def __str__(self) -> str:  # the flag's form: names and resume commands use it
        return f"{self[0]}-{self[1]}"


def parse_workers(text: str):
    """``--num-workers`` of fit: ``N`` or ``MIN-MAX``. Text that is neither is returned as
    is, for :func:`check_workers` to refuse in its one line."""
    low, sep, high = text.strip().partition("-")
    try:
        return WorkerRange((int(low), int(high))) if sep else int(low)
    except ValueError:
        return text


def check_workers(value: Any) -> int | WorkerRange:
    """A worker count (int >= 1) or a range ``(min, max)`` with 1 <= min <= max; a range of
    one size is that fixed size."""
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        low, high = value
        if 1 <= low <= high:
            return low if low == high else WorkerRange(value)
        raise ConfigError(f"--num-workers {low}-{high}: a range needs 1 <= MIN <= MAX, e.g. 2-4")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"--num-workers must be a count >= 1 (e.g. 2) or a range MIN-MAX "
            f"(e.g. 2-4), got {value!r}"
        )
    return value


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


#: A run name: one path segment that means the same on every storage (a local directory, an
#: S3 key, a URI): ASCII letters, digits, '.', '_' and '-', never first '.' or '-'. Nothing a
#: URI gives a meaning to ('?', '#', '%', '/', '\\'), no blanks, no control characters.
RUN_NAME_RULE = "letters, digits, '.', '_' and '-', not starting with '.' or '-'"
_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*", re.ASCII)


def check_run_name(name: str, flag: str = "--name") -> None:
    """Refuse a run name that is not a safe path segment on every storage (:data:`RUN_NAME_RULE`,
    at most :data:`NAME_MAX` characters)."""
    if not isinstance(name, str) or len(name) > NAME_MAX or not _RUN_NAME.fullmatch(name):
        shown = repr(name if not isinstance(name, str) or len(name) <= 60 else name[:60] + "...")
        raise ConfigError(
            f"{flag} {shown} is not a valid run name: use {RUN_NAME_RULE} "
            f"(at most {NAME_MAX} characters)"
        )


def check_ray_address(address: str, flag: str = "--address") -> None:
    """The forms of a Ray cluster address: ``auto``, ``HOST:PORT`` (``[IPv6]:PORT``) or
    ``ray://HOST:PORT``. Whether something answers there is the cluster module's to find."""
    if address == "auto":
        return
    if not address.strip():
        raise ConfigError(
            f"{flag} is empty; drop it to train on a local Ray, or give "
            "HOST:PORT of the cluster's head (e.g. 10.0.0.1:6379)"
        )
    if "@" in address:  # not echoed: the part before '@' may be a password
        raise ConfigError(
            f"{flag}: a Ray address holds no user name or password; give HOST:PORT "
            "(e.g. 10.0.0.1:6379), ray://HOST:PORT or auto"
        )
    rest = address[len("ray://") :] if address.startswith("ray://") else address
    if "://" in rest:
        raise ConfigError(
            f"{flag} {address!r}: fit connects to the Ray GCS (host:port, e.g. 10.0.0.1:6379); "
            "submit jobs to a dashboard URL with `python -m raytrain_mnist.submit`"
        )
    host, port = split_host_port(rest)
    if host is None or port is None:
        raise ConfigError(
            f"{flag} {address!r} is not HOST:PORT with a port from 1 to 65535 "
            "(e.g. 127.0.0.1:6379), ray://HOST:PORT or auto"
        )


def split_host_port(text: str) -> tuple[str | None, int | None]:
    """``host:port`` or ``[v6]:port`` into its parts; None for a part that is not valid."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:  # an IPv6 address without brackets: the port is ambiguous
        return None, None
    valid_host = bool(host) and host.isprintable() and not any(c in host for c in " /@?#[]")
    valid_port = bool(sep) and port.isdigit() and 0 < int(port) < 65536
    return (host if valid_host else None), (int(port) if valid_port else None)


def check_mlflow_uri(uri: str) -> None:
    """A tracking URI is written into run records and printed: credentials stay out of it."""
    check_no_credentials(uri, "--mlflow-uri")


#: URI schemes whose user part (``abfs://CONTAINER@ACCOUNT...``, ``hdfs://USER@HOST``) names
#: a container, an account or a user: not a credential unless it holds a password.
_NAMED_USER_SCHEMES = ("abfs", "abfss", "hdfs", "viewfs")
#: Query parameters that carry secrets, matched case-insensitively as parts of a parameter's
#: name: pyarrow's S3 ``access_key``, ``secret_key``, ``session_token``; Azure's
#: ``account_key``, ``client_secret``, SAS ``sig``; any server's token or password.
_SECRET_PARAMETERS = ("key", "secret", "token", "passw", "pwd", "credential", "sig", "auth")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def _uri_parts(uri: str) -> tuple[str, str | None, str, str]:
    """``(scheme, user info or None, query, fragment)`` of ``uri``, split by hand: the same
    for a URI urllib refuses (a bad IPv6 host), so that nothing slips past in one."""
    found = _SCHEME.match(uri)
    scheme = found[1].lower() if found else ""
    rest = uri[found.end() :] if found else uri
    rest, _, fragment = rest.partition("#")
    rest, _, query = rest.partition("?")
    userinfo = None
    if rest.startswith("//"):
        authority = re.split(r"[/\\]", rest[2:], maxsplit=1)[0]
        port = authority.rpartition(":")[2]
        if "@" in authority:
            userinfo = authority.rpartition("@")[0]
        elif ":" in authority and not authority.startswith("[") and not port.isdigit():
            # KEY:SECRET@ where the secret holds a '/' (AWS secrets may): no port follows
            # the ':', an '@' does.
            userinfo = rest[2:].partition("@")[0] if "@" in rest else None
    return scheme, userinfo, query, fragment


def redact_uri(uri: str) -> str:
    """``uri`` as an error message may show it: its user info and its query string (and
    fragment) replaced by ``***``, e.g. ``s3://***@bucket/runs?***``."""
    uri = str(uri)
    _, userinfo, query, fragment = _uri_parts(uri)
    shown = uri.partition("#")[0].partition("?")[0]
    if userinfo is not None:
        head, _, tail = shown.partition("//")
        shown = f"{head}//***@{tail[len(userinfo) + 1 :]}"
    return shown + ("?***" if query else "") + ("#***" if fragment else "")


def uri_credentials(uri: str) -> str | None:
    """What in ``uri`` is a credential ("a password", "a user name", "the query parameter
    'secret_key'"), or None: a local path (no scheme) has none."""
    from urllib.parse import parse_qsl

    uri = str(uri)
    scheme, userinfo, query, _ = _uri_parts(uri)
    if not scheme:
        return None
    if userinfo is not None:
        if ":" in userinfo:
            return "a password"
        if scheme not in _NAMED_USER_SCHEMES:
            return "a user name or token"
    for name, _ in parse_qsl(query, keep_blank_values=True):
        key = name.lower()
        if any(secret in key for secret in _SECRET_PARAMETERS):
            return f"the query parameter {name[:40]!r}"
    return None


def _credential_hint(flag: str, scheme: str) -> str:
    if flag == "--mlflow-uri":
        return "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN"
    if scheme == "s3":
        return "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
    if scheme in ("gs", "gcs"):
        return "GOOGLE_APPLICATION_CREDENTIALS"
    if scheme in ("abfs", "abfss"):
        return "AZURE_CLIENT_ID, AZURE_TENANT_ID and AZURE_CLIENT_SECRET"
    return "the store's own environment variables or configuration files"


def check_no_credentials(uri: str, flag: str) -> None:
    """Refuse a URI that carries a secret (``s3://KEY:SECRET@bucket``, ``https://token@host``,
    ``?secret_key=...``): flags travel into job tables, run records and logs. The message
    shows the URI redacted (:func:`redact_uri`)."""
    what = uri_credentials(uri)
    if what is not None:
        raise ConfigError(
            f"{flag} {redact_uri(uri)}: the URI carries credentials; pass them through the "
            f"environment instead ({_credential_hint(flag, _uri_parts(str(uri))[0])}); "
            f"it holds {what}"
        )


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


def check_int(flag: str, value: Any, low: int, high: int | None = None) -> None:
    """``--flag`` must be an int (not a bool) in ``low..high`` (no upper bound when None)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if not ok or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ConfigError(f"--{flag} must be an integer {bound}, got {value!r}")


_check_int = check_int


def finite_number(value: Any) -> float | None:
    """``value`` as a float when it is a finite real number (not a bool), else None: how a
    metric read back from a report, a trial or a file is taken."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def settings_digest(settings: dict) -> str:
    """Eight hex digits that stand for ``settings`` (JSON-able): the deterministic part of a
    default run or experiment name (no timestamp: the same command finds the same run)."""
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]


def _check_float(flag: str, value: Any, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        kind = "a positive number" if positive else "a number >= 0"
        raise ConfigError(f"--{flag} must be {kind}, got {value!r}")


def _check_choice(flag: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"--{flag} must be one of {', '.join(choices)}; got {value!r}")


def flags_of(
    *configs: Any, skip: Sequence[str] = (), defaults: dict[str, Any] | None = None
) -> list[str]:
    """The flags that rebuild ``configs`` (dataclass instances): every value that differs
    from its default (or from the one ``defaults`` gives: a recipe's), in field order.
    Inverse of ``_cli.add_dataclass_args``."""
    words: list[str] = []
    for config in configs:
        fields = flag_fields(type(config))
        for name, value in flag_values(config).items():
            default = (defaults or {}).get(name, fields[name][0].default)
            if name in skip or value == default or value is None:
                continue
            flag = "--" + name.replace("_", "-")
            if value is True:
                words.append(flag)
            elif value is not False:
                words += [flag, repr(value) if isinstance(value, float) else str(value)]
    return words


def command_line(words: Sequence[str]) -> str:
    """``words`` as one shell command line."""
    return " ".join(shlex.quote(w) for w in words)


def python_command() -> str:
    """The first word of a command that runs this interpreter again: ``python`` when that is
    the one on ``PATH``, else its full path."""
    found = shutil.which("python")
    same = bool(found) and os.path.realpath(found) == os.path.realpath(sys.executable)
    return "python" if same else sys.executable
