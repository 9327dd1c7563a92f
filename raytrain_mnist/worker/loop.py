"""The per-worker training loop: the only code that calls ``ray.train``.

``train_func_per_worker`` runs in every Ray Train worker. It is plain PyTorch around four
Ray calls: ``get_checkpoint`` (resume), ``prepare_model`` (DDP), ``prepare_data_loader``
(the DistributedSampler) and ``report`` (metrics + checkpoint, every epoch). The data lives
where the model lives: on a GPU, the uint8 tensors are moved there once and every batch is
gathered there. ``train_step``, ``train_one_epoch`` and ``evaluate`` take objects, not
globals, and work without Ray.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import sys
import tempfile
import time
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raytrain_mnist import compat
from raytrain_mnist.config import TrainConfig
from raytrain_mnist.data import MnistData
from raytrain_mnist.model import ConvNet, normalize
from raytrain_mnist.worker import checkpoint as ckpt
from raytrain_mnist.worker.optim import amp_context, build_optimizer, grad_scaler
from raytrain_mnist.worker.score import all_reduce_sum, evaluate

logger = logging.getLogger(__name__)


class BatchedTensorDataset(TensorDataset):
    """A TensorDataset that serves a whole batch with one gather per tensor.

    DataLoader calls ``__getitems__`` with the batch's indices when it exists; the default
    path indexes each sample and stacks them again, which costs more than the model on CPU.
    Pair it with ``collate_fn=tuple``. Tensors on a GPU are gathered there: only the indices
    travel.
    """

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        index = torch.as_tensor(indices)
        device = self.tensors[0].device
        if device.type == "cuda":
            # From pageable memory a copy waits for the GPU to drain its queue; from pinned
            # memory it is queued behind the previous step, and the host runs ahead.
            index = index.pin_memory().to(device, non_blocking=True)
        return [t[index] for t in self.tensors]


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


def make_train_loader(
    images: torch.Tensor, labels: torch.Tensor, batch_size: int, seed: int
) -> DataLoader:
    """A shuffled loader over in-memory uint8 tensors (on the CPU or a GPU); one batch is one
    gather, on the tensors' device. The order depends on the seed only, not the device."""
    return DataLoader(
        BatchedTensorDataset(images, labels),
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,  # every rank runs the same number of steps (DDP needs that)
        collate_fn=tuple,
        generator=torch.Generator().manual_seed(seed),
    )


def set_epoch(loader: DataLoader, epoch: int, seed: int) -> None:
    """Make epoch ``epoch``'s order a function of (seed, epoch), so a resumed run sees the
    same order as an uninterrupted one."""
    if hasattr(loader.sampler, "set_epoch"):  # DistributedSampler, when world size > 1
        loader.sampler.seed = seed  # Ray builds it with seed 0; ours decides the order
        loader.sampler.set_epoch(epoch)
    else:
        loader.generator.manual_seed(seed + epoch)


