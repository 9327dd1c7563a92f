"""What one worker trains with (:class:`Training`) and the one constructor of it,
:func:`prepare_training`: the worker's loop calls it with Ray's DDP and sampler wrappers
(the defaults, imported when they are used), the tests and benchmarks with their own
(none, or torchrun's), so they all train the very object a worker trains, in any process."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from raytrain_mnist.config import TrainConfig, graph_blocker
from raytrain_mnist.data import MnistData
from raytrain_mnist.nn.model import ConvNet
from raytrain_mnist.nn.optim import StepRecipe, amp_context, build_optimizer, grad_scaler
from raytrain_mnist.nn.score import evaluate
from raytrain_mnist.toolchain import check_compiler
from raytrain_mnist.worker.batches import make_train_loader
from raytrain_mnist.worker.graphs import CAPTURE, EAGER, side_stream
from raytrain_mnist.worker.resume import EpochStart
from raytrain_mnist.worker.step import DeviceSteps, LoaderSteps, Step, run_epoch

_NO_CONTEXT = contextlib.nullcontext()
#: A :func:`prepare_training` step mode: the DataLoader's batches (the CPU's path).
LOADER = "loader"


@dataclasses.dataclass
class Training:
    """What one worker trains with: built by :func:`prepare_training` at every worker-group
    start, loaded by :func:`~.resume.restore`, saved by :func:`~.resume.checkpoint_state`."""

    model: nn.Module  # what the optimizer steps: DDP-wrapped when the world size is > 1
    module: nn.Module  # the plain ConvNet inside it: evaluated and saved
    loader: DataLoader  # this rank's share of every global batch
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    autocast: contextlib.AbstractContextManager
    device: torch.device
    steps: LoaderSteps | DeviceSteps  # this rank's epochs (on CUDA: batches made there)
    sync_bn: bool = False
    recipe: StepRecipe = StepRecipe()  # the images' shifts, the loss's label smoothing
    compiled: bool = False  # the module is torch.compiled (training steps only)

    def train_one_epoch(self, on_step=None, start: EpochStart | None = None) -> dict[str, float]:
        """One epoch of this rank's steps: :func:`~.step.run_epoch`."""
        return run_epoch(self.steps, on_step, start)

    @property
    def captured(self) -> bool:
        """The whole step is one CUDA graph (:mod:`.graphs`), replayed every step."""
        return self.steps.captured

    def evaluate(
        self, images: torch.Tensor, labels: torch.Tensor, rank: int, world_size: int
    ) -> dict[str, float]:
        """:func:`evaluate` of the plain module: this rank's shard, the sums all-reduced.
        Eager even when compiled: an eval-mode graph would compile again (seconds) to score
        ten batches (benchmarks/README.md)."""
        eager = torch.compiler.set_stance("force_eager") if self.compiled else _NO_CONTEXT
        with eager:
            return evaluate(
                self.module, images, labels, self.device, self.autocast, rank, world_size
            )

    @property
    def lr(self) -> float:
        """The learning rate the schedule has reached (a captured step's, read from the
        device: once an epoch)."""
        return float(self.scheduler.get_last_lr()[0])


