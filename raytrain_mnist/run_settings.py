"""Where and how a run executes: :class:`RunSettings`, in sections shaped like Ray's own
configs, and the checks of the flags that fill them."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from raytrain_mnist.errors import ConfigError
from raytrain_mnist.fields import (
    check_choice,
    check_float,
    check_int,
    flag_fields,
    flag_values,
    section_of,
)
from raytrain_mnist.fields import option as _opt
from raytrain_mnist.net import split_host_port
from raytrain_mnist.uris import check_no_credentials

BACKEND_CHOICES = ("auto", "nccl", "gloo")
INIT_METHOD_CHOICES = ("env", "tcp")
DATASET_CHOICES = ("auto", "mnist", "sample")
PLACEMENT_CHOICES = ("PACK", "SPREAD", "STRICT_SPREAD")
PROGRESS_CHOICES = ("auto", "bar", "lines", "off")
CUDA_GRAPHS_CHOICES = ("auto", "on", "off")
#: Longest run name: a file name, with room for the ``.previous-N`` of ``--fresh``.
NAME_MAX = 200


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
    service: Optional[str] = _opt(
        None,
        "train on the warm service of this name (`raytrain-mnist service start`) instead of "
        "starting workers: the run pays for its training only; its workers, GPU and data set "
        "are the service's",
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
        check_float("resize-check-s", self.resize_check_s, positive=True)
        if self.cpus_per_worker is not None:
            check_int("cpus-per-worker", self.cpus_per_worker, 1)
        self._check_gpus_per_worker()
        check_choice("placement-strategy", self.placement_strategy, PLACEMENT_CHOICES)
        if self.service is not None:
            check_run_name(self.service, "--service", "service")

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

    # How a run executes too: the captured step is the eager step's kernels, replayed.
    cuda_graphs: str = _opt(
        "auto",
        "capture each worker's whole training step in one CUDA graph and replay it: auto = "
        "where it can be (GPUs with NCCL, one per worker, AdamW, no --compile); workers on "
        "Gloo and CPUs run eagerly (docs/gpu.md)",
        CUDA_GRAPHS_CHOICES,
    )

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            raise ConfigError(f"--compile is on or off (true or false), got {self.compile!r}")
        check_choice("backend", self.backend, BACKEND_CHOICES)
        check_choice("init-method", self.init_method, INIT_METHOD_CHOICES)
        check_choice("cuda-graphs", self.cuda_graphs, CUDA_GRAPHS_CHOICES)
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
        check_choice("dataset", self.dataset, DATASET_CHOICES)
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
        check_int("keep-checkpoints", self.keep_checkpoints, 1)


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
        check_choice("progress", self.progress, PROGRESS_CHOICES)
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
        "num_workers",
        "resize_check_s",
        "progress",
        "use_gpu",
        "gpus_per_worker",
        "cpus_per_worker",
        "backend",
        "init_method",
        "dataset",
        "data_dir",
        "storage_path",
        "name",
        "fresh",
        "address",
        "service",
        "max_failures",
        "max_preemptions",
        "keep_checkpoints",
        "placement_strategy",
        "no_tensorboard",
        "mlflow",
        "mlflow_uri",
        "socket_ifname",
        "compile",
        "cuda_graphs",
    )

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
            section = section_of(f)
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


#: A run name: one path segment that means the same on every storage (a local directory, an
#: S3 key, a URI): ASCII letters, digits, '.', '_' and '-', never first '.' or '-'. Nothing a
#: URI gives a meaning to ('?', '#', '%', '/', '\\'), no blanks, no control characters.
RUN_NAME_RULE = "letters, digits, '.', '_' and '-', not starting with '.' or '-'"
_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*", re.ASCII)


def check_run_name(name: str, flag: str = "--name", kind: str = "run") -> None:
    """Refuse a run name (or a service's, ``kind``) that is not a safe path segment on every
    storage (:data:`RUN_NAME_RULE`, at most :data:`NAME_MAX` characters)."""
    if not isinstance(name, str) or len(name) > NAME_MAX or not _RUN_NAME.fullmatch(name):
        shown = repr(name if not isinstance(name, str) or len(name) <= 60 else name[:60] + "...")
        raise ConfigError(
            f"{flag} {shown} is not a valid {kind} name: use {RUN_NAME_RULE} "
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
