"""Config validation: every bad value is a ConfigError naming the flag."""

import math

import pytest

from raytrain_mnist.config import ConfigError, FitConfig, RunSettings, TrainConfig


@pytest.mark.parametrize("kwargs, flag", [
    ({"epochs": 0}, "--epochs"),
    ({"batch_size": -1}, "--batch-size"),
    ({"lr": 0.0}, "--lr"),
    ({"lr": math.nan}, "--lr"),
    ({"lr": -0.1}, "--lr"),
    ({"momentum": 1.0}, "--momentum"),
    ({"weight_decay": math.inf}, "--weight-decay"),
    ({"amp": "fp8"}, "--amp"),
    ({"sync_bn": "maybe"}, "--sync-bn"),
])
def test_bad_training_values_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        TrainConfig(**kwargs)


@pytest.mark.parametrize("kwargs, flag", [
    ({"num_workers": 0}, "--num-workers"),
    ({"cpus_per_worker": 0}, "--cpus-per-worker"),
    ({"max_failures": -2}, "--max-failures"),
    ({"keep_checkpoints": 0}, "--keep-checkpoints"),
    ({"name": "../escape"}, "--name"),
    ({"backend": "mpi"}, "--backend"),
])
def test_bad_run_values_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        RunSettings(**kwargs)


@pytest.mark.parametrize("train, run, message", [
    ({"batch_size": 2}, {"num_workers": 3}, "smaller than --num-workers"),
    ({"batch_size": 100}, {"num_workers": 3}, "multiple of 3, e.g. 99 or 102"),
    ({"amp": "fp16"}, {}, "--amp fp16 needs --use-gpu"),
    ({"sync_bn": "on"}, {}, "SyncBatchNorm runs only on GPUs"),
    ({}, {"backend": "nccl"}, "--backend nccl needs --use-gpu"),
])
def test_rules_that_span_both_halves(train, run, message):
    with pytest.raises(ConfigError, match=message):
        FitConfig(TrainConfig(**train), RunSettings(**run))


def test_train_config_round_trips_through_a_dict():
    cfg = TrainConfig(epochs=3, amp="bf16")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown"):
        TrainConfig.from_dict({**cfg.to_dict(), "dropout": 0.5})
