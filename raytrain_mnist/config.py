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
from dataclasses import dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """A setting the user can fix. The message names the setting and the fix."""


def _opt(default: Any, help: str, choices: tuple | None = None, flag: str | None = None):
    """A dataclass field whose metadata also drives the command line."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


AMP_CHOICES = ("off", "bf16", "fp16")
SYNC_BN_CHOICES = ("auto", "on", "off")
SCHEDULE_CHOICES = ("onecycle", "constant")
BACKEND_CHOICES = ("auto", "nccl", "gloo")
INIT_METHOD_CHOICES = ("env", "tcp")
DATASET_CHOICES = ("auto", "mnist", "sample")
PLACEMENT_CHOICES = ("PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of one training run; identical on every worker."""

    epochs: int = _opt(2, "number of passes over the training set")
    batch_size: int = _opt(128, "global batch size, split evenly across the workers")
    lr: float = _opt(0.1, "peak learning rate of SGD (the one-cycle schedule warms up to it)")
    momentum: float = _opt(0.9, "SGD momentum (Nesterov)")
    weight_decay: float = _opt(5e-4, "L2 weight decay")
    schedule: str = _opt(
        "onecycle", "learning-rate schedule: one-cycle warm-up and anneal, or constant",
        SCHEDULE_CHOICES,
    )
    amp: str = _opt(
        "off", "mixed precision: bf16 runs on CPU and GPU, fp16 needs a GPU", AMP_CHOICES
    )
    sync_bn: str = _opt(
        "auto", "SyncBatchNorm: auto = on for GPU runs with more than one worker",
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
        _check_int("seed", self.seed, 0)
        _check_choice("schedule", self.schedule, SCHEDULE_CHOICES)
        _check_choice("amp", self.amp, AMP_CHOICES)
        _check_choice("sync-bn", self.sync_bn, SYNC_BN_CHOICES)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown training setting(s): {', '.join(unknown)}")
        return cls(**values)


@dataclass(frozen=True)
class RunSettings:
    """Where a run executes and where its data and results live."""

    num_workers: int = _opt(2, "training workers (Ray actors), one per GPU or CPU slot")
    use_gpu: bool = _opt(False, "train on GPUs, one per worker unless --gpus-per-worker says "
                                 "otherwise (NCCL backend by default)")
    gpus_per_worker: Optional[float] = _opt(
        None, "GPUs per worker with --use-gpu (default 1): a fraction such as 0.25 puts "
        "several workers on one GPU (their traffic then goes over Gloo), or a whole number",
    )
    cpus_per_worker: Optional[int] = _opt(
        None, "CPUs (and torch threads) per worker; default: this machine's cores / workers "
        "on a local Ray, 1 on a cluster",
    )
    backend: str = _opt(
        "auto", "process-group backend: auto = NCCL with a GPU per worker, Gloo on CPUs or "
        "on shared GPUs", BACKEND_CHOICES
    )
    init_method: str = _opt(
        "env", "process-group initialisation: env:// (MASTER_ADDR/PORT) or tcp://host:port",
        INIT_METHOD_CHOICES,
    )
    dataset: str = _opt(
        "auto", "auto: full MNIST, else the bundled 5,000-image sample; mnist: full MNIST "
        "or fail; sample: the bundled sample", DATASET_CHOICES,
    )
    data_dir: Optional[str] = _opt(
        None, "directory holding MNIST in torchvision's layout (DIR/MNIST/raw/*-ubyte[.gz])"
    )
    storage_path: str = _opt(
        os.environ.get("RAYTRAIN_MNIST_STORAGE_PATH") or "runs",
        "where run directories live: a local path or a URI such as s3://bucket/runs; "
        "$RAYTRAIN_MNIST_STORAGE_PATH sets the default",
    )
    name: Optional[str] = _opt(
        None, "run name; the same name resumes that run (default: derived from the settings)"
    )
    fresh: bool = _opt(
        False, "train this run again from scratch; its previous directory is kept as "
        "NAME.previous-N"
    )
    address: Optional[str] = _opt(
        None, "Ray cluster address (host:port or auto); default: $RAY_ADDRESS, else start "
        "a local Ray",
    )
    max_failures: int = _opt(
        2, "worker-group restarts allowed after a worker failure (-1 = unlimited)"
    )
    keep_checkpoints: int = _opt(2, "checkpoints kept, ranked by validation accuracy")
    placement_strategy: str = _opt(
        "PACK", "how workers are placed on nodes: PACK fills nodes first, SPREAD and "
        "STRICT_SPREAD put them on different nodes", PLACEMENT_CHOICES,
    )
    no_tensorboard: bool = _opt(
        False, "do not write TensorBoard event files into the run directory"
    )
    mlflow: bool = _opt(
        False, "also log to MLflow (pip install 'raytrain-mnist[mlflow]'); store: "
        "file:<run_dir>/mlruns"
    )
    mlflow_uri: Optional[str] = _opt(None, "MLflow tracking URI (implies --mlflow)")
    socket_ifname: Optional[str] = _opt(
        None, "network interface for Gloo/NCCL traffic (sets GLOO_SOCKET_IFNAME and "
        "NCCL_SOCKET_IFNAME on every worker)",
    )

    def __post_init__(self) -> None:
        _check_int("num-workers", self.num_workers, 1)
        if self.cpus_per_worker is not None:
            _check_int("cpus-per-worker", self.cpus_per_worker, 1)
        _check_choice("backend", self.backend, BACKEND_CHOICES)
        self._check_gpus_per_worker()
        _check_choice("init-method", self.init_method, INIT_METHOD_CHOICES)
        _check_choice("dataset", self.dataset, DATASET_CHOICES)
        _check_choice("placement-strategy", self.placement_strategy, PLACEMENT_CHOICES)
        if not isinstance(self.max_failures, int) or self.max_failures < -1:
            raise ConfigError(
                f"--max-failures must be -1 (unlimited) or a count >= 0, got {self.max_failures}"
            )
        _check_int("keep-checkpoints", self.keep_checkpoints, 1)
        if not self.storage_path:
            raise ConfigError("--storage-path must not be empty")
        if self.name is not None:
            check_run_name(self.name)
        if self.socket_ifname is not None and not self.socket_ifname.strip():
            raise ConfigError("--socket-ifname must name a network interface, e.g. eth0")

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
            raise ConfigError(f"--gpus-per-worker must be in (0, 1] (at most 4 decimals) or "
                              f"a whole number, e.g. 0.5 (2 workers per GPU) or 2; got {f!r}")
        if self.backend == "nccl" and f < 1:
            raise ConfigError(
                f"--backend nccl cannot run workers that share a GPU (--gpus-per-worker {f:g}): "
                "NCCL refuses two ranks on one device; use --backend auto or gloo")

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

    @property
    def resolved_backend(self) -> str:
        """The process-group backend this run uses: "nccl" or "gloo"."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.use_gpu and not self.shares_gpus else "gloo"

    @property
    def backend_description(self) -> str:
        """``resolved_backend`` and why, for the start line."""
        name = {"nccl": "NCCL", "gloo": "Gloo"}[self.resolved_backend]
        if self.backend != "auto":
            return f"{name} (--backend {self.backend})"
        if self.shares_gpus:
            return f"{name} on CUDA tensors (workers share a GPU; NCCL needs one GPU per rank)"
        return f"{name} (auto: {'GPUs' if self.use_gpu else 'CPUs'})"


@dataclass(frozen=True)
class FitConfig:
    """Everything one `fit` needs; checks the rules that span both halves."""

    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunSettings = field(default_factory=RunSettings)

    def __post_init__(self) -> None:
        t, r = self.train, self.run
        if t.batch_size < r.num_workers:
            raise ConfigError(
                f"--batch-size {t.batch_size} is smaller than --num-workers {r.num_workers}: "
                "every worker needs at least one sample per step"
            )
        if t.batch_size % r.num_workers:
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
        if r.backend == "nccl" and not r.use_gpu:
            raise ConfigError("--backend nccl needs --use-gpu; on CPU use --backend gloo")

    @property
    def run_name(self) -> str:
        """The run's name: given, or derived from what the run computes.

        Deterministic (no timestamp) so that running the same command again resumes
        the same run instead of starting a new one.
        """
        if self.run.name:
            return self.run.name
        identity = {**self.train.to_dict(), "num_workers": self.run.num_workers,
                    "use_gpu": self.run.use_gpu, "dataset": self.run.dataset}
        digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
        return f"mnist-{self.run.num_workers}w-{digest}"


def check_run_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or os.sep in name or name.startswith("-"):
        raise ConfigError(
            f"--name {name!r} is not a valid run name: use letters, digits, '-', '_' or '.'"
        )


def _check_int(flag: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"--{flag} must be an integer >= {minimum}, got {value!r}")


def _check_float(flag: str, value: Any, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        kind = "a positive number" if positive else "a number >= 0"
        raise ConfigError(f"--{flag} must be {kind}, got {value!r}")


def _check_choice(flag: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"--{flag} must be one of {', '.join(choices)}; got {value!r}")
