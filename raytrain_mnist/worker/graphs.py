"""The whole training step as one CUDA graph: captured once, replayed every step.

A step of this small model is a few hundred short kernels; launched one by one from Python
they keep the GPU waiting on the host most of the time. Captured, one launch replays them
all. What capture needs, and how :class:`GraphedStep` provides it:

* Every tensor the step reads or writes stays put, and whatever changes from step to step
  changes on the device: the batch (:mod:`.batches`), the learning rate and the optimizer
  (:class:`~raytrain_mnist.nn.optim.ScheduleTable`,
  :class:`~raytrain_mnist.nn.optim.CapturableAdamW`), the fp16 scale (``GradScaler``
  updates it in place), the running sums. The step function is written that way.
* Eager steps before the capture: lazily made state (the optimizer's moments, the scale)
  must exist, and DDP times its first ten iterations with host syncs (PyTorch's CUDA-graphs
  notes, "Usage with DistributedDataParallel": at least 11 eager iterations, DDP built on a
  side stream, as the warm-up runs). Each warm-up step is undone: the state saved before it
  (model, optimizer, schedule, scaler, RNG, the loop's counters) is loaded back in place,
  which is also how a checkpoint is restored, so a captured run is the same run an eager
  one is, and a resume loads into the tensors the graph replays.
* ``capture_error_mode="thread_local"``: Ray Train runs the loop on a thread of its own,
  and other threads of the process may use CUDA meanwhile.

Where capture cannot work (Gloo, which copies through host memory and synchronizes; a CPU),
the step runs eagerly. Asked to capture off CUDA, :class:`GraphedStep` falls back to eager
steps after the warm-up and its undoing: the CPU tests prove with it that the undoing is
complete, so that a captured run is the eager one.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: DDP samples its runtime statistics, with host syncs, over its first 10 iterations
#: (kDDPRuntimeLoggingSampleRate in torch's reducer.hpp); capture after them.
WARMUP_STEPS = 11

EAGER, CAPTURE = "eager", "capture"


def side_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """Run the block on a fresh CUDA stream that starts after, and is waited on by, the
    current one (a no-op off CUDA): where DDP is built and the warm-up runs before a
    capture."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return _on_side_stream(device)


@contextlib.contextmanager
def _on_side_stream(device: torch.device):
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)


class GraphedStep:
    """Call ``step`` (one whole training step on tensors that stay put; no argument, no
    result) as ``mode`` says: :data:`CAPTURE`, replayed from one CUDA graph after
    :data:`WARMUP_STEPS` undone eager steps (off CUDA: the same warm-up, then eagerly);
    :data:`EAGER`, as it is.

    ``save()`` returns the training state that the step changes; ``load(state)`` puts it
    back in place, into the tensors the step uses (it gets its own copy each time). The
    preparation happens at the first call, when the first epoch's batches are loaded and a
    checkpoint, if any, has been restored.
    """

    def __init__(
        self,
        step: Callable[[], None],
        save: Callable[[], Any],
        load: Callable[[Any], None],
        mode: str,
        device: torch.device,
    ) -> None:
        if mode not in (EAGER, CAPTURE):
            raise ValueError(f"a step runs as {EAGER!r} or {CAPTURE!r}, not {mode!r}")
        self.step, self.save, self.load, self.mode, self.device = step, save, load, mode, device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.prepared = mode == EAGER
        self.prepare_s = 0.0  # the warm-up's and the capture's seconds

    @property
    def captured(self) -> bool:
        """Whether this step is (or will be, at its first call) one CUDA graph."""
        return self.mode == CAPTURE and self.device.type == "cuda"

    def __call__(self) -> None:
        if not self.prepared:
            self._prepare()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()

    def _prepare(self) -> None:
        started = time.perf_counter()
        state = self.save()
        with side_stream(self.device):
            for _ in range(WARMUP_STEPS):
                self.step()
                self.load(copy.deepcopy(state))  # each warm-up step starts from the same state
        if self.captured:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.step()
            # Capturing runs nothing, but the host-side state it saw is put back all the same.
            self.load(copy.deepcopy(state))
            self.graph = graph
        self.prepared = True
        self.prepare_s = time.perf_counter() - started
        logger.debug("warm-up%s in %.3f s", " and capture" * self.captured, self.prepare_s)
