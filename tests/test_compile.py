"""``--compile``: the compiled ConvNet trains as the eager one does, its checkpoints are an
eager run's (either resumes the other, evaluate and serve load them), a real compiled `fit`
finishes, and a machine that cannot compile is refused in one line before Ray starts.

torch.compile takes tens of seconds on two cores: one compiled model in-process, one fit."""

from __future__ import annotations

import pytest
import torch

from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig
from raytrain_mnist.data import MnistData
from raytrain_mnist.nn import checkpoint as ckpt
from raytrain_mnist.nn.model import ConvNet
from raytrain_mnist.nn.optim import StepRecipe
from raytrain_mnist.toolchain import compiler_missing
from raytrain_mnist.worker.loop import Training, checkpoint_state, restore, train_step
from raytrain_mnist.worker.training import as_is, prepare_training
from tests.conftest import run_cli_here, write_tiny_mnist

CPU = torch.device("cpu")


def _training(cfg: TrainConfig, compiled: bool) -> Training:
    """The loop's own training without Ray (compiled as prepare_training compiles, before
    DDP would wrap it), over 8 batches' worth of blank digits: the tests step it by hand."""
    blank = torch.zeros(8 * cfg.batch_size, 28, 28, dtype=torch.uint8)
    labels = torch.zeros(len(blank), dtype=torch.int64)
    data = MnistData(blank, labels, blank[:0], labels[:0], "sample", "blank")
    return prepare_training(
        cfg, data, CPU, compile=compiled, prepare_model=as_is, prepare_data_loader=as_is
    )


def _steps(training: Training, batches) -> list[float]:
    training.model.train()
    return [
        train_step(
            training.model,
            images,
            labels,
            training.optimizer,
            training.scheduler,
            training.scaler,
            training.autocast,
            StepRecipe(),
        )[0].item()
        for images, labels in batches
    ]


def test_compiled_convnet_trains_as_eager_and_checkpoints_as_eager(sample_digits, tmp_path):
    images, labels = (torch.from_numpy(a[:64]) for a in sample_digits)
    batches = [(images[i : i + 16], labels[i : i + 16]) for i in range(0, 64, 16)]
    cfg = TrainConfig(epochs=1, batch_size=16, lr=1e-3, schedule="constant")
    eager, compiled = _training(cfg, False), _training(cfg, True)
    eager_losses, compiled_losses = _steps(eager, batches), _steps(compiled, batches)
    # Inductor rounds differently (fused kernels, other summation orders): the first loss
    # agrees to float precision (2e-6 measured where an earlier test of the same process had
    # set torch's threads: its reductions split otherwise); AdamW's normalised steps let the
    # difference grow to a few parts in 10,000 over four steps (measured: 3e-4).
    assert compiled_losses[0] == pytest.approx(eager_losses[0], rel=1e-5)
    assert compiled_losses == pytest.approx(eager_losses, rel=2e-3)
    assert compiled_losses[-1] < compiled_losses[0]

    # A compiled run's checkpoint is an eager one: the ConvNet's own keys, no _orig_mod.
    state = checkpoint_state(compiled, cfg, 1, 0.5, [])
    assert list(state["model"]) == list(ConvNet().state_dict())
    ckpt.save(tmp_path, state)
    ckpt.resumable_state(tmp_path, cfg.to_dict())  # the driver's check before a resume
    loaded = ckpt.load_model(tmp_path)  # what evaluate and serve load: an eager ConvNet
    x = images[:8].unsqueeze(1).float() / 255
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        expected = compiled.module.eval()(x)
    assert torch.allclose(loaded.eval()(x), expected, atol=1e-6)

    # Either resumes the other: an eager run from the compiled checkpoint, and back.
    fresh = _training(cfg, False)
    assert restore(fresh, ckpt.load(tmp_path))[0] == 1
    assert _steps(fresh, batches[:1])[0] == pytest.approx(
        _steps(compiled, batches[:1])[0], rel=1e-5
    )
    restore(compiled, checkpoint_state(eager, cfg, 1, 0.5, []))
    eager_weights = eager.module.state_dict()
    assert all(torch.equal(v, eager_weights[k]) for k, v in compiled.module.state_dict().items())


def test_compiled_fit_through_ray_finishes_and_its_checkpoint_loads_eager(
    ray_local, sample_digits, tmp_path
):
    from raytrain_mnist.driver.fitting import fit

    data = write_tiny_mnist(tmp_path / "data", sample_digits, n_train=160, n_test=64)
    cfg = FitConfig(
        TrainConfig(epochs=1, batch_size=32),  # 5 steps on 2 DDP workers of 16 images
        RunSettings.from_flags(
            num_workers=2,
            cpus_per_worker=1,
            data_dir=str(data),
            dataset="mnist",
            storage_path=str(tmp_path / "runs"),
            name="compiled",
            compile=True,
            progress="off",
        ),
    )
    result = fit(cfg)
    assert (result.status, result.error) == ("finished", None)
    summary = result.summary
    assert summary["config"]["run"]["compile"] is True and summary["val_total"] == 64
    assert [w["compiled"] for w in summary["workers"]] == [True, True]  # both ranks compiled
    state = ckpt.load(summary["latest_checkpoint"])
    assert list(state["model"]) == list(ConvNet().state_dict())
    ckpt.load_model(summary["latest_checkpoint"])


@pytest.mark.parametrize("command", ["fit", "tune"])
def test_compile_without_a_compiler_is_one_line_before_ray(command, monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    done = run_cli_here(
        command, "--compile", "--dataset", "sample", "--storage-path", str(tmp_path)
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--compile needs a C++ compiler" in done.stderr
    assert "$CXX" in done.stderr and not done.stdout
    assert not (tmp_path / "ray").exists()


def test_the_compiler_looked_for_is_the_one_torch_uses(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "g++ -std=c++17")  # a command with flags, as Inductor splits it
    assert compiler_missing(use_gpu=False) is None
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert "Triton" in compiler_missing(use_gpu=True)
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))  # neither gcc nor clang
    assert "C compiler" in compiler_missing(use_gpu=True)
    # A cluster's workers check for themselves: the driver does not refuse on their behalf.
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    assert FitConfig(
        run=RunSettings.from_flags(compile=True, address="10.0.0.1:6379")
    ).run.torch.compile
    with pytest.raises(ValueError, match="--compile needs"):
        FitConfig(run=RunSettings.from_flags(compile=True))
