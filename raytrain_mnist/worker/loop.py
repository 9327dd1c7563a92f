"""The per-worker training loop of ``fit`` and ``tune``, run by every Ray Train worker.

``train_func_per_worker`` reads like Ray's own example loop: set the worker up, get the
checkpoint, prepare the model and the loader, then for each epoch train, evaluate, report.
Each of those is a named helper below it. The loop is plain PyTorch around five Ray calls:
``get_checkpoint`` (resume, from an epoch's end or mid-epoch: :mod:`.resume`),
``prepare_model`` (DDP), ``prepare_data_loader`` (the DistributedSampler), ``report``
(metrics + checkpoint, every epoch) and ``get_preemption_info`` (a just-in-time checkpoint
when a node is preempted: :mod:`.preempt`). The data lives where the model lives: on a GPU,
the uint8 tensors are moved there once, every batch is made there from the loader's order
(:mod:`.batches`), and where the run can (NCCL or one worker, AdamW) the whole step
(:mod:`.step`) is one CUDA graph (:mod:`.graphs`). ``train_step``, ``train_one_epoch`` and
``evaluate`` take objects, not globals, and work without Ray. Rank 0's progress stream to
the driver is :mod:`.feed`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import math
import os
import sys
import time
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from raytrain_mnist import compat
from raytrain_mnist.config import TrainConfig, graph_blocker
from raytrain_mnist.data import MnistData
from raytrain_mnist.nn.model import ConvNet
from raytrain_mnist.nn.optim import StepRecipe, amp_context, build_optimizer, grad_scaler
from raytrain_mnist.nn.score import all_reduce_sum, evaluate
from raytrain_mnist.toolchain import check_compiler
from raytrain_mnist.worker.batches import BatchedTensorDataset as BatchedTensorDataset
from raytrain_mnist.worker.batches import epoch_batches, make_train_loader, set_epoch
from raytrain_mnist.worker.endpoll import EndPoll
from raytrain_mnist.worker.feed import ProgressFeed
from raytrain_mnist.worker.graphs import CAPTURE, EAGER, side_stream
from raytrain_mnist.worker.preempt import JustInTime
from raytrain_mnist.worker.resume import (
    Done,
    EpochStart,
    checkpoint_state,
    jit_saver,
    report_epoch,
    restore,
    resume_point,
    resume_state,
)
from raytrain_mnist.worker.step import DeviceSteps, accumulate, set_up_cudnn, train_step

logger = logging.getLogger(__name__)
_NO_CONTEXT = contextlib.nullcontext()


def keep_freed_memory() -> bool:
    """Stop glibc from handing freed tensor memory back to the OS after every step.

    PyTorch's CPU allocator is plain ``malloc``. By default glibc trims its heap once the
    free top exceeds twice the largest recently freed block, and deletes a thread arena's
    64 MiB heap as soon as it is empty (Ray Train runs the loop off the main thread), so each
    step's activations go back to the OS when backward frees them and are page-faulted back,
    zero-filled, by the next forward, every step (figures: benchmarks/README.md). A fixed
    mmap threshold (32 MiB, glibc's cap), a high trim threshold and a top pad larger than a
    thread heap keep the memory; blocks above 32 MiB are still mapped and unmapped.
    Process-wide; call it in a process that trains. Returns False where the C library has no
    effective ``mallopt``.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # a C library without mallopt
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # <malloc.h>
    applied = [
        mallopt(param, value)
        for param, value in (
            (m_mmap_threshold, 32 << 20),
            (m_trim_threshold, 512 << 20),
            (m_top_pad, 64 << 20),
        )
    ]
    return all(applied)  # musl's mallopt exists and returns 0: nothing changed


def train_one_epoch(
    model: nn.Module,
    loader,
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler: torch.amp.GradScaler,
    autocast,
    device: torch.device,
    on_step=None,
    recipe: StepRecipe = StepRecipe(),
    start: EpochStart | None = None,
) -> dict[str, float]:
    """One pass over ``loader`` (from ``start``, when it resumes mid-epoch); returns loss
    and accuracy over every rank's samples, the epoch's steps (``skipped_steps`` of them
    done before ``start``), the CPU seconds (user + system) all ranks' processes spent on
    them, and when the first step had finished (unix time). ``on_step(steps, sums)`` is
    called after every step with the epoch's steps done and this rank's running (loss sum,
    correct, count) on the device. ``loader`` is a DataLoader, or on CUDA a rank's
    :class:`DeviceSteps`: the loader's order, the batches and the step (maybe captured)
    made on the device; the step's parts are then its own."""
    model.train()
    cpu_started = time.process_time()
    carried = start.sums if start is not None and start.sums is not None else [0.0] * 4
    if isinstance(loader, DeviceSteps):
        sums, trained = loader.sums.zero_(), loader.epoch(start)
    else:
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
        trained = _loader_steps(
            model, loader, optimizer, scheduler, scaler, autocast, recipe, start, sums
        )
    sums += torch.tensor(carried[:3], dtype=torch.float64, device=device)
    skipped = steps = 0 if start is None else start.step
    first_step_at = None
    for _ in trained:
        steps += 1
        if first_step_at is None:  # once per epoch: start-up ends at the first real step
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_step_at = time.time()
        if on_step is not None:
            on_step(steps, sums)
    cpu = time.process_time() - cpu_started + carried[3]
    cpu_t = torch.tensor([cpu], dtype=torch.float64, device=device)
    loss_sum, correct, count, cpu_s = all_reduce_sum(torch.cat([sums, cpu_t])).tolist()
    return {
        "train_loss": loss_sum / count,
        "train_accuracy": correct / count,
        "train_images": int(count),
        "train_steps": steps,
        "skipped_steps": skipped,
        "cpu_s": cpu_s,
        "first_step_at": first_step_at,
    }


def _loader_steps(model, loader, optimizer, scheduler, scaler, autocast, recipe, start, sums):
    """The epoch's steps on the loader's batches (from ``start``): one per iteration."""
    for images, labels in epoch_batches(loader, start):
        loss, logits = train_step(
            model, images, labels, optimizer, scheduler, scaler, autocast, recipe
        )
        accumulate(sums, loss, logits, labels)
        yield


def broadcast_buffers(module: nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


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


def to_device(data: MnistData, device: torch.device) -> MnistData:
    """The data set on ``device``, moved once (a no-op on the CPU): batches are then gathered
    and normalised where the model is, with no host-to-device copy per step."""
    if device.type == "cpu":
        return data
    return dataclasses.replace(
        data,
        **{
            name: getattr(data, name).to(device)
            for name in ("train_images", "train_labels", "test_images", "test_labels")
        },
    )


def _backend() -> str | None:
    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None


def _worker_placement(
    device: torch.device, compiled: bool = False, captured: bool = False
) -> list[dict[str, Any]]:
    """Where and how every rank runs, gathered once so rank 0 can report it."""
    ctx = ray.train.get_context()
    me = {
        "rank": ctx.get_world_rank(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "device": str(device),
        "backend": _backend(),
        "compiled": compiled,
        "step": "captured" if captured else "eager",  # one CUDA graph, or kernel by kernel
    }
    if device.type == "cuda":
        me["gpu"] = torch.cuda.get_device_name(device)
    if ctx.get_world_size() == 1:
        return [me]
    everyone: list[Any] = [None] * ctx.get_world_size()
    dist.all_gather_object(everyone, me)
    return everyone


# --------------------------------------------------------------------------- one worker's run


@dataclasses.dataclass
class Training:
    """What one worker trains with: built by :func:`prepare_training` at every worker-group
    start, loaded by :func:`restore`, saved by :func:`checkpoint_state`."""

    model: nn.Module  # what the optimizer steps: DDP-wrapped when the world size is > 1
    module: nn.Module  # the plain ConvNet inside it: evaluated and saved
    loader: DataLoader  # this rank's share of every global batch
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    autocast: contextlib.AbstractContextManager
    device: torch.device
    sync_bn: bool
    recipe: StepRecipe = StepRecipe()  # the images' shifts, the loss's label smoothing
    compiled: bool = False  # the module is torch.compiled (training steps only)
    device_steps: DeviceSteps | None = None  # on CUDA: batches made there, the step maybe captured

    def train_one_epoch(self, on_step=None, start: EpochStart | None = None) -> dict[str, float]:
        """:func:`train_one_epoch` over this rank's loader (its device steps, on CUDA)."""
        return train_one_epoch(
            self.model,
            self.device_steps or self.loader,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.autocast,
            self.device,
            on_step,
            self.recipe,
            start,
        )

    @property
    def captured(self) -> bool:
        """The whole step is one CUDA graph (:mod:`.graphs`), replayed every step."""
        return self.device_steps is not None and self.device_steps.run.captured

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


def set_up_worker(rank: int, cpus_per_worker: int) -> torch.device:
    """Make this process ready to train; returns the device Ray gave it."""
    # Rank 0 talks; the others only warn. (Ray has already configured the root logger.)
    logging.getLogger("raytrain_mnist").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    compat.quiet_train_report_log()
    keep_freed_memory()
    torch.set_num_threads(cpus_per_worker)
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        set_up_cudnn()
    return device


def prepare_training(
    cfg: TrainConfig,
    data: MnistData,
    device: torch.device,
    world_size: int,
    compile=False,
    cuda_graphs: str = "auto",
) -> Training:
    """The model (DDP when ``world_size`` > 1), this rank's loader, the optimizer and its
    schedule, the scaler and the autocast context: freshly initialised, the same on every
    rank. With ``compile`` the ConvNet is compiled in place before DDP wraps it (PyTorch's
    advice for DDP): its state_dict keeps the eager names, so checkpoints are the same.
    ``cuda_graphs`` (RunSettings.torch.cuda_graphs): on CUDA the step is captured in one
    CUDA graph unless it is "off" or :func:`~raytrain_mnist.config.graph_blocker` says why
    it cannot be."""
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    sync_bn = use_sync_bn(cfg.sync_bn, device, world_size)
    module = build_model(sync_bn)
    if compile:
        check_compiler(device.type == "cuda")  # a cluster's worker may lack one
        module.compile()  # lazily: the first forward compiles
    blocked = graph_blocker(cfg.optimizer, device.type == "cuda", _backend(), compile)
    captured = cuda_graphs != "off" and blocked is None
    # A captured DDP is built on a side stream, as its warm-up runs (PyTorch's rule).
    with side_stream(device) if captured else _NO_CONTEXT:
        model = ray.train.torch.prepare_model(module)
    # The global batch: each step takes cfg.batch_size images over all ranks, whatever
    # the world size (a resize changes only the per-worker share).
    loader = make_train_loader(
        data.train_images, data.train_labels, cfg.batch_size // world_size, cfg.seed
    )
    # Ray's sampler and order; batches come from the data's device, so nothing to move.
    loader = ray.train.torch.prepare_data_loader(loader, move_to_device=False)
    return assemble_training(cfg, model, loader, data, device, sync_bn, compile, captured)


def assemble_training(
    cfg: TrainConfig,
    model: nn.Module,
    loader: DataLoader,
    data: MnistData,
    device: torch.device,
    sync_bn: bool = False,
    compiled: bool = False,
    captured: bool = False,
) -> Training:
    """The rest of :func:`prepare_training`, Ray's part done (``model`` on ``device``, DDP
    or not; ``loader`` this rank's): the optimizer and schedule, the scaler, the autocast
    context; on CUDA (``data`` there) the batches made on the device and the step, captured
    in one CUDA graph when ``captured``."""
    optimizer, scheduler = build_optimizer(model, cfg, len(loader), captured=captured)
    training = Training(
        model=model,
        module=getattr(model, "module", model),
        loader=loader,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=grad_scaler(cfg.amp, device),
        autocast=amp_context(cfg.amp, device),
        device=device,
        sync_bn=sync_bn,
        recipe=StepRecipe.of(cfg),
        compiled=compiled,
    )
    if device.type == "cuda":
        mode = CAPTURE if captured else EAGER
        training.device_steps = DeviceSteps(training, data.train_images, data.train_labels, mode)
    return training


def epoch_record(
    epoch: int,
    train: dict[str, float],
    val: dict[str, float],
    started: float,
    train_s: float,
    lr: float,
    world_size: int,
) -> dict[str, Any]:
    """One epoch's entry in the history: ``train`` from :func:`train_one_epoch`, ``val`` from
    :func:`evaluate`, the epoch having begun at ``started`` (``time.perf_counter()``) and
    spent ``train_s`` seconds training."""
    return {
        "epoch": epoch,
        "train_loss": train["train_loss"],
        "train_accuracy": train["train_accuracy"],
        "val_loss": val["val_loss"],
        "val_accuracy": val["val_accuracy"],
        # What this worker group trained: a resumed epoch's skipped steps took no time here.
        "images_per_s": train["train_images"] * _share_trained(train) / train_s,
        "lr": lr,
        "epoch_time_s": time.perf_counter() - started,
        "train_s": train_s,
        "cpu_s_per_step": train["cpu_s"] / max(train["train_steps"], 1),
        # Unix times, for the benchmark's start-up and time-to-accuracy end points.
        "first_step_at": train["first_step_at"],
        "evaluated_at": time.time(),
        "world_size": world_size,  # an elastic run's size can change between epochs
        # Rank 0's preemption checks (worker/preempt.py): what the barrier costs.
        "preemption_checks": train.get("preemption_checks", 0),
        "preemption_check_s": train.get("preemption_check_s", 0.0),
    }


def _share_trained(train: dict[str, Any]) -> float:
    steps = max(train["train_steps"], 1)
    return (steps - train.get("skipped_steps", 0)) / steps


def _both(*hooks):
    """One per-step callback calling each hook that is not None (None when none is)."""
    live = [h for h in hooks if h is not None]
    if len(live) < 2:
        return live[0] if live else None
    return lambda steps, sums: [h(steps, sums) for h in live]


def train_func_per_worker(config: dict[str, Any]) -> None:
    """Ray Train's entry point. ``config``: ``train`` (TrainConfig as a dict), ``data``
    (ObjectRef of :class:`MnistData`), ``cpus_per_worker`` (its torch threads), and
    optionally ``progress`` (an actor whose ``put`` takes rank 0's progress dicts),
    ``compile`` and ``cuda_graphs`` (RunSettings.torch's)."""
    started_at = time.time()  # tells the driver which worker-group start a report came from
    worker = WorkerSetup.start(config["cpus_per_worker"], started_at)
    # The object store, not a download per worker; then onto the GPU, once.
    data: MnistData = to_device(ray.get(config["data"]), worker.device)
    train_run(
        TrainConfig.from_dict(config["train"]),
        data,
        worker,
        resume_state(),
        progress=config.get("progress"),
        compile=config.get("compile", False),
        cuda_graphs=config.get("cuda_graphs", "auto"),
    )


@dataclasses.dataclass(frozen=True)
class WorkerSetup:
    """What a worker-group start sets up once, for every run it trains (one for ``fit``,
    one per request for a service: :mod:`.service`)."""

    rank: int
    world_size: int
    device: torch.device
    started_at: float  # unix time the train function began: names this worker-group start

    @classmethod
    def start(cls, cpus_per_worker: int, started_at: float) -> WorkerSetup:
        ctx = ray.train.get_context()
        rank = ctx.get_world_rank()
        device = set_up_worker(rank, cpus_per_worker)
        return cls(rank, ctx.get_world_size(), device, started_at)


def train_run(
    cfg: TrainConfig,
    data: MnistData,
    worker: WorkerSetup,
    state: dict[str, Any] | None,
    progress=None,
    compile: bool = False,
    tags: dict[str, Any] | None = None,
    on_step=None,
    finite: bool = False,
    cuda_graphs: str = "auto",
) -> Done:
    """Train ``cfg`` from a fresh model (or the checkpoint ``state``) to its last epoch,
    reporting every epoch: the body of :func:`train_func_per_worker`. ``progress``: rank
    0's stream (:class:`~.feed.ProgressFeed`'s actor); ``tags``: added to every report (a
    service's request id); ``on_step(steps, sums)``: called after every step on every rank
    (a service's cancel check); ``finite``: a NaN or infinite loss ends the run
    (:class:`Diverged`) instead of being reported. Returns what was trained."""
    rank, world_size, device = worker.rank, worker.world_size, worker.device
    training = prepare_training(cfg, data, device, world_size, compile, cuda_graphs)
    prepared_at = time.time()  # the driver's start-up timeline: "model prepared"
    done = Done() if state is None else Done(*restore(training, state))
    start, resumed = resume_point(state, rank)
    placement = _worker_placement(device, training.compiled, training.captured)
    if rank == 0:
        _log_start(training, cfg, device, world_size, resumed)
    feed = ProgressFeed(progress if rank == 0 else None, cfg.batch_size, len(training.loader))
    feed.ready(world_size, worker.started_at, device=device.type, backend=_backend(),
               prepared_at=prepared_at, **resumed)  # fmt: skip
    keys = {"started_at": worker.started_at, "world_size": world_size, "tags": tags or {}}
    save = jit_saver(training, cfg, done, keys, rank)
    send = functools.partial(feed.send, steps_per_epoch=len(training.loader))
    jit = JustInTime(rank, world_size, save, ray.train.get_preemption_info, send, device=device)
    end = EndPoll(len(training.loader)) if rank == 0 else None
    step_hooks = _both(feed.on_step, jit.on_step, end and end.on_step, on_step)
    for epoch in range(done.epoch, cfg.epochs):
        set_epoch(training.loader, epoch, cfg.seed)
        if end is not None:
            end.epoch_start(epochs_after=cfg.epochs - epoch - 1)
        jit.epoch, save.cpu_started[0] = epoch, time.process_time()
        keys["carried_cpu_s"] = start.sums[3] if start is not None and start.sums else 0.0
        started = time.perf_counter()
        feed.epoch_start(epoch + 1)
        train = training.train_one_epoch(on_step=step_hooks, start=start)
        start = None
        train_s = time.perf_counter() - started
        if finite:
            check_finite(train, epoch + 1, cfg)
        run_keys = {"resumed_from_epoch": resumed["resumed_from_epoch"],
                    "started_at": worker.started_at, "workers": placement,
                    **keys["tags"]}  # fmt: skip
        train.update(jit.end_epoch())
        if end is not None and epoch + 1 == cfg.epochs:
            end.now()  # the last evaluation and report follow: if the steps had not asked
        _end_epoch(training, cfg, data, done, train, (started, train_s), rank, run_keys)
    return done


class Diverged(ValueError):
    """The training loss is not a number: the run cannot go on from here."""


def check_finite(train: dict[str, Any], epoch: int, cfg: TrainConfig) -> None:
    """Refuse to report (and checkpoint) an epoch whose loss, summed over every rank, is
    NaN or infinite: every rank sees the same sums, so every rank raises together."""
    loss = train["train_loss"]
    if not math.isfinite(loss):
        raise Diverged(
            f"training diverged: the loss of epoch {epoch} is {loss} (lr {cfg.lr:g}); "
            "lower --lr, or try --amp off"
        )


def _end_epoch(
    training: Training,
    cfg: TrainConfig,
    data: MnistData,
    done: Done,
    train: dict[str, Any],
    timing: tuple[float, float],
    rank: int,
    run_keys: dict[str, Any],
) -> None:
    """Evaluate the epoch just trained, record it in ``done``, report it (every rank) with
    its checkpoint (rank 0's). ``timing``: when the epoch began (perf_counter) and its
    training seconds; ``run_keys``: what every report says about the run."""
    # DDP syncs BatchNorm buffers from rank 0 at the start of each forward, so after the
    # last step every rank holds its own running stats: evaluate rank 0's, the saved ones.
    broadcast_buffers(training.module)
    world_size = len(run_keys["workers"])
    val = training.evaluate(data.test_images, data.test_labels, rank, world_size)
    done.epoch += 1
    done.best = max(done.best, val["val_accuracy"])
    record = epoch_record(done.epoch, train, val, *timing, training.lr, world_size)
    done.history.append(record)
    metrics = {
        **record,
        "val_total": val["val_total"],
        "best_val_accuracy": done.best,
        **run_keys,
    }  # per epoch only: the driver builds the history
    # Rank 0 writes the checkpoint; every rank reports.
    saved = None
    if rank == 0:
        saved = checkpoint_state(training, cfg, done.epoch, done.best, list(done.history))
    report_epoch(metrics, saved)


def _log_start(
    training: Training,
    cfg: TrainConfig,
    device: torch.device,
    world_size: int,
    resumed: dict[str, Any],
) -> None:
    epoch, step = resumed.get("resumed_from_epoch"), resumed.get("resumed_from_step")
    if epoch is not None and step:
        logger.info("resumed from the checkpoint at step %d of epoch %d", step, epoch + 1)
    elif epoch is not None:
        logger.info("resumed from the checkpoint of epoch %d", epoch)
    written_by = resumed.get("resumed_world_size")
    if step and written_by not in (None, world_size):
        logger.warning(
            "resumed on %d worker(s) from a checkpoint written by %d: the same steps and "
            "schedule, but this epoch's remaining batches are not the ones %d would train",
            world_size,
            written_by,
            written_by,
        )
    logger.info(
        "%d worker(s) on %s, process group %s, SyncBatchNorm %s, AMP %s, %s",
        world_size,
        device.type,
        _backend() or "none",
        "on" if training.sync_bn else "off",
        cfg.amp,
        "the step captured in one CUDA graph" if training.captured else "eager steps",
    )
