"""The benchmark's training variants, each run as its own process by ``compare.py``.

Every variant trains the same ConvNet on the same data with the same global batch size,
optimizer and thread budget, evaluates after each epoch, and prints one JSON line
``RESULT {...}`` with per-epoch throughput, training seconds, CPU seconds per step and the
wall time at which each evaluation ended, and the time of the first optimizer step (both in
seconds since the command started, read from ``BENCH_T0``): the same end points
``raytrain_mnist.fit`` records in its history.

    python -m benchmarks.variants plain      --data-dir D --epochs 2 --batch-size 128 --threads 2
    python -m benchmarks.variants plain      --data-dir D --device cuda   (GPU-resident data)
    python -m benchmarks.variants plain      --data-dir D --compile       (fit's --compile)
    torchrun --nproc_per_node 2 -m benchmarks.variants torchrun --data-dir D ...
    python -m benchmarks.variants ray_example --data-dir D --workers 2 ...
"""

from __future__ import annotations

import argparse
import json
import os
import time


def _t0() -> float:
    return float(os.environ.get("BENCH_T0", _STARTED))


def _now() -> float:
    return time.time() - _t0()


_STARTED = time.time()


def _emit(epochs: list[dict], first_step_s: float, moments: dict | None = None) -> None:
    """``moments``: seconds since the command started at which the imports were done, the
    data loaded and the model prepared (compare.py's start-up table)."""
    result = {"epochs": epochs, "first_step_s": first_step_s, "moments": moments or {}}
    print("RESULT " + json.dumps(result), flush=True)


def _product_loop(args, rank: int = 0, world: int = 1, sampler=None) -> None:
    """Plain PyTorch around the product's own loader, train step and evaluation; on a GPU
    with the data resident there, as in a fit worker: the batches made on the device and,
    unless --cuda-graphs off, the whole step captured in one CUDA graph."""
    import torch

    from raytrain_mnist.config import TrainConfig
    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.nn.score import evaluate
    from raytrain_mnist.worker.batches import set_epoch
    from raytrain_mnist.worker.setup import keep_freed_memory, set_up_cudnn, to_device
    from raytrain_mnist.worker.training import as_is, prepare_training

    moments = {"imported_s": _now()}
    keep_freed_memory()  # part of the product's training path, as in every fit worker
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        set_up_cudnn()  # as fit's workers do
    # fit's default recipe (optimizer, schedule, label smoothing, shifts) at these sizes.
    cfg = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, seed=args.seed)
    data = to_device(load_mnist(args.data_dir, args.dataset), device)
    moments["data_loaded_s"] = _now()
    wrap_model, wrap_loader = as_is, as_is
    if world > 1:  # torchrun's DDP and sampler where a fit worker has Ray's
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DataLoader, DistributedSampler

        def wrap_loader(loader):
            sampler = DistributedSampler(loader.dataset, seed=cfg.seed)
            return DataLoader(
                loader.dataset,
                batch_size=loader.batch_size,
                drop_last=True,
                collate_fn=tuple,
                sampler=sampler,
            )

        wrap_model = DistributedDataParallel
    # The very training a fit worker prepares (the model, optimizer, schedule, scaler,
    # autocast; on a GPU the device steps, captured unless --cuda-graphs off).
    training = prepare_training(
        cfg,
        data,
        device,
        world,
        args.compile,
        args.cuda_graphs,
        prepare_model=wrap_model,
        prepare_data_loader=wrap_loader,
    )
    loader, module = training.loader, training.module
    moments["model_prepared_s"] = _now()
    epochs, first_step = [], None
    for epoch in range(cfg.epochs):
        set_epoch(loader, epoch, cfg.seed)
        started, started_at = time.perf_counter(), time.time()
        train = training.train_one_epoch()
        seconds = time.perf_counter() - started
        if first_step is None:
            first_step = train["first_step_at"] - _t0()
        with torch.compiler.set_stance("force_eager"):  # as fit evaluates (a no-op eager)
            val = evaluate(
                module, data.test_images, data.test_labels, device, rank=rank, world_size=world
            )
        epochs.append(
            {
                "images_per_s": train["train_images"] / seconds,
                "train_s": seconds,
                # The epoch's first step (with --compile, the compilation) and the rest.
                "first_step_in_epoch_s": train["first_step_at"] - started_at,
                "steps": train["train_steps"],
                "cpu_s_per_step": train["cpu_s"] / train["train_steps"],
                # The warm-up and capture of a captured step (its first epoch's first step).
                "capture_s": training.steps.prepare_s,
                "step": "captured" if training.captured else "eager",
                "val_accuracy": val["val_accuracy"],
                "eval_done_s": _now(),
            }
        )
    if rank == 0:
        _emit(epochs, first_step, moments)


