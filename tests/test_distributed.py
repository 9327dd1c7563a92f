"""DDP on real Ray workers (Gloo, CPU) against single-process PyTorch."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from raytrain_mnist import compat
from raytrain_mnist.config import TrainConfig
from raytrain_mnist.driver import cluster
from raytrain_mnist.nn.model import ConvNet, normalize
from raytrain_mnist.nn.optim import build_optimizer
from raytrain_mnist.nn.score import evaluate, shard
from raytrain_mnist.worker.loop import (
    BatchedTensorDataset,
    make_train_loader,
    set_epoch,
    train_one_epoch,
)

WORLD, GLOBAL_BATCH, SEED = 3, 24, 7
TEST_SIZE = 203  # not a multiple of 3: a DistributedSampler would pad the last shard
CFG = TrainConfig(
    optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=1e-3, schedule="constant", seed=SEED
)


def _on_each_worker(config):
    """One optimizer step through the product's own loader, DDP wrapper and train step, then
    the product's sharded evaluation of an untouched model; every rank's weights come back."""
    import contextlib
    import os

    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    ctx = ray.train.get_context()
    world = ctx.get_world_size()
    torch.manual_seed(SEED)
    model = ray.train.torch.prepare_model(ConvNet())
    loader = ray.train.torch.prepare_data_loader(
        make_train_loader(config["images"], config["labels"], GLOBAL_BATCH // world, SEED)
    )
    set_epoch(loader, 0, SEED)  # the product's own epoch seeding
    optimizer, scheduler = build_optimizer(model, CFG, len(loader))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    train_one_epoch(
        model, loader, optimizer, scheduler, scaler, contextlib.nullcontext(), torch.device("cpu")
    )
    params = [p.detach().numpy().copy() for p in model.module.parameters()]  # no tensors back
    everyone = [None] * world
    dist.all_gather_object(everyone, params)

    torch.manual_seed(0)
    metrics = evaluate(
        ConvNet(),
        config["test_images"],
        config["test_labels"],
        torch.device("cpu"),
        rank=ctx.get_world_rank(),
        world_size=world,
    )
    # How the group was formed: TCP init leaves no MASTER_ADDR (env:// reads it).
    formed = (dist.get_backend(), dist.get_world_size(), os.environ.get("MASTER_ADDR"))
    return {"params": everyone, "eval": metrics, "formed": formed}


@pytest.fixture(scope="module")
def on_three_workers(ray_local, tmp_path_factory, sample_digits) -> dict:
    """One 3-worker TorchTrainer run of the product's step and evaluation (~20 s of start-up
    shared by the tests below), with the data it used. Its process group is the product's
    (compat.torch_config), formed by TCP init: the tutorial's other way (every fit uses env)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    images, labels = (torch.from_numpy(a.copy()) for a in sample_digits)
    data = {
        "images": images[:GLOBAL_BATCH],
        "labels": labels[:GLOBAL_BATCH],
        "test_images": images[-TEST_SIZE:],
        "test_labels": labels[-TEST_SIZE:],
    }
    trainer = TorchTrainer(
        _on_each_worker,
        train_loop_config=data,
        torch_config=compat.torch_config("gloo", "tcp"),
        scaling_config=ScalingConfig(num_workers=WORLD),
        run_config=RunConfig(storage_path=str(tmp_path_factory.mktemp("ddp"))),
    )
    with cluster.keeping_sigint_handler():  # as the product's evaluate does
        return {**data, **trainer.fit().return_value}


def test_one_ddp_step_on_three_workers_matches_one_single_process_step(on_three_workers):
    # The same global batch in one process. BatchNorm normalises each replica's third with
    # that third's statistics (SyncBatchNorm, which would share them, is GPU-only), so the
    # single-process step runs the thirds DDP's sampler picked and averages their gradients:
    # exactly the gradient DDP's all-reduce computes.
    torch.manual_seed(SEED)
    model = ConvNet()
    optimizer, _ = build_optimizer(model, CFG, 1)
    dataset = BatchedTensorDataset(on_three_workers["images"], on_three_workers["labels"])
    optimizer.zero_grad()
    for rank in range(WORLD):
        sampler = DistributedSampler(
            dataset, num_replicas=WORLD, rank=rank, shuffle=True, seed=SEED
        )
        sampler.set_epoch(0)
        x, y = dataset.__getitems__(list(sampler))
        (F.cross_entropy(model(normalize(x)), y) / WORLD).backward()
    optimizer.step()

    torch.manual_seed(SEED)
    initial = list(ConvNet().parameters())
    replicas = [
        [torch.from_numpy(p.copy()) for p in params] for params in on_three_workers["params"]
    ]
    for params in replicas[1:]:
        assert all(torch.equal(a, b) for a, b in zip(replicas[0], params, strict=False)), (
            "replicas diverged"
        )
    # The step DDP took is the single-process step up to float rounding: sums in another
    # order (the all-reduce, conv kernels split over threads) move a few weights by ~1e-5,
    # while a wrong step (a summed instead of averaged gradient, say) is off by its own size.
    step = torch.cat(
        [(p - s.detach()).flatten() for p, s in zip(replicas[0], initial, strict=True)]
    )
    expected = torch.cat(
        [(p - s).detach().flatten() for p, s in zip(model.parameters(), initial, strict=True)]
    )
    assert expected.norm() > 0, "the step did not move the weights"
    assert (step - expected).norm() <= 1e-4 * expected.norm()
    assert on_three_workers["formed"] == ("gloo", WORLD, None)  # by TCP init, as asked


