"""The GPU path: workers sharing a GPU, GPU-resident data, NCCL, SyncBatchNorm, fp16 and bf16,
batches made on the device and the whole step captured in one CUDA graph.

The first tests run everywhere (flag validation, fractional GPU counting, the trainer's
request, the refusal on a machine without GPUs, which runs capture their step). The rest
need CUDA and full MNIST and are skipped without them; `bash benchmarks/gpu_check.sh` runs
them on a GPU machine (docs/gpu.md). tests/test_device_batches.py proves on the CPU what
the captured step is made of.
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


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cuda-graphs", "on"], "it trains on CPUs (a CUDA graph needs --use-gpu)"),
        (["--use-gpu", "--num-workers", "2", "--gpus-per-worker", "0.5", "--cuda-graphs", "on"],
         "its workers talk over Gloo"),
        (["--use-gpu", "--optimizer", "sgd", "--cuda-graphs", "on"], "not SGD"),
        (["--cuda-graphs", "always"], "invalid choice: 'always'"),
    ],
)  # fmt: skip
def test_cuda_graphs_on_where_the_step_cannot_be_captured_is_one_line(flags, message):
    result = run_cli_here("fit", *flags)
    assert result.returncode == 2, result
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "train, settings, captured",
    [
        ({}, {"use_gpu": True, "num_workers": 1}, True),
        ({}, {"use_gpu": True, "num_workers": 4, "gpus_per_worker": 2}, True),
        ({}, {"use_gpu": True, "num_workers": 2, "gpus_per_worker": 0.5}, False),
        ({}, {"use_gpu": True, "backend": "gloo"}, False),
        ({}, {"use_gpu": True, "cuda_graphs": "off"}, False),
        ({"optimizer": "sgd", "momentum": 0.9}, {"use_gpu": True}, False),
        ({}, {"num_workers": 2}, False),
    ],
)
def test_auto_captures_the_step_where_it_can_and_the_start_line_says_which(
    train, settings, captured
):
    from raytrain_mnist.config import FitConfig, TrainConfig
    from raytrain_mnist.driver.fitting import gpu_text as _gpu_text

    cfg = FitConfig(TrainConfig(**train), RunSettings.from_flags(**settings))
    assert cfg.captures_step is captured
    if settings.get("use_gpu"):
        said = "each step one CUDA graph" if captured else "eager steps"
        assert _gpu_text(cfg).endswith(said)


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
    """The CPU's loader, the GPU-resident data's loader and the batches the GPU path makes
    on the device from the loader's order: the same batches, step for step."""
    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.worker.batches import DeviceBatches
    from raytrain_mnist.worker.loop import make_train_loader, set_epoch, to_device

    data = load_mnist(MNIST, "mnist")
    data, on_gpu = to_device(data, torch.device("cpu")), to_device(data, torch.device("cuda"))
    assert on_gpu.train_images.is_cuda and on_gpu.test_labels.is_cuda
    loaders = [
        make_train_loader(d.train_images, d.train_labels, 128, seed=3)
        for d in (data, on_gpu, on_gpu)
    ]
    for loader in loaders:
        set_epoch(loader, 1, 3)
    made = DeviceBatches(loaders[2], on_gpu.train_images, on_gpu.train_labels)
    made.load_epoch()
    for step, ((x, y), (gx, gy)) in enumerate(zip(*loaders[:2], strict=False)):
        assert gx.is_cuda and gx.dtype == torch.uint8
        assert torch.equal(x, gx.cpu()) and torch.equal(y, gy.cpu())
        dx, dy = made.next()
        assert dx.is_cuda and torch.equal(x, dx.cpu()) and torch.equal(y, dy.cpu())
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
    assert worker["step"] == "captured"  # --cuda-graphs auto: one GPU with NCCL