def plain(args) -> None:
    _product_loop(args)


def torchrun(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        _product_loop(args, dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()


def _ray_example_worker(config: dict) -> None:
    """Ray's documented pattern: a torchvision dataset with per-sample ToTensor/Normalize,
    a plain DataLoader, prepare_model and prepare_data_loader."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    from raytrain_mnist.nn.model import MNIST_MEAN, MNIST_STD, ConvNet

    torch.set_num_threads(config["threads"])
    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))]
    )
    train = datasets.MNIST(config["data_dir"], train=True, transform=transform)
    test = datasets.MNIST(config["data_dir"], train=False, transform=transform)
    world = ray.train.get_context().get_world_size()
    train_loader = ray.train.torch.prepare_data_loader(
        DataLoader(train, batch_size=config["batch_size"] // world, shuffle=True)
    )
    test_loader = ray.train.torch.prepare_data_loader(DataLoader(test, batch_size=1000))
    model = ray.train.torch.prepare_model(ConvNet())
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config["lr"], momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=config["lr"],
        total_steps=config["epochs"] * len(train_loader),
        pct_start=0.25,
    )
    epochs, first_step = [], None
    for epoch in range(config["epochs"]):
        if world > 1:
            train_loader.sampler.set_epoch(epoch)
        model.train()
        started, seen = time.perf_counter(), 0
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            seen += len(y)
            if first_step is None:
                first_step = _now()
        seconds = time.perf_counter() - started
        model.eval()
        correct = total = 0
        with torch.no_grad():  # the documented pattern: each rank scores its padded shard
            for x, y in test_loader:
                correct += (model(x).argmax(1) == y).sum().item()
                total += len(y)
        epochs.append(
            {
                "images_per_s": seen * world / seconds,
                "train_s": seconds,
                "val_accuracy": correct / total,
                "eval_done_s": _now(),
            }
        )
        ray.train.report({"epoch": epoch})
    if ray.train.get_context().get_world_rank() == 0:
        _emit(epochs, first_step)


def ray_example(args) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, args.workers * args.threads),
        include_dashboard=False,
        logging_level="WARNING",
    )
    try:
        TorchTrainer(
            _ray_example_worker,
            train_loop_config={
                "data_dir": os.path.abspath(args.data_dir),
                "threads": args.threads,
                "epochs": args.epochs,
                "batch_size": args.batch_size,
                "lr": 0.1,
            },
            scaling_config=ScalingConfig(
                num_workers=args.workers, resources_per_worker={"CPU": args.threads}
            ),
            run_config=RunConfig(storage_path=os.path.abspath(args.storage), name="ray_example"),
        ).fit()
    finally:
        ray.shutdown()


def main() -> None:
    from raytrain_mnist.config import DEFAULT_EPOCHS

    parser = argparse.ArgumentParser()
    parser.add_argument("variant", choices=["plain", "torchrun", "ray_example"])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="plain and torchrun only")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--storage", default="/tmp/raytrain_mnist_bench")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: data resident on the GPU")
    parser.add_argument("--dataset", default="mnist", choices=["mnist", "sample"])
    parser.add_argument(
        "--compile", action="store_true", help="plain and torchrun: torch.compile the ConvNet"
    )
    parser.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=["auto", "off"],
        help="plain on cuda: capture the step in one CUDA graph (auto) or not",
    )
    args = parser.parse_args()
    globals()[args.variant](args)


if __name__ == "__main__":
    main()
