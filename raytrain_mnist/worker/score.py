"""The scoring worker of ``evaluate``: each rank scores its exact shard of the test set."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from raytrain_mnist.nn.model import ConvNet
from raytrain_mnist.nn.score import score
from raytrain_mnist.worker.setup import own_tensor


def score_per_worker(config: dict[str, Any]) -> dict[str, Any] | None:
    """Ray Train worker: score this rank's shard, gather every shard's predictions on rank 0."""
    import numpy as np
    import ray
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(config["cpus_per_worker"])
    device = ray.train.torch.get_device()
    images, labels = (own_tensor(array) for array in ray.get(config["data"]))
    model = ConvNet()
    model.load_state_dict(ray.get(config["weights"]))
    result = score(model.to(device), images, labels, device, config["amp"], rank, world_size)
    shards = [None] * world_size
    # Shards are contiguous and in rank order, so concatenating restores the test order.
    dist.all_gather_object(shards, (result["predictions"], result["confidence"]))
    if rank != 0:
        return None
    result["predictions"] = np.concatenate([p for p, _ in shards])
    result["confidence"] = np.concatenate([c for _, c in shards])
    return result
