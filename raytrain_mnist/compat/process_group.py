"""The workers' process group without torch in the run's driver and controller (see the
package's table).

Ray's ``TorchConfig`` lives beside its backend in ``ray.train.torch.config``, which imports
torch; the driver builds it and every run's controller unpickles it: 2-4 CPU-seconds each, and
as many seconds of every run's CPU-bound start-up (a 2-worker sample fit's controller 2.0
CPU-s without, 3.7 with: benchmarks/results/controller_without_torch/), in processes that
never touch a tensor. Here the controller orders the same steps as
Ray 2.60's ``_TorchBackend`` for Gloo and NCCL (rank 0's address, the environment, the process
group; at the end its teardown), and each step runs on the workers as Ray's own function of
that name. The classes are pickled by name: built on first use by the module's
``__getattr__``, so that importing this module imports no Ray.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

#: The backend config and its backend, built by :func:`_classes`.
_NAMES = ("TorchConfigOnWorkers", "TorchBackendOnWorkers")
#: What the workers call in Ray's ``ray.train.torch.config`` (2.60), by name (:func:`_in_ray_torch`).
_RAY_TORCH_NAMES = (
    "TorchConfigContextManager",
    "_set_torch_distributed_env_vars",
    "_setup_torch_process_group",
    "_shutdown_torch",
)


def torch_config(backend: str, init_method: str):
    """The ``backend_config`` of a ``"gloo"`` or ``"nccl"`` process group formed by
    ``init_method`` (``"env"`` or ``"tcp"``), whose controller and driver need not import
    torch. Ray's own ``TorchConfig`` where one of the names it sends is not as read in 2.60."""
    cls = __getattr__(_NAMES[0])
    if cls is None or not _ray_defines(_RAY_TORCH_NAMES):
        from ray.train.torch import config as ray_torch

        return ray_torch.TorchConfig(backend=backend, init_method=init_method)
    return cls(backend=backend, init_method=init_method)


@functools.cache
def _ray_defines(names: tuple[str, ...]) -> bool:
    """Whether Ray's ``ray.train.torch.config`` defines every one of ``names``, read from
    its source (once a process): importing it would import torch, what this module spares
    the driver."""
    import ast
    from pathlib import Path

    import ray.train

    source = Path(ray.train.__file__).parent / "torch" / "config.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError):
        return False
    defined = {
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    return set(names) <= defined


def _in_ray_torch(name: str, *args, **kwargs):
    """On a worker: Ray's ``ray.train.torch.config.<name>(...)``."""
    from ray.train.torch import config as ray_torch

    return getattr(ray_torch, name)(*args, **kwargs)


def _set_master(addr: str, port: int) -> None:
    """On a worker: where rank 0's store listens, for ``init_method="env"`` (as Ray's)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)


class TorchDeviceContext:
    """The train function's context on each worker: Ray's own (it sets the worker's default
    CUDA device)."""

    def __enter__(self):
        return _in_ray_torch("TorchConfigContextManager").__enter__()

    def __exit__(self, *exc_info) -> bool:
        return False


def _start(worker_group, config) -> None:
    """In the controller, once the workers are up: Ray 2.60's ``_TorchBackend.on_start``."""
    import ray
    from ray.train._internal.utils import get_address_and_port

    addr, port = worker_group.execute_single(0, get_address_and_port)
    if config.init_method == "env":
        worker_group.execute(_set_master, addr, port)
        url = "env://"
    elif config.init_method == "tcp":
        url = f"tcp://[{addr}]:{port}" if ":" in addr else f"tcp://{addr}:{port}"
    else:
        raise ValueError(f"init_method must be 'env' or 'tcp', not {config.init_method!r}")
    worker_group.execute(_in_ray_torch, "_set_torch_distributed_env_vars")
    size = len(worker_group)
    setups = [
        worker_group.execute_single_async(
            rank,
            _in_ray_torch,
            "_setup_torch_process_group",
            backend=config.backend,
            world_rank=rank,
            world_size=size,
            init_method=url,
            timeout_s=config.timeout_s,
        )
        for rank in range(size)
    ]
    ray.get(setups)


def _shut_down(worker_group) -> None:
    """In the controller, before the workers go: Ray 2.60's ``_TorchBackend.on_shutdown``."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.train.constants import (
        DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    )

    futures = worker_group.execute_async(
        _in_ray_torch, "_shutdown_torch", destroy_process_group=len(worker_group) > 1
    )
    timeout = int(
        os.environ.get(
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
        )
    )
    try:
        ray.get(futures, timeout=timeout)
    except GetTimeoutError:
        logging.getLogger(__name__).warning(
            "torch process group shutdown timed out after %s seconds", timeout
        )


def _classes() -> dict[str, type] | None:
    import dataclasses

    try:
        from ray.train.backend import Backend, BackendConfig
        from ray.train.v2._internal.util import TrainingFramework
    except ImportError:
        return None

    @dataclasses.dataclass
    class TorchConfigOnWorkers(BackendConfig):  # TorchConfig's fields, as in 2.60
        backend: str = "gloo"
        init_method: str = "env"
        timeout_s: int = 1800

        backend_cls = property(lambda self: __getattr__(_NAMES[1]))
        train_func_context = property(lambda self: TorchDeviceContext)
        framework = property(lambda self: TrainingFramework.TORCH)  # Ray's run records

        def to_dict(self) -> dict[str, Any]:
            return dataclasses.asdict(self)

    class TorchBackendOnWorkers(Backend):
        share_cuda_visible_devices = True  # as Ray's: a node's ranks see each other's GPUs

        def on_start(self, worker_group, backend_config) -> None:
            _start(worker_group, backend_config)

        def on_shutdown(self, worker_group, backend_config) -> None:
            _shut_down(worker_group)

    classes = {}
    for cls in (TorchConfigOnWorkers, TorchBackendOnWorkers):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
        classes[cls.__name__] = cls
    return classes


def __getattr__(name: str) -> Any:
    """The config and backend classes, built when first asked for (by name, by pickle too)."""
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    classes = _classes()
    if classes is None:
        return None
    globals().update(classes)
    return classes[name]
