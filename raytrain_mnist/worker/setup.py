"""What a Train worker sets up once per worker-group start, before it trains: its logging,
torch threads, allocator and device (:class:`WorkerSetup`), the data on that device
(:func:`to_device`), and where every rank runs (:func:`worker_placement`, for rank 0's
reports). The loop that follows is :mod:`.loop`."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import sys
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from raytrain_mnist import compat
from raytrain_mnist.data import MnistData
from raytrain_mnist.worker.training import backend


@dataclasses.dataclass(frozen=True)
class WorkerSetup:
    """What a worker-group start sets up once, for every run it trains (one for ``fit``,
    one per request for a service: :mod:`.service`)."""

    rank: int
    world_size: int
    device: torch.device
    started_at: float  # unix time the train function began: names this worker-group start

    @classmethod
    def start(cls, cpus_per_worker: int, started_at: float) -> WorkerSetup:
        ctx = ray.train.get_context()
        rank = ctx.get_world_rank()
        device = set_up_worker(rank, cpus_per_worker)
        return cls(rank, ctx.get_world_size(), device, started_at)


def set_up_worker(rank: int, cpus_per_worker: int) -> torch.device:
    """Make this process ready to train; returns the device Ray gave it."""
    # Rank 0 talks; the others only warn. (Ray has already configured the root logger.)
    logging.getLogger("raytrain_mnist").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    compat.quiet_train_report_log()
    keep_freed_memory()
    torch.set_num_threads(cpus_per_worker)
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        set_up_cudnn()
    return device


def keep_freed_memory() -> bool:
    """Stop glibc from handing freed tensor memory back to the OS after every step.

    PyTorch's CPU allocator is plain ``malloc``. By default glibc trims its heap once the
    free top exceeds twice the largest recently freed block, and deletes a thread arena's
    64 MiB heap as soon as it is empty (Ray Train runs the loop off the main thread), so each
    step's activations go back to the OS when backward frees them and are page-faulted back,
    zero-filled, by the next forward, every step (figures: benchmarks/README.md). A fixed
    mmap threshold (32 MiB, glibc's cap), a high trim threshold and a top pad larger than a
    thread heap keep the memory; blocks above 32 MiB are still mapped and unmapped.
    Process-wide; call it in a process that trains. Returns False where the C library has no
    effective ``mallopt``.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # a C library without mallopt
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # <malloc.h>
    applied = [
        mallopt(param, value)
        for param, value in (
            (m_mmap_threshold, 32 << 20),
            (m_trim_threshold, 512 << 20),
            (m_top_pad, 64 << 20),
        )
    ]
    return all(applied)  # musl's mallopt exists and returns 0: nothing changed


def set_up_cudnn() -> None:
    """cuDNN's fixed choice of convolution algorithms, not its benchmark mode: that times
    every candidate algorithm of every convolution at the first step, the largest part of a
    cold first step, and a run of a few hundred steps of this small model does not earn
    it back (benchmarks/gpu.py measures the first step). Deterministic ones: a resumed or
    captured run then repeats an eager one exactly."""
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def to_device(data: MnistData, device: torch.device) -> MnistData:
    """The data set as tensors on ``device``, made once: batches are then gathered and
    normalised where the model is, with no host-to-device copy per step. The arrays come
    from the object store, read-only memory the node's workers share; each worker copies
    them into tensors of its own (torch assumes it may write what it holds)."""
    return dataclasses.replace(
        data,
        **{
            name: own_tensor(getattr(data, name)).to(device)
            for name in ("train_images", "train_labels", "test_images", "test_labels")
        },
    )


def own_tensor(array) -> torch.Tensor:
    """A tensor of this worker's own from an array the object store shares read-only."""
    return torch.from_numpy(array.copy())


def worker_placement(
    worker: WorkerSetup, compiled: bool = False, captured: bool = False
) -> list[dict[str, Any]]:
    """Where and how every rank runs, gathered once so rank 0 can report it."""
    me = {
        "rank": worker.rank,
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "device": str(worker.device),
        "backend": backend(),
        "compiled": compiled,
        "step": "captured" if captured else "eager",  # one CUDA graph, or kernel by kernel
    }
    if worker.device.type == "cuda":
        me["gpu"] = torch.cuda.get_device_name(worker.device)
    if worker.world_size == 1:
        return [me]
    everyone: list[Any] = [None] * worker.world_size
    dist.all_gather_object(everyone, me)
    return everyone
