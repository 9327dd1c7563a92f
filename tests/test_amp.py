"""The CUDA-only code paths, run on CPU where PyTorch allows it: fp16 with loss scaling
(torch >= 2.3 has ``GradScaler("cpu")`` and fp16 CPU autocast), bf16, SyncBatchNorm."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytrain_mnist.config import ConfigError, FitConfig, RunSettings, TrainConfig
from raytrain_mnist.nn import checkpoint as ckpt
from raytrain_mnist.nn.model import ConvNet
from raytrain_mnist.nn.optim import amp_context, build_optimizer, grad_scaler
from raytrain_mnist.worker.loop import build_model, make_train_loader, train_one_epoch, train_step

CPU = torch.device("cpu")
BATCH = 16  # fp16 on CPU is emulated and slow: small batches keep these tests quick


@pytest.fixture
def batch(sample_digits):
    images, labels = sample_digits
    return torch.from_numpy(images[:BATCH].copy()), torch.from_numpy(labels[:BATCH].copy())


def _fp16_setup(seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(sync_bn=False)
    optimizer, scheduler = build_optimizer(
        model, TrainConfig(optimizer="sgd", amp="off", schedule="constant", lr=0.01), 100
    )
    scaler = grad_scaler("fp16", CPU)
    # The default first scale (2**16) overflows on the first steps and calibrates itself
    # down; start where no clean step overflows, so the only overflow is the injected one.
    scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0**8})
    return model, optimizer, scheduler, scaler, amp_context("fp16", CPU)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_fp16_overflow_skips_the_step_backs_off_and_the_scaler_state_survives_a_checkpoint(
    batch, tmp_path
):
    model, optimizer, scheduler, scaler, autocast = _fp16_setup()
    assert scaler.is_enabled()
    images, labels = batch

    before = _params(model)
    loss, logits = train_step(model, images, labels, optimizer, scheduler, scaler, autocast)
    assert logits.dtype == torch.float16 and torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, _params(model), strict=False)), (
        "no step taken"
    )
    scale = scaler.get_scale()
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]

    # One non-finite gradient, as an fp16 overflow would produce.
    hook = model.fc.weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    before = _params(model)
    train_step(model, images, labels, optimizer, scheduler, scaler, autocast)
    hook.remove()
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model), strict=False)), (
        "step not skipped"
    )
    assert all(
        torch.equal(m, optimizer.state[p]["momentum_buffer"])
        for m, p in zip(momentum, model.parameters(), strict=False)
    ), "momentum moved on a skip"
    assert scaler.get_scale() == scale * scaler.get_backoff_factor()

    ckpt.save(tmp_path, {"model": model.state_dict(), "scaler": scaler.state_dict()})
    restored = grad_scaler("fp16", CPU)
    restored.load_state_dict(ckpt.load(tmp_path)["scaler"])  # weights_only loading
    assert restored.state_dict() == scaler.state_dict()
    assert restored.get_scale() == scale * scaler.get_backoff_factor()

    # Training goes on at the lower scale.
    before = _params(model)
    train_step(model, images, labels, optimizer, scheduler, restored, autocast)
    assert any(not torch.equal(a, b) for a, b in zip(before, _params(model), strict=False))
    assert restored.get_scale() == scaler.get_scale()  # growth only after a long clean run


def test_fp16_epoch_learns_and_reports_steps_and_cpu_time(sample_digits):
    images, labels = (torch.from_numpy(a[:512].copy()) for a in sample_digits)
    model, optimizer, scheduler, scaler, autocast = _fp16_setup()
    loader = make_train_loader(images, labels, 32, seed=0)
    first = train_one_epoch(model, loader, optimizer, scheduler, scaler, autocast, CPU)
    second = train_one_epoch(model, loader, optimizer, scheduler, scaler, autocast, CPU)
    assert second["train_loss"] < first["train_loss"]
    assert first["train_steps"] == len(loader) == 16 and first["train_images"] == 512
    assert first["cpu_s"] > 0 and isinstance(first["first_step_at"], float)


def test_bf16_logits_really_are_bf16(batch):
    torch.manual_seed(0)
    model = build_model(sync_bn=False)
    optimizer, scheduler = build_optimizer(model, TrainConfig(amp="bf16"), 10)
    scaler = grad_scaler("bf16", CPU)
    assert not scaler.is_enabled()  # bf16 has fp32's range: nothing to scale
    loss, logits = train_step(model, *batch, optimizer, scheduler, scaler, amp_context("bf16", CPU))
    assert logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32  # autocast computes cross-entropy in fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights


def test_sync_batchnorm_state_dict_loads_into_a_plain_convnet(batch, tmp_path):
    torch.manual_seed(0)
    plain = ConvNet()
    plain.train()
    plain(batch[0].unsqueeze(1).float())  # move the running statistics off their defaults
    synced = build_model(sync_bn=True)
    synced.load_state_dict(plain.state_dict())
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in synced.modules()) == 2
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in plain.modules())

    state = synced.state_dict()
    assert state.keys() == plain.state_dict().keys()
    ckpt.save(tmp_path, {"model": state})
    loaded = ckpt.load_model(tmp_path)  # strict load into a plain ConvNet
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in loaded.modules())
    for name, tensor in plain.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    # In eval mode SyncBatchNorm needs no process group: the same function as BatchNorm.
    x = batch[0].unsqueeze(1).float()
    assert torch.equal(synced.eval()(x), loaded.eval()(x))


def test_fp16_on_cpu_is_refused_with_the_bf16_alternative():
    # fp16 on CPU is emulated: several times slower than fp32 here, and bf16 is available.
    with pytest.raises(ConfigError, match="--amp fp16 needs --use-gpu; on CPU use --amp bf16"):
        FitConfig(TrainConfig(amp="fp16"), RunSettings())