def train_step(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler: torch.amp.GradScaler,
    autocast,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on one batch of uint8 ``images``; returns the (detached) loss and
    logits, in the precision autocast gave them.

    With fp16 the scaler multiplies the loss before backward; when any gradient comes out
    inf or NaN, ``scaler.step`` skips the optimizer step and ``scaler.update`` lowers the
    scale, so an overflow costs one batch instead of poisoning the weights.
    """
    with autocast:
        logits = model(normalize(images))
        loss = F.cross_entropy(logits, labels)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()  # DDP all-reduces gradients during backward
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    return loss.detach(), logits.detach()


def train_one_epoch(
    model: nn.Module,
    loader,
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler: torch.amp.GradScaler,
    autocast,
    device: torch.device,
    on_step=None,
) -> dict[str, float]:
    """One pass over ``loader``; returns loss and accuracy over every rank's samples, the
    steps taken, the CPU seconds (user + system) all ranks' processes spent on them, and
    when the first step had finished (unix time). ``on_step(steps, sums)`` is called after
    every step with this rank's running (loss sum, correct, count) on the device."""
    model.train()
    cpu_started = time.process_time()
    # Running sums stay on the device: reading them (.item()) would sync every step.
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
    steps, first_step_at = 0, None
    for images, labels in loader:
        loss, logits = train_step(model, images, labels, optimizer, scheduler, scaler, autocast)
        n = labels.numel()
        sums[0] += loss.double() * n
        sums[1] += (logits.argmax(1) == labels).sum()
        sums[2] += n  # a Python number: no host-to-device copy
        steps += 1
        if first_step_at is None:  # once per epoch: start-up ends at the first real step
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_step_at = time.time()
        if on_step is not None:
            on_step(steps, sums)
    cpu = torch.tensor([time.process_time() - cpu_started], dtype=torch.float64, device=device)
    loss_sum, correct, count, cpu_s = all_reduce_sum(torch.cat([sums, cpu])).tolist()
    return {
        "train_loss": loss_sum / count,
        "train_accuracy": correct / count,
        "train_images": int(count),
        "train_steps": steps,
        "cpu_s": cpu_s,
        "first_step_at": first_step_at,
    }


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


def _worker_placement(device: torch.device) -> list[dict[str, Any]]:
    """Where every rank runs, gathered once so rank 0 can report it."""
    ctx = ray.train.get_context()
    me = {
        "rank": ctx.get_world_rank(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "device": str(device),
        "backend": _backend(),
    }
    if device.type == "cuda":
        me["gpu"] = torch.cuda.get_device_name(device)
    if ctx.get_world_size() == 1:
        return [me]
    everyone: list[Any] = [None] * ctx.get_world_size()
    dist.all_gather_object(everyone, me)
    return everyone


class ProgressFeed:
    """Rank 0's stream to the driver: small dicts sent fire-and-forget to ``actor`` (its
    ``put``), at most one step update every ``every_s`` seconds so the feed costs nothing
    measurable. Without an actor (Tune trials, other ranks) every call is a no-op."""

    def __init__(self, actor, batch_size: int, steps_per_epoch: int, every_s: float = 0.5) -> None:
        self.actor, self.every_s = actor, every_s
        self.batch_size, self.steps_per_epoch = batch_size, steps_per_epoch
        self._last = float("-inf")
        self._epoch_started = 0.0
        self._first_step_sent = False

    def send(self, kind: str, **item) -> None:
        if self.actor is not None:
            self.actor.put.remote({"progress": kind, "at": time.time(), **item})

    def epoch_start(self, epoch: int) -> None:
        self._epoch, self._epoch_started = epoch, time.perf_counter()

    def step(self, steps: int, sums: torch.Tensor) -> None:
        if self.actor is None:
            return
        if not self._first_step_sent:
            self._first_step_sent = True
            self.send("first_step")
        now = time.perf_counter()
        if now - self._last < self.every_s and steps < self.steps_per_epoch:
            return
        self._last = now
        loss_sum, _, count = sums.tolist()  # one read of the device a few times a second
        self.send(
            "step",
            epoch=self._epoch,
            images=steps * self.batch_size,
            total=self.steps_per_epoch * self.batch_size,
            seconds=now - self._epoch_started,
            loss=loss_sum / max(count, 1),
        )


def train_func_per_worker(config: dict[str, Any]) -> None:
    """Ray Train's entry point. ``config``: ``train`` (TrainConfig as a dict), ``data``
    (ObjectRef of :class:`MnistData`), ``cpus_per_worker`` (its torch threads), and
    optionally ``progress`` (an actor whose ``put`` takes rank 0's progress dicts)."""
    started_at = time.time()  # tells the driver which worker-group start a report came from
    cfg = TrainConfig.from_dict(config["train"])
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    # Rank 0 talks; the others only warn. (Ray has already configured the root logger.)
    logging.getLogger("raytrain_mnist").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    compat.quiet_train_report_log()
    keep_freed_memory()
    torch.set_num_threads(config["cpus_per_worker"])
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: the fastest kernels, found once
    # The object store, not a download per worker; then onto the GPU, once.
    data: MnistData = to_device(ray.get(config["data"]), device)

    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    sync_bn = use_sync_bn(cfg.sync_bn, device, world_size)
    model = build_model(sync_bn)

    state = None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = ckpt.load(directory)
        model.load_state_dict(state["model"])
    model = ray.train.torch.prepare_model(model)  # DDP when world_size > 1
    module = getattr(model, "module", model)  # the plain ConvNet, for eval and saving

    loader = make_train_loader(
        data.train_images, data.train_labels, cfg.batch_size // world_size, cfg.seed
    )
    # Ray's sampler and order; batches come from the data's device, so nothing to move.
    loader = ray.train.torch.prepare_data_loader(loader, move_to_device=False)
    optimizer, scheduler = build_optimizer(model, cfg, len(loader))
    scaler = grad_scaler(cfg.amp, device)
    autocast = amp_context(cfg.amp, device)

    start_epoch, history, best = 0, [], 0.0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"])
        start_epoch, history, best = state["epoch"], state["history"], state["best_val_accuracy"]
        if rank == 0:
            logger.info("resumed from the checkpoint of epoch %d", start_epoch)
    placement = _worker_placement(device)
    if rank == 0:
        logger.info(
            "%d worker(s) on %s, process group %s, SyncBatchNorm %s, AMP %s",
            world_size,
            device.type,
            _backend() or "none",
            "on" if sync_bn else "off",
            cfg.amp,
        )
    # The global batch: each step takes cfg.batch_size images over all ranks, whatever
    # the world size (a resize changes only the per-worker share).
    feed = ProgressFeed(config.get("progress") if rank == 0 else None, cfg.batch_size, len(loader))
    feed.send(
        "ready",
        world_size=world_size,
        started_at=started_at,
        resumed_from_epoch=None if state is None else state["epoch"],
        device=device.type,
        backend=_backend(),
    )

    for epoch in range(start_epoch, cfg.epochs):
        set_epoch(loader, epoch, cfg.seed)
        started = time.perf_counter()
        feed.epoch_start(epoch + 1)
        train = train_one_epoch(
            model,
            loader,
            optimizer,
            scheduler,
            scaler,
            autocast,
            device,
            on_step=feed.step if feed.actor is not None else None,
        )
        train_s = time.perf_counter() - started
        # DDP syncs BatchNorm buffers from rank 0 at the start of each forward, so after the
        # last step every rank holds its own running stats: evaluate rank 0's, the saved ones.
        broadcast_buffers(module)
        val = evaluate(
            module, data.test_images, data.test_labels, device, autocast, rank, world_size
        )
        best = max(best, val["val_accuracy"])
        history.append(
            {
                "epoch": epoch + 1,
                "train_loss": train["train_loss"],
                "train_accuracy": train["train_accuracy"],
                "val_loss": val["val_loss"],
                "val_accuracy": val["val_accuracy"],
                "images_per_s": train["train_images"] / train_s,
                "lr": optimizer.param_groups[0]["lr"],
                "epoch_time_s": time.perf_counter() - started,
                "train_s": train_s,
                "cpu_s_per_step": train["cpu_s"] / max(train["train_steps"], 1),
                # Unix times, for the benchmark's start-up and time-to-accuracy end points.
                "first_step_at": train["first_step_at"],
                "evaluated_at": time.time(),
                "world_size": world_size,  # an elastic run's size can change between epochs
            }
        )
        metrics = {
            **history[-1],
            "val_total": val["val_total"],
            "best_val_accuracy": best,
            "resumed_from_epoch": None if state is None else state["epoch"],
            "started_at": started_at,
            "workers": placement,
        }  # per epoch only: the driver builds the history
        # Rank 0 writes the checkpoint; every rank reports (report is a barrier).
        with tempfile.TemporaryDirectory() as directory:
            report_checkpoint = None
            if rank == 0:
                ckpt.save(
                    directory,
                    {
                        "model": module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict(),
                        "epoch": epoch + 1,
                        "best_val_accuracy": best,
                        "history": history,
                        "config": cfg.to_dict(),
                        "rng": ckpt.rng_state(),
                    },
                )
                report_checkpoint = ray.train.Checkpoint.from_directory(directory)
            ray.train.report(metrics, checkpoint=report_checkpoint)
