"""The per-worker training loop of ``fit``, ``tune`` and a service, run by every Ray Train
worker: :func:`train_func_per_worker` (Ray's entry point) and :func:`train_run` (its loop).

It reads like Ray's own example loop: set the worker up (:mod:`.setup`), get the checkpoint,
prepare the model and the loader (:mod:`.training`), then for each epoch train, evaluate,
report. The loop is plain PyTorch around five Ray calls: ``get_checkpoint`` (resume, from an
epoch's end or mid-epoch: :mod:`.resume`), ``prepare_model`` (DDP), ``prepare_data_loader``
(the DistributedSampler), ``report`` (metrics + checkpoint, every epoch) and
``get_preemption_info`` (a just-in-time checkpoint when a node is preempted:
:mod:`.preempt`). One step is :func:`~.step.train_step`, run by the epoch's steps object
(:mod:`.step`): the loader's batches on a CPU; on a GPU the batches made there
(:mod:`.batches`) and, where the run can, the whole step one CUDA graph (:mod:`.graphs`).
What runs after every step is one :class:`StepHooks`: rank 0's progress feed (:mod:`.feed`)
and end poll (:mod:`.endpoll`), the preemption checks, a service's cancel check.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from typing import Any

import ray
import ray.train
import torch
import torch.distributed as dist
from torch import nn

from raytrain_mnist.config import TrainConfig
from raytrain_mnist.data import MnistData
from raytrain_mnist.errors import Diverged
from raytrain_mnist.worker.batches import BatchedTensorDataset, make_train_loader, set_epoch
from raytrain_mnist.worker.endpoll import EndPoll
from raytrain_mnist.worker.feed import ProgressFeed
from raytrain_mnist.worker.preempt import JustInTime
from raytrain_mnist.worker.resume import (
    Done,
    EpochStart,
    MidEpochSave,
    checkpoint_state,
    report_epoch,
    restore,
    resume_point,
    resume_state,
)
from raytrain_mnist.worker.setup import (
    WorkerSetup,
    keep_freed_memory,
    set_up_cudnn,
    to_device,
    worker_placement,
)
from raytrain_mnist.worker.step import train_one_epoch, train_step
from raytrain_mnist.worker.training import Training, backend, build_model, prepare_training

logger = logging.getLogger(__name__)


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


def train_run(
    cfg: TrainConfig,
    data: MnistData,
    worker: WorkerSetup,
    state: dict[str, Any] | None,
    progress=None,
    compile: bool = False,
    tags: dict[str, Any] | None = None,
    on_step=None,
    cuda_graphs: str = "auto",
) -> Done:
    """Train ``cfg`` from a fresh model (or the checkpoint ``state``) to its last epoch,
    reporting every epoch. ``progress``: rank 0's stream (:class:`~.feed.ProgressFeed`'s
    actor); ``tags``: added to every report (a service's request id); ``on_step(steps,
    sums)``: called after every step on every rank (a service's cancel check). A loss that
    is not a number ends the run (:class:`Diverged`, on every rank) before its epoch is
    reported, so the last checkpoint is the last good one. Returns what was trained."""
    training = prepare_training(cfg, data, worker.device, worker.world_size, compile, cuda_graphs)
    prepared_at = time.time()  # the driver's start-up timeline: "model prepared"
    done = Done() if state is None else Done(*restore(training, state))
    start, resumed = resume_point(state, worker.rank)
    run_keys = {"started_at": worker.started_at, **(tags or {})}  # in every report
    placement = worker_placement(worker, training.compiled, training.captured)
    epoch_keys = {"resumed_from_epoch": resumed["resumed_from_epoch"], "workers": placement}
    if worker.rank == 0:
        _log_start(training, cfg, worker.world_size, resumed)
    hooks = StepHooks.of_run(training, cfg, worker, done, progress, run_keys, on_step)
    hooks.ready(worker, prepared_at, resumed)
    for epoch in range(done.epoch, cfg.epochs):
        set_epoch(training.loader, epoch, cfg.seed)  # the order: a function of (seed, epoch)
        hooks.epoch_start(epoch, cfg.epochs, start)
        started = time.perf_counter()
        train = training.train_one_epoch(hooks.on_step, start)
        train_s = time.perf_counter() - started
        start = None  # only a resumed run's first epoch starts mid-way
        check_finite(train, epoch + 1, cfg)  # before the report: no checkpoint of a NaN
        train.update(hooks.epoch_end(last=epoch + 1 == cfg.epochs))
        val = evaluate_epoch(training, data, worker)
        record = epoch_record(epoch + 1, train, val, started, train_s, training.lr, worker)
        done.add(record)
        metrics = {**record, "val_total": val["val_total"], "best_val_accuracy": done.best}
        # Rank 0 writes the checkpoint; every rank reports (a barrier).
        saved = None
        if worker.rank == 0:
            saved = checkpoint_state(training, cfg, done.epoch, done.best, list(done.history))
        report_epoch({**metrics, **epoch_keys, **run_keys}, saved)
    return done


class StepHooks:
    """What runs after every step of a run's epochs, as one hook with the epoch's start and
    end: rank 0's progress feed (:mod:`.feed`) and end poll (:mod:`.endpoll`), every
    rank's preemption checks and their just-in-time checkpoint (:mod:`.preempt`), and the
    caller's own ``extra`` (a service's cancel check)."""

    def __init__(self, feed: ProgressFeed, jit: JustInTime, save: MidEpochSave, end, extra=None):
        self.feed, self.jit, self.save, self.end = feed, jit, save, end
        # Only the hooks that act: the other ranks and Tune trials pay no call for a feed.
        hooks = (feed.on_step, jit.on_step, end and end.on_step, extra)
        self._hooks = tuple(hook for hook in hooks if hook is not None)

    @classmethod
    def of_run(
        cls,
        training: Training,
        cfg: TrainConfig,
        worker: WorkerSetup,
        done: Done,
        progress,
        run_keys: dict[str, Any],
        extra=None,
    ) -> StepHooks:
        """The hooks of one run (:func:`train_run`'s arguments): ``run_keys`` go into each
        just-in-time checkpoint's report."""
        rank, world_size, steps = worker.rank, worker.world_size, len(training.loader)
        feed = ProgressFeed(progress if rank == 0 else None, cfg.batch_size, steps)
        save = MidEpochSave(training, cfg, done, rank, world_size, run_keys)
        send = functools.partial(feed.send, steps_per_epoch=steps)
        check = ray.train.get_preemption_info
        jit = JustInTime(rank, world_size, save, check, send, device=worker.device)
        return cls(feed, jit, save, EndPoll(steps) if rank == 0 else None, extra)

    def ready(self, worker: WorkerSetup, prepared_at: float, resumed: dict[str, Any]) -> None:
        """Tell the driver the run is set up and about to train (rank 0's feed)."""
        self.feed.ready(
            worker.world_size,
            worker.started_at,
            device=worker.device.type,
            backend=backend(),
            prepared_at=prepared_at,
            **resumed,
        )

    def epoch_start(self, epoch: int, epochs: int, start: EpochStart | None) -> None:
        """Epoch ``epoch`` (0-based) of ``epochs`` begins, from ``start`` when it resumes."""
        if self.end is not None:
            self.end.epoch_start(epochs_after=epochs - epoch - 1)
        self.jit.epoch = epoch
        self.save.epoch_start(start.sums[3] if start is not None and start.sums else 0.0)
        self.feed.epoch_start(epoch + 1)

    def on_step(self, steps: int, sums: torch.Tensor) -> None:
        for hook in self._hooks:
            hook(steps, sums)

    def epoch_end(self, last: bool) -> dict[str, Any]:
        """The epoch's steps are done (the ``last`` of the run's when so); returns rank 0's
        preemption checks of the epoch, for its record."""
        checks = self.jit.end_epoch()
        if last and self.end is not None:
            self.end.now()  # the last evaluation and report follow: if the steps had not asked
        return checks


def check_finite(train: dict[str, Any], epoch: int, cfg: TrainConfig) -> None:
    """Refuse to report (and checkpoint) an epoch whose loss, summed over every rank, is
    NaN or infinite: every rank sees the same sums, so every rank raises together."""
    loss = train["train_loss"]
    if not math.isfinite(loss):
        raise Diverged(
            f"training diverged: the loss of epoch {epoch} is {loss} (lr {cfg.lr:g}); "
            "lower --lr, or try --amp off"
        )


def evaluate_epoch(training: Training, data: MnistData, worker: WorkerSetup) -> dict[str, float]:
    """The test set's loss and accuracy over every rank's shard, of rank 0's weights and
    BatchNorm statistics."""
    # DDP syncs BatchNorm buffers from rank 0 at the start of each forward, so after the
    # last step every rank holds its own running stats: evaluate rank 0's, the saved ones.
    broadcast_buffers(training.module)
    return training.evaluate(data.test_images, data.test_labels, worker.rank, worker.world_size)


def broadcast_buffers(module: nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def epoch_record(
    epoch: int,
    train: dict[str, float],
    val: dict[str, float],
    started: float,
    train_s: float,
    lr: float,
    worker: WorkerSetup,
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
        "world_size": worker.world_size,  # an elastic run's size can change between epochs
        # Rank 0's preemption checks (worker/preempt.py): what the barrier costs.
        "preemption_checks": train.get("preemption_checks", 0),
        "preemption_check_s": train.get("preemption_check_s", 0.0),
    }


def _share_trained(train: dict[str, Any]) -> float:
    steps = max(train["train_steps"], 1)
    return (steps - train.get("skipped_steps", 0)) / steps


def _log_start(
    training: Training, cfg: TrainConfig, world_size: int, resumed: dict[str, Any]
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
        training.device.type,
        backend() or "none",
        "on" if training.sync_bn else "off",
        cfg.amp,
        "the step captured in one CUDA graph" if training.captured else "eager steps",
    )


__all__ = [
    "Diverged",
    "StepHooks",
    "train_func_per_worker",
    "train_run",
    # The worker's parts that tests and benchmarks have long imported from here; each
    # module's own name is the one to use.
    "BatchedTensorDataset",
    "Training",
    "build_model",
    "checkpoint_state",
    "keep_freed_memory",
    "make_train_loader",
    "prepare_training",
    "restore",
    "set_epoch",
    "set_up_cudnn",
    "to_device",
    "train_one_epoch",
    "train_step",
]