def test_distributed_evaluation_counts_every_test_image_exactly_once(on_three_workers):
    # Shards of 68, 68 and 67 images. (Two workers and 203 images: every test of fit.)
    torch.manual_seed(0)
    single = evaluate(
        ConvNet(),
        on_three_workers["test_images"],
        on_three_workers["test_labels"],
        torch.device("cpu"),
    )
    sharded = on_three_workers["eval"]
    assert sharded["val_total"] == single["val_total"] == TEST_SIZE
    assert sharded["val_accuracy"] == pytest.approx(single["val_accuracy"], abs=0)
    assert sharded["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)


@pytest.mark.parametrize("n, world", [(203, 1), (203, 2), (203, 3), (10000, 7), (5, 8)])
def test_shards_cover_every_index_once(n, world):
    covered = [i for rank in range(world) for i in range(n)[shard(n, rank, world)]]
    assert covered == list(range(n))


_FAULTS_PER_STEP = """
import resource, threading, torch, torch.nn.functional as F
from raytrain_mnist.worker.loop import keep_freed_memory
from raytrain_mnist.nn.model import ConvNet, normalize
torch.set_num_threads(1)
model, images = ConvNet(), torch.randint(0, 256, (128, 28, 28), dtype=torch.uint8)
labels = torch.randint(0, 10, (128,))
def faults_per_step(steps=8):
    for _ in range(2):  # warm-up: glibc settles its thresholds
        F.cross_entropy(model(normalize(images)), labels).backward()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        F.cross_entropy(model(normalize(images)), labels).backward()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps
def measure():  # off the main thread, like Ray Train's loop: its own malloc arena
    default = faults_per_step()
    applied = keep_freed_memory()
    print(default, faults_per_step(), applied)
thread = threading.Thread(target=measure)
thread.start()
thread.join()
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's malloc only")
def test_keep_freed_memory_stops_each_step_from_faulting_its_activations_back_in():
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS_PER_STEP], capture_output=True, text=True, check=True
    ).stdout
    default, kept, applied = out.split()
    assert applied == "True", f"mallopt refused a setting: {out}"
    default, kept = float(default), float(kept)
    assert default > 200, f"expected the default allocator to re-fault activations: {out}"
    assert kept < default / 4, out


# --------------------------------------------------------------------------- data order per epoch

ORDER_SIZE, ORDER_BATCH, ORDER_SEED, EPOCHS = 48, 12, 3, 4


def _as_prepared(loader, rank: int, world: int):
    """What ray.train.torch.prepare_data_loader makes of ``loader`` on rank ``rank`` of
    ``world`` (train_loop_utils' with_sampler): unchanged on one worker; otherwise the same
    loader rebuilt around a DistributedSampler with Ray's defaults (shuffle, seed 0)."""
    from torch.utils.data import DataLoader

    if world == 1:
        return loader
    return DataLoader(
        dataset=loader.dataset,
        batch_size=loader.batch_size,
        shuffle=False,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        sampler=DistributedSampler(loader.dataset, num_replicas=world, rank=rank, shuffle=True),
    )


def _worker_loader(rank: int, world: int):
    """A worker's training loader as the loop builds it; the labels are the sample indices."""
    images = torch.zeros(ORDER_SIZE, 28, 28, dtype=torch.uint8)
    labels = torch.arange(ORDER_SIZE)
    loader = make_train_loader(images, labels, ORDER_BATCH // world, ORDER_SEED)
    return _as_prepared(loader, rank, world)


def _epoch_order(loader, epoch: int) -> list[int]:
    set_epoch(loader, epoch, ORDER_SEED)
    return [int(i) for _, labels in loader for i in labels]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_epoch_has_a_new_order_and_a_resumed_run_sees_the_same_orders(world):
    """Forgetting set_epoch (the tutorials' classic bug) repeats one order every epoch, and a
    run resumed from a checkpoint replays the first epoch's order: both are caught here."""
    loaders = [_worker_loader(rank, world) for rank in range(world)]
    uninterrupted = [[_epoch_order(loader, epoch) for loader in loaders] for epoch in range(EPOCHS)]
    for epoch in range(1, EPOCHS):
        for rank in range(world):
            assert uninterrupted[epoch][rank] != uninterrupted[epoch - 1][rank], (
                f"rank {rank} sees epoch {epoch}'s order again in epoch {epoch + 1}"
            )
    for epoch in range(EPOCHS):  # the ranks split each epoch: every index at most once
        seen = [i for rank in range(world) for i in uninterrupted[epoch][rank]]
        assert len(seen) == len(set(seen)) == ORDER_SIZE // ORDER_BATCH * ORDER_BATCH

    # A run that stopped after epoch 2 and resumes: new processes, new loaders.
    resumed_from = 2
    restarted = [_worker_loader(rank, world) for rank in range(world)]
    resumed = [
        [_epoch_order(loader, epoch) for loader in restarted]
        for epoch in range(resumed_from, EPOCHS)
    ]
    assert resumed == uninterrupted[resumed_from:]
