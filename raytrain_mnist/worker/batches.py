"""A rank's training batches: its DataLoader's on the CPU, made on its GPU on CUDA.

:func:`make_train_loader` is the loader over the in-memory uint8 tensors (Ray's
``prepare_data_loader`` gives it each rank's ``DistributedSampler``); :func:`set_epoch`
makes each epoch's order a function of (seed, epoch); :func:`epoch_batches` iterates it from
a resume's step. That is the CPU's path.

On CUDA the loop does not iterate the loader: a step that waited for the host to hand it
each batch's indices would leave a GPU that finishes this model's step in well under a
millisecond idle, and a captured step (:mod:`.graphs`) cannot take new tensors at all. The
loader stays the source of every rank's shard and order: :meth:`DeviceBatches.load_epoch`
draws the epoch's indices through it (its sampler, its generator, ``set_epoch``: exactly the
draws iterating it makes, so a CPU run and a GPU run train on the same batches), copies them
to the device in one transfer, and every step then gathers its batch there, from a position
that lives on the device too.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_mnist.nn import checkpoint as ckpt
from raytrain_mnist.worker.resume import EpochStart


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


def epoch_batches(loader, start: EpochStart | None):
    """The epoch's batches from ``start``: the loader's order (its sampler's epoch and seed,
    set by :func:`set_epoch`) with the done batches skipped, then the RNG put back, so the
    next draw (a shift) is the one the uninterrupted run made at that step."""
    batches = iter(loader)
    if start is not None:
        for _ in range(start.step):  # one gather each: cheaper than rebuilding the sampler
            next(batches)
        if start.rng is not None:
            ckpt.set_rng_state(start.rng)
    return batches


class _Positions(torch.utils.data.Dataset):
    """A data set whose samples are their own indices, a batch of them one tensor."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        return torch.as_tensor(indices, dtype=torch.int64)


def _same(batch):
    return batch


class DeviceBatches:
    """The batches of ``loader`` (in-memory ``images`` and ``labels``, on their device),
    made on that device: :meth:`load_epoch` once an epoch, then :meth:`next` every step.

    :attr:`order` (steps x batch indices) and :attr:`at` (the next step) are tensors that
    stay put, so a captured step reads the epoch's batches from them.
    """

    def __init__(self, loader: DataLoader, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels
        self.device = images.device
        self.steps, self.batch_size = len(loader), loader.batch_size
        # The loader's own sampler and generator: the same draws, in the same order.
        self._indices = DataLoader(
            _Positions(len(loader.dataset)),
            batch_size=loader.batch_size,
            sampler=loader.sampler,
            drop_last=loader.drop_last,
            collate_fn=_same,
            generator=loader.generator,
        )
        self.order = torch.zeros(self.steps, self.batch_size, dtype=torch.int64, device=self.device)
        self.at = torch.zeros((), dtype=torch.int64, device=self.device)

    def epoch_indices(self) -> torch.Tensor:
        """This epoch's batches' indices (steps x batch, on the CPU), as iterating the
        loader draws them: call it where the loop would iterate the loader."""
        return torch.stack(list(self._indices))

    def load_epoch(self, step: int = 0) -> None:
        """Draw the epoch's order, move it to the device in one copy, and start at ``step``
        (a resume's; its done batches are not gathered)."""
        indices = self.epoch_indices()
        if self.device.type == "cuda":  # queued behind the GPU's work: the host runs on
            indices = indices.pin_memory()
        self.order.copy_(indices, non_blocking=True)
        self.at.fill_(step)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch's uint8 images and labels, gathered on the device: device work
        only (no host sync), so a graph can replay it."""
        rows = self.order.index_select(0, self.at.view(1)).view(-1)
        self.at += 1
        return self.images.index_select(0, rows), self.labels.index_select(0, rows)
