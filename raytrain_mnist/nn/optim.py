"""What a training step is made of, besides the model: the optimizer and its learning-rate
schedule, the training images' random shifts, the fp16 gradient scaler, and the autocast
context. Imported by the loop and by the checkpoint checks, which build them exactly as the
loop does. Plain torch.

A step captured in a CUDA graph (:mod:`raytrain_mnist.worker.graphs`) replays the same
kernels on the same tensors, so whatever changes from step to step must change on the
device, in place: :class:`CapturableAdamW` (one fused kernel, its learning rate a tensor)
and :class:`ScheduleTable` (the schedule's values precomputed on the device) are the
optimizer and schedule of such a step. Both save and load the state an eager run's
optimizer and schedule do, so a checkpoint resumes either way.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_mnist.config import TrainConfig


def amp_context(amp: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Chosen once, used everywhere: no precision branches inside the loop. Without the
    cast cache: a CUDA graph cannot capture it, and this model uses each weight once per
    forward, so the cache saved nothing (the casts and their results are the same)."""
    if amp == "off":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=False)


def grad_scaler(amp: str, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling for fp16 only; disabled it passes everything through unchanged."""
    return torch.amp.GradScaler(device.type, enabled=amp == "fp16")


def build_optimizer(model: nn.Module, cfg: TrainConfig, steps_per_epoch: int, captured=False):
    """The optimizer (AdamW, or SGD with Nesterov momentum when there is momentum) and its
    learning-rate schedule, stepped once per optimizer step: the one place both are built, for
    the loop and for the checks that a checkpoint's optimizer state loads (:mod:`.checkpoint`).

    The one-cycle schedule warms up from ``lr / 25`` over ``warmup_pct`` of all steps and
    anneals (cosine) to ``lr / 25e4``. With SGD it also cycles the momentum between 0.95 and
    0.85 (PyTorch's default, the seed recipe's); AdamW keeps ``betas=(momentum, beta2)``.

    ``captured``: for a step a CUDA graph replays (AdamW only: a cycled momentum would be
    a new Python number every step, which a graph cannot see): a :class:`CapturableAdamW`
    and a :class:`ScheduleTable` of the same schedule.
    """
    if captured and cfg.optimizer != "adamw":
        raise ValueError(f"a captured step needs AdamW, not {cfg.optimizer}")
    if cfg.optimizer == "adamw":
        adamw = CapturableAdamW if captured else torch.optim.AdamW
        optimizer = adamw(
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
    scheduler = _schedule(optimizer, cfg, steps_per_epoch)
    if captured:  # the eager schedule set the groups' keys a checkpoint holds; now the table
        scheduler = ScheduleTable(optimizer, cfg, steps_per_epoch)
    return optimizer, scheduler


def _schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig, steps_per_epoch: int):
    if cfg.schedule == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=cfg.lr,
            total_steps=cfg.epochs * steps_per_epoch,
            pct_start=cfg.warmup_pct,
            cycle_momentum=cfg.optimizer == "sgd",
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def schedule_table(cfg: TrainConfig, steps_per_epoch: int) -> torch.Tensor:
    """The learning rate of every optimizer step of a run of ``cfg`` (float64, on the CPU):
    entry ``k`` is the rate step ``k + 1`` uses, the schedule's after ``k`` steps; one entry
    more than the run has steps (the rate the schedule ends at)."""
    shadow = _Shadow(cfg, steps_per_epoch)
    values = [shadow.lr]
    for _ in range(cfg.epochs * steps_per_epoch):
        shadow.step()
        values.append(shadow.lr)
    return torch.tensor(values, dtype=torch.float64)


class _Shadow:
    """The eager schedule of ``cfg`` on an optimizer of one idle parameter (made without
    drawing from the RNG): its values and its state at any step, touching nothing else."""

    def __init__(self, cfg: TrainConfig, steps_per_epoch: int) -> None:
        holder = nn.Module()
        holder.weight = nn.Parameter(torch.zeros(1))
        self.optimizer, self.scheduler = build_optimizer(holder, cfg, steps_per_epoch)
        self.optimizer.step()  # no gradient: nothing moves; the schedule may step after it

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def step(self) -> None:
        self.scheduler.step()


class CapturableAdamW(torch.optim.AdamW):
    """AdamW as one fused kernel a CUDA graph can capture: ``fused``, ``capturable``, its
    learning rate :attr:`lr` a one-element float32 tensor on the parameters' device that
    :class:`ScheduleTable` writes in place (the fused kernel reads float32 rates).

    Its state changes only in place, because a graph replays on the tensors it was captured
    with: :meth:`load_state_dict` copies into the tensors it holds (and zeroes them for a
    parameter the loaded state has none for: what AdamW starts from). :meth:`state_dict` is
    what an eager AdamW's would be (the rate a number, the float32 the kernel used; the
    eager kernels' flags), so a checkpoint loads into either.
    """

    def __init__(self, params, lr: float, **kwargs) -> None:
        params = list(params)
        rate = torch.tensor(lr, dtype=torch.float32, device=params[0].device)
        super().__init__(params, lr=rate, fused=True, capturable=True, **kwargs)
        self.lr = rate
        self._own = {key: self.defaults[key] for key in _KERNEL_FLAGS}

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()  # new group dicts; the state's tensors are ours
        for group in state["param_groups"]:
            # Numbers where a schedule made tensors of them (the rate; a constant schedule's
            # initial rate, copied from it).
            numbers = {k: v.item() for k, v in group.items() if isinstance(v, torch.Tensor)}
            group.update(_eager_flags(), **numbers)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        held = {p: dict(s) for p, s in self.state.items() if s}
        super().load_state_dict(state_dict)  # new groups and new tensors: put ours back
        loaded_lr = float(self.param_groups[0]["lr"])
        for group in self.param_groups:
            group.update(self._own, lr=self.lr)
            for p in group["params"]:
                loaded, mine = self.state.get(p, {}), held.get(p)
                if mine is None:
                    if loaded:  # nothing captured yet: the fused kernel's own placement
                        loaded["step"] = loaded["step"].to(p.device, torch.float32)
                    continue
                for key, tensor in mine.items():
                    if key in loaded:
                        tensor.copy_(loaded[key])
                    else:
                        tensor.zero_()
                self.state[p] = mine
        self.lr.fill_(loaded_lr)


#: What selects AdamW's kernel: a checkpoint holds the eager one's, whichever ran.
_KERNEL_FLAGS = ("foreach", "fused", "capturable")


@functools.cache
def _eager_flags() -> dict[str, Any]:
    defaults = torch.optim.AdamW([torch.zeros(1)]).defaults
    return {key: defaults[key] for key in _KERNEL_FLAGS}


class ScheduleTable:
    """The learning-rate schedule of a captured step: the eager schedule's rate for every
    step (:func:`schedule_table`), computed once onto the device, and the step the run is
    at, there too. :meth:`step` moves on and writes the next rate into the optimizer's
    tensor ``lr`` in place: device work only, so a graph can replay it.

    Its state is the eager schedule's (a one-cycle or constant ``LRScheduler``): on
    :meth:`state_dict`, a schedule of its own is stepped on the host to where the device
    says the run is (one read of the device: a checkpoint reads it anyway), and
    :meth:`load_state_dict` takes such a state's ``last_epoch``. Checkpoints written by
    either load into either.
    """

    def __init__(self, optimizer: CapturableAdamW, cfg: TrainConfig, steps_per_epoch: int):
        self.lr = optimizer.lr
        for group in optimizer.param_groups:  # whatever the eager schedule wrote there
            group["lr"] = self.lr
        self._shadow_of = functools.partial(_Shadow, cfg, steps_per_epoch)
        self._shadow = self._shadow_of()
        table = schedule_table(cfg, steps_per_epoch)
        self.table = table.to(device=self.lr.device, dtype=self.lr.dtype)
        self.position = torch.zeros((), dtype=torch.int64, device=self.lr.device)
        self.lr.copy_(self.table[0])

    def step(self) -> None:
        self.position += 1
        self.lr.copy_(self.table.index_select(0, self.position.view(1)).view(()))

    @property
    def last_epoch(self) -> int:
        """Steps taken (``LRScheduler.last_epoch``); reads the device."""
        return int(self.position)

    def state_dict(self) -> dict[str, Any]:
        return self._at(self.last_epoch).scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position.fill_(int(state_dict["last_epoch"]))
        self.lr.copy_(self.table.index_select(0, self.position.view(1)).view(()))

    def get_last_lr(self) -> list[float]:
        """The rate the next step uses, as the eager schedule computed it (float64)."""
        return self._at(self.last_epoch).scheduler.get_last_lr()

    def _at(self, steps: int) -> _Shadow:
        if self._shadow.scheduler.last_epoch > steps:  # a load went back: start over
            self._shadow = self._shadow_of()
        while self._shadow.scheduler.last_epoch < steps:
            self._shadow.step()
        return self._shadow


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
