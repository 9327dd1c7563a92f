"""Exact distributed evaluation: every test image counted once, whatever the world size."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raytrain_mnist.nn.model import normalize
from raytrain_mnist.nn.optim import amp_context

_EVAL_BATCH = 1000


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum ``values`` over all ranks (a no-op on one process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def shard(n: int, rank: int, world_size: int) -> slice:
    """Rank ``rank``'s contiguous part of ``range(n)``: every index exactly once, no padding."""
    return slice(n * rank // world_size, n * (rank + 1) // world_size)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    device: torch.device,
    autocast=contextlib.nullcontext(),
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, float]:
    """Loss and accuracy over *exactly* ``images`` (all ranks together).

    Each rank evaluates its own unpadded shard; the sums are all-reduced. Unlike a
    DistributedSampler, nothing is duplicated, so ``val_total`` is the test-set size.
    Pass the plain module (not the DDP wrapper): ranks run different numbers of batches.
    """
    model.eval()
    part = shard(len(labels), rank, world_size)
    images, labels = images[part], labels[part]
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for start in range(0, len(labels), _EVAL_BATCH):
        x = images[start : start + _EVAL_BATCH].to(device, non_blocking=True)
        y = labels[start : start + _EVAL_BATCH].to(device, non_blocking=True)
        with autocast:
            logits = model(normalize(x))
        sums[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
        sums[1] += (logits.argmax(1) == y).sum().double()
        sums[2] += y.numel()
    loss_sum, correct, total = all_reduce_sum(sums).tolist()
    return {
        "val_loss": loss_sum / max(total, 1),
        "val_accuracy": correct / max(total, 1),
        "val_total": int(total),
    }


def score(
    model, images, labels, device, amp: str = "off", rank: int = 0, world_size: int = 1
) -> dict[str, Any]:
    """:func:`evaluate` on this rank's shard, plus each image's prediction and confidence.

    Returns the all-reduced metrics and this shard's ``predictions`` and ``confidence``
    (softmax probability of the predicted class) as numpy arrays.
    """
    if amp == "fp16" and device.type != "cuda":
        amp = "off"  # fp16 autocast is a GPU feature; fit refuses it on CPU anyway
    probabilities: list[torch.Tensor] = []
    hook = model.register_forward_hook(
        lambda _module, _inputs, logits: probabilities.append(logits.float().softmax(1).cpu())
    )
    try:
        metrics = evaluate(
            model, images, labels, device, amp_context(amp, device), rank, world_size
        )
    finally:
        hook.remove()
    confidence, predictions = (
        torch.cat(probabilities) if probabilities else torch.empty(0, 10)
    ).max(1)
    return {**metrics, "predictions": predictions.numpy(), "confidence": confidence.numpy()}
