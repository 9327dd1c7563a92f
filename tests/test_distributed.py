"""DDP on real Ray workers (Gloo, CPU) against single-process PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from raytrain_mnist.config import TrainConfig
from raytrain_mnist.loop import (BatchedTensorDataset, build_optimizer, evaluate,
                                 make_train_loader, set_epoch, shard, train_one_epoch)
from raytrain_mnist.model import ConvNet, normalize

GLOBAL_BATCH, SEED = 16, 7
CFG = TrainConfig(lr=0.05, momentum=0.9, weight_decay=1e-3, schedule="constant", seed=SEED)


def _fit(ray_local, func, num_workers, config):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(func, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=num_workers),
                           run_config=RunConfig(storage_path=config["storage"]))
    return trainer.fit()


def _one_ddp_step(config):
    """One optimizer step through the product's own loader, DDP wrapper and train step."""
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    images, labels = config["images"], config["labels"]
    world = ray.train.get_context().get_world_size()
    torch.manual_seed(SEED)
    model = ray.train.torch.prepare_model(ConvNet())
    loader = ray.train.torch.prepare_data_loader(
        make_train_loader(images, labels, GLOBAL_BATCH // world, SEED))
    set_epoch(loader, 0, SEED)  # the product's own epoch seeding
    optimizer, scheduler = build_optimizer(model, CFG, len(loader))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    import contextlib
    train_one_epoch(model, loader, optimizer, scheduler, scaler, contextlib.nullcontext(),
                    torch.device("cpu"))
    params = [p.detach().numpy().copy() for p in model.module.parameters()]  # no tensors back
    everyone = [None] * world
    dist.all_gather_object(everyone, params)
    return everyone


def test_one_ddp_step_on_two_workers_matches_one_single_process_step(ray_local, tmp_path,
                                                                    sample_digits):
    images = torch.from_numpy(sample_digits[0][:GLOBAL_BATCH].copy())
    labels = torch.from_numpy(sample_digits[1][:GLOBAL_BATCH].copy())
    result = _fit(ray_local, _one_ddp_step, 2,
                  {"images": images, "labels": labels, "storage": str(tmp_path)})
    rank0, rank1 = result.return_value

    # The same global batch in one process. BatchNorm normalises each replica's half with
    # that half's statistics (SyncBatchNorm, which would share them, is GPU-only), so the
    # single-process step runs the two halves DDP's sampler picked and averages their
    # gradients: exactly the gradient DDP's all-reduce computes.
    torch.manual_seed(SEED)
    model = ConvNet()
    optimizer, _ = build_optimizer(model, CFG, 1)
    dataset = BatchedTensorDataset(images, labels)
    optimizer.zero_grad()
    for rank in range(2):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=SEED)
        sampler.set_epoch(0)
        x, y = dataset.__getitems__(list(sampler))
        (F.cross_entropy(model(normalize(x)), y) / 2).backward()
    optimizer.step()

    torch.manual_seed(SEED)
    initial = list(ConvNet().parameters())
    for p0, p1, reference, start in zip(rank0, rank1, model.parameters(), initial):
        p0, p1 = torch.from_numpy(p0), torch.from_numpy(p1)
        assert torch.equal(p0, p1), "the two replicas diverged"
        torch.testing.assert_close(p0, reference.detach(), rtol=1e-5, atol=1e-6)
        assert not torch.equal(p0, start.detach()), "the step did not move the weights"


def _evaluate_on_workers(config):
    import ray.train

    ctx = ray.train.get_context()
    torch.manual_seed(0)
    metrics = evaluate(ConvNet(), config["images"], config["labels"], torch.device("cpu"),
                       rank=ctx.get_world_rank(), world_size=ctx.get_world_size())
    return metrics


def test_distributed_evaluation_counts_every_test_image_exactly_once(ray_local, tmp_path,
                                                                     sample_digits):
    # 203 images on 3 workers: shards of 68, 68 and 67, where a DistributedSampler would pad
    # the last with a repeated image. (Two workers and 203 images: every test of fit.)
    n, num_workers = 203, 3
    images = torch.from_numpy(sample_digits[0][:n].copy())
    labels = torch.from_numpy(sample_digits[1][:n].copy())
    result = _fit(ray_local, _evaluate_on_workers, num_workers,
                  {"images": images, "labels": labels, "storage": str(tmp_path)})
    torch.manual_seed(0)
    single = evaluate(ConvNet(), images, labels, torch.device("cpu"))
    assert result.return_value["val_total"] == single["val_total"] == n
    assert result.return_value["val_accuracy"] == pytest.approx(single["val_accuracy"], abs=0)
    assert result.return_value["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)


@pytest.mark.parametrize("n, world", [(203, 1), (203, 2), (203, 3), (10000, 7), (5, 8)])
def test_shards_cover_every_index_once(n, world):
    covered = [i for rank in range(world) for i in range(n)[shard(n, rank, world)]]
    assert covered == list(range(n))
