"""A rank's training steps: :func:`train_step` on one batch, and the two ways an epoch
runs it, one interface (``sums``, ``epoch(start)``) for :func:`run_epoch`:

* :class:`LoaderSteps`: the DataLoader's batches, one step each (the CPU's path);
* :class:`DeviceSteps`: on CUDA, the batches made on the device from the loader's order
  (:mod:`.batches`) and the whole step one function of tensors that stay put, maybe
  captured in one CUDA graph (:mod:`.graphs`).

Plain torch; the loop (:mod:`.loop`) runs the epochs."""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from raytrain_mnist.nn import checkpoint as ckpt
from raytrain_mnist.nn.model import normalize
from raytrain_mnist.nn.optim import StepRecipe, shift_images
from raytrain_mnist.nn.score import all_reduce_sum
from raytrain_mnist.worker.batches import DeviceBatches, epoch_batches
from raytrain_mnist.worker.graphs import GraphedStep
from raytrain_mnist.worker.resume import EpochStart, load_step_state, step_state


def train_step(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler: torch.amp.GradScaler,
    autocast,
    recipe: StepRecipe = StepRecipe(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on one batch of uint8 ``images``, shifted and the loss smoothed as
    ``recipe`` says; returns the (detached) loss and logits, in the precision autocast gave
    them. With label smoothing the step minimises the smoothed cross-entropy and returns the
    plain one, comparable to ``val_loss``.

    With fp16 the scaler multiplies the loss before backward; when any gradient comes out
    inf or NaN, ``scaler.step`` skips the optimizer step and ``scaler.update`` lowers the
    scale, so an overflow costs one batch instead of poisoning the weights.
    """
    with autocast:
        logits = model(normalize(shift_images(images, recipe.max_shift)))
        loss = F.cross_entropy(logits, labels, label_smoothing=recipe.label_smoothing)
    optimizer.zero_grad(set_to_none=True)  # a captured step's gradients: the graph's own
    scaler.scale(loss).backward()  # DDP all-reduces gradients during backward
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    if recipe.label_smoothing:
        loss = F.cross_entropy(logits.detach().float(), labels)
    return loss.detach(), logits.detach()


def accumulate(
    sums: torch.Tensor, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor
) -> None:
    """Add a step's (loss sum, correct, count) to the epoch's running ``sums``, on the device:
    reading them (.item()) would sync every step."""
    n = labels.numel()
    sums[0] += loss.double() * n
    sums[1] += (logits.argmax(1) == labels).sum()
    sums[2] += n  # a Python number: no host-to-device copy


@dataclasses.dataclass(frozen=True)
class Step:
    """What one optimizer step uses; calling it trains one batch (:func:`train_step`).
    ``module`` is the plain ConvNet inside ``model`` (DDP's, when wrapped): what is saved."""

    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # an LRScheduler, or the captured step's ScheduleTable
    scaler: torch.amp.GradScaler
    autocast: Any  # a context manager: torch.autocast, or a null context
    recipe: StepRecipe = StepRecipe()

    def __call__(self, images: torch.Tensor, labels: torch.Tensor):
        return train_step(
            self.model,
            images,
            labels,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.autocast,
            self.recipe,
        )


class LoaderSteps:
    """A rank's epochs on its DataLoader's batches (from a resume's step), one step per
    batch: where the host hands each batch over, as on the CPU."""

    captured = False  # the shape of DeviceSteps: never one CUDA graph
    prepare_s = 0.0

    def __init__(self, step: Step, loader: DataLoader, device: torch.device) -> None:
        self.step, self.loader = step, loader
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count

    def epoch(self, start: EpochStart | None):
        """The epoch's steps (from ``start``), one per iteration."""
        for images, labels in epoch_batches(self.loader, start):
            loss, logits = self.step(images, labels)
            accumulate(self.sums, loss, logits, labels)
            yield


class DeviceSteps:
    """A CUDA rank's epochs: the batches made on the device from ``loader``'s order
    (:class:`~.batches.DeviceBatches`) and the whole step, its running sums included, one
    function of tensors that stay put, called through :class:`~.graphs.GraphedStep` (as
    ``mode``: one CUDA graph where the run can capture it, else eagerly).

    Why not the loader's iteration, as on the CPU: there each batch's indices come from the
    host, and a GPU finishes this model's step faster than the host hands them over; a
    captured step cannot take new tensors at all. The batches, and the order of the RNG's
    draws, are the loader's all the same.
    """

    def __init__(
        self, step: Step, loader: DataLoader, images: torch.Tensor, labels: torch.Tensor, mode
    ) -> None:
        self.step = step
        self.batches = batches = DeviceBatches(loader, images, labels)
        self.sums = sums = torch.zeros(3, dtype=torch.float64, device=images.device)

        def one_step() -> None:
            images, labels = batches.next()
            loss, logits = step(images, labels)
            accumulate(sums, loss, logits, labels)

        # The parts, not self: no reference cycle keeps a graph's memory after its run.
        parts = (step, batches, sums)
        saved, load = functools.partial(_saved, *parts), functools.partial(_load, *parts)
        self.run = GraphedStep(one_step, saved, load, mode, images.device)

    @property
    def captured(self) -> bool:
        """The whole step is one CUDA graph (:mod:`.graphs`), replayed every step."""
        return self.run.captured

    @property
    def prepare_s(self) -> float:
        """The warm-up's and the capture's seconds (0 until the first step, or eager)."""
        return self.run.prepare_s

    def epoch(self, start: EpochStart | None):
        """The epoch's steps (from ``start``), one per iteration. The order is drawn where
        the loader's iteration would draw it, and a resume's RNG comes back after it."""
        skipped = 0 if start is None else start.step
        self.batches.load_epoch(skipped)
        if start is not None and start.rng is not None:
            ckpt.set_rng_state(start.rng)
        for _ in range(self.batches.steps - skipped):
            self.run()
            yield


def _saved(step: Step, batches: DeviceBatches, sums: torch.Tensor) -> dict[str, Any]:
    """What a step changes, copied: a checkpoint's step state, the epoch's position and sums."""
    return copy.deepcopy({**step_state(step), "at": batches.at, "sums": sums})


def _load(step: Step, batches: DeviceBatches, sums: torch.Tensor, state: dict[str, Any]) -> None:
    """Put :func:`_saved`'s ``state`` back, in place: into the tensors a graph replays."""
    load_step_state(step, state)
    batches.at.copy_(state["at"])
    sums.copy_(state["sums"])


def run_epoch(steps: LoaderSteps | DeviceSteps, on_step=None, start: EpochStart | None = None):
    """One pass of ``steps`` (from ``start``, when it resumes mid-epoch); returns loss and
    accuracy over every rank's samples, the epoch's steps (``skipped_steps`` of them done
    before ``start``), the CPU seconds (user + system) all ranks' processes spent on them,
    and when the first step had finished (unix time). ``on_step(steps, sums)`` is called
    after every step with the epoch's steps done and this rank's running (loss sum,
    correct, count) on the device."""
    steps.step.model.train()
    cpu_started = time.process_time()
    carried = start.sums if start is not None and start.sums is not None else [0.0] * 4
    sums, device = steps.sums, steps.sums.device
    sums.zero_()
    sums += torch.tensor(carried[:3], dtype=torch.float64, device=device)
    skipped = done = 0 if start is None else start.step
    first_step_at = None
    for _ in steps.epoch(start):
        done += 1
        if first_step_at is None:  # once per epoch: start-up ends at the first real step
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_step_at = time.time()
        if on_step is not None:
            on_step(done, sums)
    cpu = time.process_time() - cpu_started + carried[3]
    cpu_t = torch.tensor([cpu], dtype=torch.float64, device=device)
    loss_sum, correct, count, cpu_s = all_reduce_sum(torch.cat([sums, cpu_t])).tolist()
    return {
        "train_loss": loss_sum / count,
        "train_accuracy": correct / count,
        "train_images": int(count),
        "train_steps": done,
        "skipped_steps": skipped,
        "cpu_s": cpu_s,
        "first_step_at": first_step_at,
    }


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
    """:func:`run_epoch` of ``loader``'s batches, from loose parts: for plain-torch callers
    without a :class:`~.loop.Training` (a test's DDP, a benchmark's own loop)."""
    module = getattr(model, "module", model)
    step = Step(model, module, optimizer, scheduler, scaler, autocast, recipe)
    return run_epoch(LoaderSteps(step, loader, device), on_step, start)