@needs_gpu
def test_two_workers_share_the_gpu_with_sync_batchnorm(gpu_ray, tmp_path_factory):
    summary = _fit(
        tmp_path_factory, "gpu-2w-shared", num_workers=2, gpus_per_worker=0.5, sync_bn="on"
    )
    assert summary["val_accuracy"] >= 0.990, summary["history"]
    assert summary["val_total"] == 10000
    workers = summary["workers"]
    assert len(workers) == 2
    assert {(w["node_id"], w["device"], w["backend"], w["step"]) for w in workers} == {
        (workers[0]["node_id"], "cuda:0", "gloo", "eager")  # Gloo cannot be captured
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
    report = json.loads((tmp_path / "gpu.json").read_text())
    failed = [name for name, verdict in report["checks"].items() if verdict != "pass"]
    # Its exit says whether every check passed (on CPU the first-step target may be missed).
    assert result.returncode == (1 if failed else 0), (
        failed,
        result.stdout[-2000:] + result.stderr[-2000:],
    )
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


# --------------------------------------------------------------------------- the captured step

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def mnist_on_gpu():
    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.worker.loop import to_device

    return to_device(load_mnist(MNIST, "mnist"), CUDA)


def _gpu_training(cfg, data, captured: bool, train_images: int | None = None):
    """One worker's training on the GPU as the loop assembles it, without Ray (one worker:
    no DDP), on the first ``train_images`` digits."""
    import dataclasses

    from raytrain_mnist.worker.loop import set_up_cudnn
    from raytrain_mnist.worker.step import DeviceSteps
    from raytrain_mnist.worker.training import as_is, prepare_training

    if train_images is not None:
        data = dataclasses.replace(
            data,
            train_images=data.train_images[:train_images],
            train_labels=data.train_labels[:train_images],
        )
    set_up_cudnn()
    training = prepare_training(
        cfg, data, CUDA, capture=captured, prepare_model=as_is, prepare_data_loader=as_is
    )
    assert training.captured is captured and isinstance(training.steps, DeviceSteps)
    return training


def _epochs(training, cfg, data, epochs: int = 1, on_step=None) -> tuple[dict, dict]:
    from raytrain_mnist.worker.loop import set_epoch

    for epoch in range(epochs):
        set_epoch(training.loader, epoch, cfg.seed)
        train = training.train_one_epoch(on_step=on_step)
    val = training.evaluate(data.test_images, data.test_labels, 0, 1)
    return train, val


@needs_gpu
@pytest.mark.parametrize("amp", ["off", "bf16", "fp16"])
def test_a_captured_step_trains_as_the_eager_one_does(mnist_on_gpu, amp):
    """50 steps of fit's recipe, captured and eager: the same training and test loss within
    1e-3 (the captured step's fused AdamW rounds differently, nothing else differs)."""
    from raytrain_mnist.config import TrainConfig

    cfg = TrainConfig(amp=amp)
    results = {}
    for captured in (False, True):
        training = _gpu_training(cfg, mnist_on_gpu, captured, train_images=50 * 128)
        results[captured] = _epochs(training, cfg, mnist_on_gpu)
        assert results[captured][0]["train_steps"] == 50
    (eager_train, eager_val), (graph_train, graph_val) = results[False], results[True]
    assert graph_train["train_loss"] == pytest.approx(eager_train["train_loss"], abs=1e-3)
    assert graph_val["val_loss"] == pytest.approx(eager_val["val_loss"], abs=1e-3)
    assert graph_val["val_accuracy"] > 0.9, graph_val


@needs_gpu
def test_fp16_overflow_still_skips_the_step_inside_the_graph(mnist_on_gpu):
    """A scale so large that every gradient overflows: the replayed step leaves the weights
    and the optimizer's state as they were and halves the scale, in the graph."""
    from raytrain_mnist.config import TrainConfig
    from raytrain_mnist.worker.loop import set_epoch

    cfg = TrainConfig(amp="fp16")
    training = _gpu_training(cfg, mnist_on_gpu, True, train_images=20 * 128)
    set_epoch(training.loader, 0, cfg.seed)
    steps = training.steps.epoch(None)
    for _ in range(13):  # the warm-up and capture, then replays
        next(steps)
    assert training.steps.run.graph is not None
    before = {k: v.clone() for k, v in training.module.named_parameters()}
    moments = [s["exp_avg"].clone() for s in training.optimizer.state.values()]
    scaler = training.scaler
    huge = {**scaler.state_dict(), "scale": 2.0**100}
    scaler.load_state_dict(huge)  # in place: the tensor the graph reads
    next(steps)
    torch.cuda.synchronize()
    for name, value in training.module.named_parameters():
        assert torch.equal(value, before[name]), name
    after = [s["exp_avg"] for s in training.optimizer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, moments, strict=True))
    assert scaler.get_scale() == 2.0**99
    scaler.load_state_dict({**huge, "scale": 1024.0})
    next(steps)  # a finite step moves the weights again
    torch.cuda.synchronize()
    assert any(not torch.equal(v, before[k]) for k, v in training.module.named_parameters())


