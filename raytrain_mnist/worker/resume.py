"""Resuming a run, from an epoch's end or from mid-epoch: what a checkpoint of the loop
holds and how a worker group starts again from it. Run inside a Train worker.

:func:`checkpoint_state` builds what rank 0 saves (``checkpoint.RESUME_KEYS``),
:func:`restore` loads it into a freshly prepared :class:`~.loop.Training`, and
:func:`resume_point` says where the first epoch resumes (:class:`EpochStart`). The
just-in-time checkpoint of a preemption (:func:`jit_saver`, used by
:class:`~.preempt.JustInTime`) is the same state at a step within the epoch.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from typing import Any

import ray
import ray.train
import torch
import torch.distributed as dist

from raytrain_mnist.config import CHECKPOINT_METRIC, TrainConfig
from raytrain_mnist.nn import checkpoint as ckpt
from raytrain_mnist.nn.score import all_reduce_sum

#: A :class:`~raytrain_mnist.worker.loop.Training` (not imported: the loop imports this).
Training = Any


def _world_size() -> int:
    ready = dist.is_available() and dist.is_initialized()
    return dist.get_world_size() if ready else 1


@dataclasses.dataclass(frozen=True)
class EpochStart:
    """Where an epoch resumes (a checkpoint written mid-epoch): ``step`` batches of it are
    done; ``sums`` (loss sum, correct, count, CPU seconds over every rank so far) is added
    on one rank only (None elsewhere); ``rng`` is the generator state at that step, put
    back once the done batches are skipped."""

    step: int = 0
    sums: list[float] | None = None
    rng: dict[str, Any] | None = None


def resume_state() -> dict[str, Any] | None:
    """The state of the checkpoint Ray hands this worker group (None on a fresh start)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        return ckpt.load(directory)


def restore(training: Training, state: dict[str, Any]) -> tuple[int, list[dict], float]:
    """Load a checkpoint's ``state`` (as :func:`checkpoint_state` wrote it) into
    ``training`` and the RNG; returns (epochs completed, history, best validation accuracy).

    Every rank loads the same state, so the replicas stay identical; the RNG comes back
    last, so the next draw is the one the uninterrupted run made.
    """
    training.module.load_state_dict(state["model"])
    training.optimizer.load_state_dict(state["optimizer"])
    training.scheduler.load_state_dict(state["scheduler"])
    training.scaler.load_state_dict(state["scaler"])
    ckpt.set_rng_state(state["rng"])
    return state["epoch"], state["history"], state["best_val_accuracy"]


def checkpoint_state(
    training: Training,
    cfg: TrainConfig,
    epoch: int,
    best: float,
    history: list[dict],
    position: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything a resume needs after ``epoch`` completed epochs and, mid-epoch, the
    ``position`` within the next (``checkpoint.boundary_position`` when None;
    checkpoint.RESUME_KEYS; :func:`restore` reads it back, ``checkpoint.resumable_state``
    checks it on the driver)."""
    if position is None:
        world_size = _world_size()
        position = ckpt.boundary_position(cfg.to_dict(), epoch, world_size)
    return {
        "position": position,
        "model": training.module.state_dict(),
        "optimizer": training.optimizer.state_dict(),
        "scheduler": training.scheduler.state_dict(),
        "scaler": training.scaler.state_dict(),
        "epoch": epoch,
        "best_val_accuracy": best,
        "history": history,
        "config": cfg.to_dict(),
        "rng": ckpt.rng_state(),
    }


def report_epoch(metrics: dict[str, Any], state: dict[str, Any] | None) -> None:
    """Report one epoch's ``metrics`` to Ray Train, with ``state`` as its checkpoint when
    given (rank 0's; the other ranks pass None). Every rank calls this once per epoch:
    ``ray.train.report`` is a barrier."""
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = None
        if state is not None:
            ckpt.save(directory, state)
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report(metrics, checkpoint=checkpoint)


@dataclasses.dataclass
class Done:
    """What a worker group has trained: ``epoch`` completed epochs, their ``history`` and
    the ``best`` validation accuracy; what every checkpoint saves beside the Training."""

    epoch: int = 0
    history: list[dict] = dataclasses.field(default_factory=list)
    best: float = 0.0


def resume_point(state: dict[str, Any] | None, rank: int) -> tuple[EpochStart | None, dict]:
    """Where a checkpoint's ``state`` resumes: the first epoch's :class:`EpochStart` (None
    at an epoch's end) and, for the driver and the logs, ``resumed_from_epoch``,
    ``resumed_from_step`` and ``resumed_world_size`` (who wrote it)."""
    if state is None:
        return None, {"resumed_from_epoch": None}
    position = state["position"]
    told = {
        "resumed_from_epoch": state["epoch"],
        "resumed_from_step": position["step"],
        "resumed_world_size": position["world_size"],
    }
    if position["step"] == 0:
        return None, told
    sums = position["sums"] if rank == 0 else None  # the other ranks' share is in rank 0's
    return EpochStart(position["step"], sums, state["rng"]), told


def jit_saver(training: Training, cfg: TrainConfig, done: Done, keys: dict, rank: int):
    """The just-in-time checkpoint of :class:`~.preempt.JustInTime`: the epoch's sums so
    far over every rank, rank 0's state at this step, one report from every rank."""
    cpu_started = [time.process_time()]  # reset by the loop at each epoch's start

    def save(step: int, sums: torch.Tensor, final: bool) -> None:
        cpu = torch.tensor(
            [time.process_time() - cpu_started[0]], dtype=torch.float64, device=sums.device
        )
        totals = all_reduce_sum(torch.cat([sums.detach(), cpu])).tolist()
        world_size = keys["world_size"]
        position = {
            "step": step,
            "sums": [*totals[:3], totals[3] + keys.get("carried_cpu_s", 0.0)],
            "sampler_seed": cfg.seed,
            "sampler_epoch": done.epoch,
            "world_size": world_size,
            "kind": "preemption",
        }
        state = None
        if rank == 0:
            state = checkpoint_state(training, cfg, done.epoch, done.best, done.history, position)
        metrics = {
            "progress": "checkpoint",  # not an epoch: the driver keeps it out of the history
            "kind": "preemption",
            "final": final,
            "epoch": done.epoch,
            "step": step,
            CHECKPOINT_METRIC: float("nan"),  # ranked below every evaluated checkpoint
            "world_size": world_size,
            "started_at": keys["started_at"],
            **keys.get("tags", {}),
        }
        report_epoch(metrics, state)

    save.cpu_started = cpu_started
    return save