def prepare_training(
    cfg: TrainConfig,
    data: MnistData,
    device: torch.device,
    world_size: int = 1,
    compile: bool = False,
    cuda_graphs: str = "auto",
    *,
    prepare_model: Callable[[nn.Module], nn.Module] | None = None,
    prepare_data_loader: Callable[[DataLoader], DataLoader] | None = None,
    capture: bool | None = None,
    step_mode: str | None = None,
) -> Training:
    """The model on ``device`` (wrapped by ``prepare_model``: DDP when ``world_size`` > 1),
    this rank's loader (``prepare_data_loader``: its sampler), the optimizer and schedule,
    the scaler, the autocast context and the steps: freshly initialised, the same on every
    rank. The wrappers default to Ray Train's; :func:`as_is` is none (one process).

    With ``compile`` the ConvNet is compiled in place before DDP wraps it (PyTorch's advice
    for DDP): its state_dict keeps the eager names, so checkpoints are the same. On CUDA
    the step is captured in one CUDA graph unless ``cuda_graphs`` (RunSettings.torch's) is
    "off" or :func:`~raytrain_mnist.config.graph_blocker` says why it cannot be; tests
    choose: ``capture`` (the optimizer and schedule built for it) and ``step_mode``
    (:data:`LOADER`, or device steps :data:`~.graphs.EAGER` / ``CAPTURE``, on any device)."""
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    sync_bn = use_sync_bn(cfg.sync_bn, device, world_size)
    module = build_model(sync_bn).to(device)
    if compile:
        check_compiler(device.type == "cuda")  # a cluster's worker may lack one
        module.compile()  # lazily: the first forward compiles
    if capture is None:
        blocked = graph_blocker(cfg.optimizer, device.type == "cuda", backend(), compile)
        capture = cuda_graphs != "off" and blocked is None
    prepare_model, prepare_data_loader = _wrappers(prepare_model, prepare_data_loader)
    # A captured DDP is built on a side stream, as its warm-up runs (PyTorch's rule).
    with side_stream(device) if capture else _NO_CONTEXT:
        model = prepare_model(module)
    # The global batch: each step takes cfg.batch_size images over all ranks, whatever
    # the world size (a resize changes only the per-worker share).
    batch = cfg.batch_size // world_size
    loader = make_train_loader(data.train_images, data.train_labels, batch, cfg.seed)
    loader = prepare_data_loader(loader)  # the sampler of this rank's share and order
    optimizer, scheduler = build_optimizer(model, cfg, len(loader), captured=capture)
    scaler, autocast = grad_scaler(cfg.amp, device), amp_context(cfg.amp, device)
    step = Step(model, module, optimizer, scheduler, scaler, autocast, StepRecipe.of(cfg))
    return Training(
        model=model,
        module=module,
        loader=loader,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        autocast=autocast,
        device=device,
        steps=_steps(step, loader, data, device, capture, step_mode),
        sync_bn=sync_bn,
        recipe=step.recipe,
        compiled=compile,
    )


def _steps(step, loader, data: MnistData, device: torch.device, capture: bool, mode: str | None):
    if mode is None:  # the device's choice
        mode = (CAPTURE if capture else EAGER) if device.type == "cuda" else LOADER
    if mode == LOADER:
        return LoaderSteps(step, loader, device)
    # The batches made from the data on its device: no host in the step.
    return DeviceSteps(step, loader, data.train_images, data.train_labels, mode)


def as_is(thing):
    """No wrapper: a model or loader of one process without Ray, for :func:`prepare_training`."""
    return thing


def _wrappers(prepare_model, prepare_data_loader):
    """The wrappers given, Ray Train's where none is (imported here: only a Ray Train
    worker calls them; ray.train.torch is not imported until then)."""
    if prepare_model is None or prepare_data_loader is None:
        import ray.train.torch

        def ray_loader(loader: DataLoader) -> DataLoader:
            # Batches come from the data's device: nothing for Ray to move.
            return ray.train.torch.prepare_data_loader(loader, move_to_device=False)

        prepare_model = prepare_model or ray.train.torch.prepare_model
        prepare_data_loader = prepare_data_loader or ray_loader
    return prepare_model, prepare_data_loader


def use_sync_bn(setting: str, device: torch.device, world_size: int) -> bool:
    """SyncBatchNorm pays off only across GPUs; PyTorch refuses it on CPU."""
    if setting == "auto":
        return device.type == "cuda" and world_size > 1
    return setting == "on"


def build_model(sync_bn: bool) -> nn.Module:
    """The ConvNet, its BatchNorms made SyncBatchNorms when asked: same parameters and
    buffers under the same names, so checkpoints load into a plain :class:`ConvNet`."""
    model = ConvNet()
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync_bn else model


def backend() -> str | None:
    """The process group's backend; None without one (one process, no Ray)."""
    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None
