"""The GPU path: workers sharing a GPU, GPU-resident data, NCCL, SyncBatchNorm, fp16 and bf16.

The first tests run everywhere (flag validation, fractional GPU counting, the trainer's
request, the refusal on a machine without GPUs). The rest need CUDA and full MNIST and are
skipped without them; `bash benchmarks/gpu_check.sh` runs them on a GPU machine (docs/gpu.md).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from raytrain_mnist.config import RunSettings
from raytrain_mnist.driver import cluster
from tests.conftest import REPO, run_cli, run_cli_here

# --------------------------------------------------------------------------- everywhere


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gpus-per-worker", "0.5"], "--gpus-per-worker needs --use-gpu"),
        (["--use-gpu", "--gpus-per-worker", "1.5"], "--gpus-per-worker must be in (0, 1]"),
        (["--use-gpu", "--gpus-per-worker", "0"], "--gpus-per-worker must be in (0, 1]"),
        (["--use-gpu", "--gpus-per-worker", "nan"], "--gpus-per-worker must be in (0, 1]"),
        (["--use-gpu", "--gpus-per-worker", "0.00001"], "at most 4 decimals"),
        (
            ["--use-gpu", "--num-workers", "2", "--gpus-per-worker", "0.5", "--backend", "nccl"],
            "--backend nccl cannot run workers that share a GPU",
        ),
    ],
)
def test_gpus_per_worker_is_validated_in_one_line(flags, message):
    result = run_cli_here("fit", *flags)
    assert result.returncode == 2, result
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "settings, backend",
    [
        ({}, "gloo"),
        ({"use_gpu": True}, "nccl"),
        ({"use_gpu": True, "gpus_per_worker": 2}, "nccl"),
        ({"use_gpu": True, "num_workers": 4, "gpus_per_worker": 0.25}, "gloo"),
        ({"use_gpu": True, "backend": "gloo"}, "gloo"),
    ],
)
def test_auto_backend_is_gloo_when_workers_share_a_gpu(settings, backend):
    run = RunSettings.from_flags(**settings)
    assert run.resolved_backend == backend
    assert run.backend_description.lower().startswith(backend)
    if run.scaling.shares_gpus:
        assert "share a GPU" in run.backend_description


def test_fractional_gpus_are_counted_per_device():
    assert cluster.gpu_workers(1, 0.25) == 4
    assert cluster.gpu_workers(1, 0.3) == 3
    assert cluster.gpu_workers(2, 0.4) == 4  # a worker's share never spans two GPUs
    assert cluster.gpu_workers(1, 0.1) == 10  # 1 // 0.1 is 9.0 in floating point
    assert cluster.gpu_workers(8, 2) == 4 and cluster.gpu_workers(3, 2) == 1
    assert cluster.gpu_workers(0, 0.5) == 0
    node = {"CPU": 16, "GPU": 1}
    request = cluster.Request(4, 4, True, gpus_per_worker=0.25)
    assert cluster.placeable_workers([node], request) == 4
    assert cluster.placeable_workers([node], cluster.Request(4, 4, True)) == 1
    assert cluster.placeable_workers([node], cluster.Request(4, 8, True, 0, 0.25)) == 2
    run = RunSettings.from_flags(num_workers=4, use_gpu=True, gpus_per_worker=0.25)
    assert cluster.Request.for_run(run, 4) == request


def test_the_trainer_asks_for_fractional_gpus_and_gloo(tmp_path):
    from raytrain_mnist.driver.trainer import build_trainer

    run = RunSettings.from_flags(num_workers=4, use_gpu=True, gpus_per_worker=0.25)
    trainer = build_trainer(run, lambda config: None, {}, 2, str(tmp_path), "gpu-request")
    scaling = trainer.scaling_config
    assert scaling.use_gpu and scaling.num_workers == 4
    assert scaling._resources_per_worker_not_none == {"CPU": 2, "GPU": 0.25}
    assert trainer.backend_config.backend == "gloo"
    cpu = build_trainer(
        RunSettings.from_flags(num_workers=2),
        lambda config: None,
        {},
        1,
        str(tmp_path),
        "cpu-request",
    )
    assert cpu.scaling_config._resources_per_worker_not_none == {"CPU": 1}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without GPUs")
def test_shared_gpu_workers_are_refused_within_seconds_without_gpus(tmp_path):
    started = time.monotonic()
    result = run_cli(
        "fit",
        "--use-gpu",
        "--num-workers",
        "4",
        "--gpus-per-worker",
        "0.25",
        "--dataset",
        "sample",
        "--storage-path",
        str(tmp_path),
        timeout=60,
    )
    assert time.monotonic() - started < 30
    assert result.returncode != 0 and "Traceback" not in result.stderr, result
    assert "--use-gpu asks for 4 GPU worker(s)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------- on a GPU


def _mnist_dir() -> Path | None:
    """Full MNIST, gzipped or not: $RAYTRAIN_MNIST_DATA, the bundle's data/mnist-gz, or
    ../shared/data/mnist."""
    from raytrain_mnist.data import find_raw_dir

    for candidate in (
        os.environ.get("RAYTRAIN_MNIST_DATA"),
        REPO / "data" / "mnist-gz",
        REPO.parent / "shared" / "data" / "mnist",
    ):
        if candidate and Path(candidate).is_dir() and find_raw_dir(Path(candidate)):
            return Path(candidate)
    return None


MNIST = _mnist_dir()
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or MNIST is None,
    reason="needs a CUDA device and full MNIST: run `bash benchmarks/gpu_check.sh` on a GPU "
    "machine (docs/gpu.md)",
)


@pytest.fixture(scope="module")
def gpu_ray():
    """One local Ray for every fit below (each would otherwise start its own)."""
    import ray

    from tests.conftest import kept_ray

    with kept_ray("gpu_ray"):
        ray.init(
            address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False
        )
        yield ray
        ray.shutdown()


def _fit(tmp_path_factory, name: str, epochs: int = 2, **settings) -> dict:
    from raytrain_mnist.config import FitConfig, TrainConfig
    from raytrain_mnist.driver.fitting import fit

    train = {k: settings.pop(k) for k in ("amp", "sync_bn") if k in settings}
    cfg = FitConfig(
        TrainConfig(epochs=epochs, **train),
        RunSettings.from_flags(
            use_gpu=True,
            dataset="mnist",
            data_dir=str(MNIST),
            storage_path=str(tmp_path_factory.mktemp("gpu-runs")),
            name=name,
            **settings,
        ),
    )
    started = time.monotonic()
    summary = fit(cfg).summary
    print(
        f"{name}: {100 * summary['val_accuracy']:.2f} % in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
    )
    return summary


@pytest.fixture(scope="module")
def one_worker_nccl(gpu_ray, tmp_path_factory) -> dict:
    return _fit(tmp_path_factory, "gpu-1w-nccl", num_workers=1, backend="nccl")


@needs_gpu
def test_cpu_and_gpu_loaders_give_the_same_batches():
    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.worker.loop import make_train_loader, set_epoch, to_device

    data = load_mnist(MNIST, "mnist")
    on_gpu = to_device(data, torch.device("cuda"))
    assert on_gpu.train_images.is_cuda and on_gpu.test_labels.is_cuda
    loaders = [
        make_train_loader(d.train_images, d.train_labels, 128, seed=3) for d in (data, on_gpu)
    ]
    for loader in loaders:
        set_epoch(loader, 1, 3)
    for step, ((x, y), (gx, gy)) in enumerate(zip(*loaders, strict=False)):
        assert gx.is_cuda and gx.dtype == torch.uint8
        assert torch.equal(x, gx.cpu()) and torch.equal(y, gy.cpu())
        if step == 20:
            break


@needs_gpu
def test_one_worker_with_nccl_reaches_99_percent_in_two_epochs(one_worker_nccl):
    summary = one_worker_nccl
    assert summary["status"] == "finished"
    assert summary["val_accuracy"] >= 0.990, summary["history"]
    assert summary["val_total"] == 10000
    (worker,) = summary["workers"]
    assert worker["device"].startswith("cuda") and worker["backend"] == "nccl"


@needs_gpu
def test_two_workers_share_the_gpu_with_sync_batchnorm(gpu_ray, tmp_path_factory):
    summary = _fit(
        tmp_path_factory, "gpu-2w-shared", num_workers=2, gpus_per_worker=0.5, sync_bn="on"
    )
    assert summary["val_accuracy"] >= 0.990, summary["history"]
    assert summary["val_total"] == 10000
    workers = summary["workers"]
    assert len(workers) == 2
    assert {(w["node_id"], w["device"], w["backend"]) for w in workers} == {
        (workers[0]["node_id"], "cuda:0", "gloo")
    }, workers


@needs_gpu
@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_mixed_precision_trains_on_the_gpu(gpu_ray, tmp_path_factory, amp):
    from raytrain_mnist.nn import checkpoint as ckpt

    summary = _fit(tmp_path_factory, f"gpu-{amp}", epochs=1, num_workers=1, amp=amp)
    (epoch,) = summary["history"]
    assert epoch["train_loss"] < 0.5 and epoch["val_loss"] < epoch["train_loss"], epoch
    assert summary["val_accuracy"] > 0.98, epoch
    state = ckpt.load(summary["latest_checkpoint"])
    assert state["config"]["amp"] == amp
    if amp == "fp16":  # the scaler was on, and its state is in the checkpoint
        assert 0 < state["scaler"]["scale"] <= 2.0**16
    else:
        assert state["scaler"] == {}  # bf16 needs no loss scaling


@needs_gpu
def test_evaluate_on_the_gpu_reproduces_fits_accuracy(one_worker_nccl, tmp_path):
    from raytrain_mnist.config import RunSettings
    from raytrain_mnist.driver.evaluation import evaluate_checkpoint

    report = evaluate_checkpoint(
        one_worker_nccl["run_dir"],
        out=tmp_path / "evaluation",
        workers=RunSettings.from_flags(num_workers=1, use_gpu=True),
    ).to_dict()
    assert report["test_size"] == 10000
    # cuDNN may pick other kernels in another process: allow one image of difference.
    assert abs(report["accuracy"] - report["reported_val_accuracy"]) <= 1e-4, report


def test_the_gpu_benchmark_runs_its_seeds_and_steps_on_cpu(tmp_path):
    """benchmarks/gpu.py's code path, on CPU with 1,024 digits of the sample (--cpu-dry-run):
    the plain loop over two seeds, their spread and the step table land in gpu.json and
    gpu.md (the figures mean nothing here; a lent GPU machine runs it for real: docs/gpu.md)."""
    import json
    import subprocess

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu",
            "--data-dir",
            str(tmp_path / "no-mnist"),
            "--cpu-dry-run",
            "--variants",
            "plain",
            "--seeds",
            "2",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode in (0, 1), result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert [r["seed"] for r in report["seed_runs"]] == [0, 1]
    assert report["seeds"]["seeds"] == 2 and report["settings"]["epochs"] == 1
    accuracy = report["seeds"]["final_accuracy"]
    # Eight steps on 1,024 digits reach about 40-55 %: above 30 % (chance: 10 %), it learned.
    assert 0.3 < accuracy["min"] <= accuracy["mean"] <= accuracy["max"] <= 1
    steps = report["variants"]["plain"]["steps"]
    assert {"Python, imports, flags", "training and evaluation"} <= set(steps)
    assert abs(steps["unaccounted"]) < 0.01, steps
    assert set(report["checks"]) >= {"plain ran"} and "fit-1 ran" not in report["checks"]
    markdown = (tmp_path / "gpu.md").read_text()
    assert "over 2 seeds" in markdown and "| training and evaluation | ours |" in markdown
