"""What a training step is made of, besides the model: the optimizer and its learning-rate
schedule, the fp16 gradient scaler, and the autocast context. Imported by the loop and by
the checkpoint checks, which build them exactly as the loop does. Plain torch."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from raytrain_mnist.config import ONECYCLE_PCT_START, TrainConfig


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
    """SGD (Nesterov when there is momentum) and its learning-rate schedule, stepped once per
    optimizer step: the one place both are built, for the loop and for the checks that a
    checkpoint's optimizer state loads (:mod:`.checkpoint`)."""
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
            pct_start=ONECYCLE_PCT_START,
        )
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return optimizer, scheduler
