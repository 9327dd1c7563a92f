"""Resuming a run, from an epoch's end or from mid-epoch: what a checkpoint of the loop
holds and how a worker group starts again from it. Run inside a Train worker.

:func:`checkpoint_state` builds what rank 0 saves (``checkpoint.RESUME_KEYS``),
:func:`restore` loads it into a freshly prepared :class:`~.loop.Training`, and
:func:`resume_point` says where the first epoch resumes (:class:`EpochStart`). The
just-in-time checkpoint of a preemption (:class:`MidEpochSave`, used by
:class:`~.preempt.JustInTime`) is the same state at a step within the epoch. What a step
changes, the heart of that state, is listed once: :data:`STEP_STATE`.
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


#: What a training step changes, by checkpoint key and the attribute of a
#: :class:`~.loop.Training` (or a :class:`~.step.Step`) that holds it; with the RNG's state,
#: the one list of what resumes a run: a checkpoint saves and loads it, a captured step's
#: warm-up undoes itself with it (:class:`~.step.DeviceSteps`).
STEP_STATE = {
    "model": "module",
    "optimizer": "optimizer",
    "scheduler": "scheduler",
    "scaler": "scaler",
}


def step_state(parts) -> dict[str, Any]:
    """The :data:`STEP_STATE` of ``parts`` (their state_dicts, not copies) and the RNG's."""
    state = {key: getattr(parts, name).state_dict() for key, name in STEP_STATE.items()}
    return {**state, "rng": ckpt.rng_state()}


def load_step_state(parts, state: dict[str, Any]) -> None:
    """Put :func:`step_state`'s ``state`` back into ``parts``, in place. The RNG comes back
    last, so the next draw is the one the uninterrupted run made."""
    for key, name in STEP_STATE.items():
        getattr(parts, name).load_state_dict(state[key])
    ckpt.set_rng_state(state["rng"])


def restore(training: Training, state: dict[str, Any]) -> tuple[int, list[dict], float]:
    """Load a checkpoint's ``state`` (as :func:`checkpoint_state` wrote it) into
    ``training`` and the RNG; returns (epochs completed, history, best validation accuracy).
    Every rank loads the same state, so the replicas stay identical."""
    load_step_state(training, state)
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
        **step_state(training),
        "epoch": epoch,
        "best_val_accuracy": best,
        "history": history,
        "config": cfg.to_dict(),
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

    def add(self, record: dict[str, Any]) -> None:
        """One more epoch done: its ``record`` (``loop.epoch_record``'s)."""
        self.epoch += 1
        self.best = max(self.best, record["val_accuracy"])
        self.history.append(record)


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


class MidEpochSave:
    """The just-in-time checkpoint of :class:`~.preempt.JustInTime`, called as
    ``save(step, sums, final)``: the epoch's sums so far over every rank, rank 0's state at
    this step, one report from every rank. ``run_keys``: what each of its reports says
    about the run (``started_at``, a service's tags); :meth:`epoch_start` at each epoch's
    start, with the CPU seconds a resumed epoch had already spent."""

    def __init__(
        self,
        training: Training,
        cfg: TrainConfig,
        done: Done,
        rank: int,
        world_size: int,
        run_keys: dict,
    ) -> None:
        self.training, self.cfg, self.done = training, cfg, done
        self.rank, self.world_size, self.run_keys = rank, world_size, run_keys
        self.epoch_start()

    def epoch_start(self, carried_cpu_s: float = 0.0) -> None:
        self._cpu_started, self._carried_cpu_s = time.process_time(), carried_cpu_s

    def __call__(self, step: int, sums: torch.Tensor, final: bool) -> None:
        done, cpu_s = self.done, time.process_time() - self._cpu_started
        cpu = torch.tensor([cpu_s], dtype=torch.float64, device=sums.device)
        totals = all_reduce_sum(torch.cat([sums.detach(), cpu])).tolist()
        position = {
            "step": step,
            "sums": [*totals[:3], totals[3] + self._carried_cpu_s],
            "sampler_seed": self.cfg.seed,
            "sampler_epoch": done.epoch,
            "world_size": self.world_size,
            "kind": "preemption",
        }
        state = None
        if self.rank == 0:
            state = checkpoint_state(
                self.training, self.cfg, done.epoch, done.best, done.history, position
            )
        metrics = {
            "progress": "checkpoint",  # not an epoch: the driver keeps it out of the history
            "kind": "preemption",
            "final": final,
            "epoch": done.epoch,
            "step": step,
            CHECKPOINT_METRIC: float("nan"),  # ranked below every evaluated checkpoint
            "world_size": self.world_size,
            **self.run_keys,
        }
        report_epoch(metrics, state)