@needs_gpu
def test_a_captured_run_resumed_mid_epoch_ends_with_the_uninterrupted_weights(
    mnist_on_gpu, tmp_path
):
    """A checkpoint at step 5 of epoch 2 (a preemption's, written between replays) resumes
    in a new graph, captured after the restore, to the uninterrupted run's weights, bit for
    bit: the restore went into the tensors the graph replays, the RNG included."""
    from raytrain_mnist.config import TrainConfig
    from raytrain_mnist.nn import checkpoint as ckpt
    from raytrain_mnist.worker.loop import set_epoch
    from raytrain_mnist.worker.resume import checkpoint_state, restore, resume_point

    cfg = TrainConfig(epochs=2, max_shift=2)
    run = _gpu_training(cfg, mnist_on_gpu, True, train_images=30 * 128)
    set_epoch(run.loader, 0, cfg.seed)
    run.train_one_epoch()

    def at_step_5(steps, sums):
        if steps == 5:
            position = {
                "step": 5,
                "sums": [*sums.tolist(), 0.0],
                "sampler_seed": cfg.seed,
                "sampler_epoch": 1,
                "world_size": 1,
                "kind": "preemption",
            }
            ckpt.save(tmp_path, checkpoint_state(run, cfg, 1, 0.5, [], position))

    set_epoch(run.loader, 1, cfg.seed)
    uninterrupted = run.train_one_epoch(on_step=at_step_5)

    state = ckpt.resumable_state(tmp_path, cfg.to_dict())
    resumed = _gpu_training(cfg, mnist_on_gpu, True, train_images=30 * 128)
    restore(resumed, state)
    start, _ = resume_point(state, rank=0)
    set_epoch(resumed.loader, 1, cfg.seed)
    finished = resumed.train_one_epoch(start=start)
    assert finished["train_loss"] == pytest.approx(uninterrupted["train_loss"], rel=1e-9)
    assert resumed.lr == run.lr
    for name, value in run.module.state_dict().items():
        assert torch.equal(resumed.module.state_dict()[name], value), name


@needs_gpu
def test_captured_and_eager_runs_reach_the_same_accuracy_over_seeds(mnist_on_gpu):
    """One epoch of fit's recipe on full MNIST, seeds 0-2: captured and eager both reach
    99 %, within 0.2 % of each other (20 test digits) on every seed."""
    import dataclasses

    from raytrain_mnist.config import TrainConfig

    for seed in range(3):
        cfg = dataclasses.replace(TrainConfig(), seed=seed)
        accuracy = {
            captured: _epochs(_gpu_training(cfg, mnist_on_gpu, captured), cfg, mnist_on_gpu)[1][
                "val_accuracy"
            ]
            for captured in (False, True)
        }
        print(f"seed {seed}: eager {accuracy[False]:.4f}, captured {accuracy[True]:.4f}")
        assert min(accuracy.values()) >= 0.99, (seed, accuracy)
        assert abs(accuracy[True] - accuracy[False]) <= 0.002, (seed, accuracy)
