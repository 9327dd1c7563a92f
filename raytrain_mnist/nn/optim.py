"""What a training step is made of, besides the model: the optimizer and its learning-rate
schedule, the training images' random shifts, the fp16 gradient scaler, and the autocast
context. Imported by the loop and by the checkpoint checks, which build them exactly as the
loop does. Plain torch."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_mnist.config import TrainConfig


def amp_context(amp: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Chosen once, used everywhere: no precision branches inside the loop."""
    if amp == "off":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(amp: str, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling for fp16 only; disabled it passes everything through unchanged."""
    return torch.amp.GradScaler(device.type, enabled=amp == "fp16")


def build_optimizer(model: nn.Module, cfg: TrainConfig, steps_per_epoch: int):
    """The optimizer (AdamW, or SGD with Nesterov momentum when there is momentum) and its
    learning-rate schedule, stepped once per optimizer step: the one place both are built, for
    the loop and for the checks that a checkpoint's optimizer state loads (:mod:`.checkpoint`).

    The one-cycle schedule warms up from ``lr / 25`` over ``warmup_pct`` of all steps and
    anneals (cosine) to ``lr / 25e4``. With SGD it also cycles the momentum between 0.95 and
    0.85 (PyTorch's default, the seed recipe's); AdamW keeps ``betas=(momentum, beta2)``.
    """
    if cfg.optimizer == "adamw":
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.lr,
            betas=(cfg.momentum, cfg.beta2),
            weight_decay=cfg.weight_decay,
        )
    else:
        optimizer = torch.optim.SGD(
            model.parameters(),
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.momentum > 0,
            weight_decay=cfg.weight_decay,
        )
    if cfg.schedule == "onecycle":
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=cfg.lr,
            total_steps=cfg.epochs * steps_per_epoch,
            pct_start=cfg.warmup_pct,
            cycle_momentum=cfg.optimizer == "sgd",
        )
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return optimizer, scheduler


@dataclass(frozen=True)
class StepRecipe:
    """What a training step does around the model besides the optimizer: each image shifted
    by up to ``max_shift`` pixels (:func:`shift_images`), the loss smoothed by
    ``label_smoothing``. The defaults change nothing."""

    label_smoothing: float = 0.0
    max_shift: int = 0

    @classmethod
    def of(cls, cfg: TrainConfig) -> StepRecipe:
        return cls(label_smoothing=cfg.label_smoothing, max_shift=cfg.max_shift)


def shift_images(images: torch.Tensor, max_shift: int) -> torch.Tensor:
    """Each of the uint8 ``images`` ``(N, H, W)`` moved by its own random whole number of
    pixels in ``-max_shift..max_shift`` along each axis, the uncovered border 0 (MNIST's
    background): one gather, on the images' device. The offsets come from torch's default
    generator of that device, whose state a checkpoint saves, so a resumed run draws what the
    uninterrupted one did."""
    if max_shift == 0:
        return images
    n, height, width = images.shape
    device = images.device
    padded = F.pad(images, (max_shift,) * 4)
    offsets = torch.randint(0, 2 * max_shift + 1, (2, n, 1, 1), device=device)
    rows = offsets[0] + torch.arange(height, device=device).view(1, height, 1)
    cols = offsets[1] + torch.arange(width, device=device).view(1, 1, width)
    return padded[torch.arange(n, device=device).view(n, 1, 1), rows, cols]
