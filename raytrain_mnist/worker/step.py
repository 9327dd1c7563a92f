"""One training step: on a batch it is handed (the CPU's loader), or on CUDA as a rank's
:class:`DeviceSteps`, whose batches and step live on the device and whose step may be one
CUDA graph (:mod:`.graphs`). Plain torch; the loop (:mod:`.loop`) runs the epochs."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_mnist.nn import checkpoint as ckpt
from raytrain_mnist.nn.model import normalize
from raytrain_mnist.nn.optim import StepRecipe, shift_images
from raytrain_mnist.worker.batches import DeviceBatches
from raytrain_mnist.worker.graphs import GraphedStep
from raytrain_mnist.worker.resume import EpochStart

#: A :class:`~raytrain_mnist.worker.loop.Training` (not imported: the loop imports this).
Training = Any


def set_up_cudnn() -> None:
    """cuDNN's fixed choice of convolution algorithms, not its benchmark mode: that times
    every candidate algorithm of every convolution at the first step, the largest part of a
    cold first step, and a run of a few hundred steps of this small model does not earn
    it back (benchmarks/gpu.py measures the first step). Deterministic ones: a resumed or
    captured run then repeats an eager one exactly."""
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


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


class DeviceSteps:
    """A CUDA rank's epochs: the batches made on the device from the loader's order
    (:class:`~.batches.DeviceBatches`) and the whole step, its running sums included, one
    function of tensors that stay put, called through :class:`~.graphs.GraphedStep` (as
    ``mode``: one CUDA graph where the run can capture it, else eagerly).

    Why not the loader's iteration, as on the CPU: there each batch's indices come from the
    host, and a GPU finishes this model's step faster than the host hands them over; a
    captured step cannot take new tensors at all. The batches, and the order of the RNG's
    draws, are the loader's all the same.
    """

    def __init__(self, training: Training, images: torch.Tensor, labels: torch.Tensor, mode):
        # The parts, not the Training (which holds this): no reference cycle keeps a
        # graph's memory alive after its run.
        self.batches = batches = DeviceBatches(training.loader, images, labels)
        self.sums = sums = torch.zeros(3, dtype=torch.float64, device=images.device)
        model, optimizer, scheduler = training.model, training.optimizer, training.scheduler
        scaler, autocast, recipe = training.scaler, training.autocast, training.recipe

        def step() -> None:
            images, labels = batches.next()
            loss, logits = train_step(
                model, images, labels, optimizer, scheduler, scaler, autocast, recipe
            )
            accumulate(sums, loss, logits, labels)

        state = (training.module, optimizer, scheduler, scaler, batches, sums)
        self.run = GraphedStep(
            step,
            functools.partial(_saved, *state),
            functools.partial(_load, *state),
            mode,
            images.device,
        )

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


def _saved(module, optimizer, scheduler, scaler, batches, sums) -> dict[str, Any]:
    """What a step changes, copied: what a checkpoint holds (``resume.checkpoint_state``),
    and the epoch's position and sums."""
    return copy.deepcopy(
        {
            "model": module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": ckpt.rng_state(),
            "at": batches.at,
            "sums": sums,
        }
    )


def _load(module, optimizer, scheduler, scaler, batches, sums, state: dict[str, Any]) -> None:
    """Put :func:`_saved`'s ``state`` back in place, in ``resume.restore``'s order."""
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    ckpt.set_rng_state(state["rng"])
    batches.at.copy_(state["at"])
    sums.copy_(state["sums"])
