"""Config validation: every bad value is a ConfigError naming the flag."""

import dataclasses
import math
import re
from types import SimpleNamespace

import pytest

from raytrain_mnist.config import (
    ConfigError,
    FitConfig,
    RunSettings,
    TrainConfig,
    check_data_fits,
    steps_per_epoch,
)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"epochs": 0}, "--epochs"),
        ({"batch_size": -1}, "--batch-size"),
        ({"lr": 0.0}, "--lr"),
        ({"lr": math.nan}, "--lr"),
        ({"lr": -0.1}, "--lr"),
        ({"momentum": 1.0}, "--momentum"),
        ({"weight_decay": math.inf}, "--weight-decay"),
        ({"amp": "fp8"}, "--amp"),
        ({"sync_bn": "maybe"}, "--sync-bn"),
    ],
)
def test_bad_training_values_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        TrainConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"num_workers": 0}, "--num-workers"),
        ({"cpus_per_worker": 0}, "--cpus-per-worker"),
        ({"max_failures": -2}, "--max-failures"),
        ({"keep_checkpoints": 0}, "--keep-checkpoints"),
        ({"name": "../escape"}, "--name"),
        ({"backend": "mpi"}, "--backend"),
    ],
)
def test_bad_run_values_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        RunSettings.from_flags(**kwargs)


@pytest.mark.parametrize(
    "train, run, message",
    [
        ({"batch_size": 2}, {"num_workers": 3}, "smaller than --num-workers"),
        ({"batch_size": 100}, {"num_workers": 3}, "multiple of 3, e.g. 99 or 102"),
        ({"amp": "fp16"}, {}, "--amp fp16 needs --use-gpu"),
        ({"sync_bn": "on"}, {}, "SyncBatchNorm runs only on GPUs"),
        ({}, {"backend": "nccl"}, "--backend nccl needs --use-gpu"),
    ],
)
def test_rules_that_span_both_halves(train, run, message):
    with pytest.raises(ConfigError, match=message):
        FitConfig(TrainConfig(**train), RunSettings.from_flags(**run))


def test_train_config_round_trips_through_a_dict():
    cfg = TrainConfig(epochs=3, amp="bf16")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown"):
        TrainConfig.from_dict({**cfg.to_dict(), "dropout": 0.5})


# --------------------------------------------------------------------------- refused up front


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seed": 2**64}, "--seed must be at most"),
        ({"seed": 2**64 - 1, "epochs": 2}, f"--seed must be at most {2**64 - 2}"),
    ],
)
def test_seeds_torch_cannot_take_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig(**kwargs)


def test_the_largest_seed_torch_takes_is_accepted_and_works():
    import torch

    cfg = TrainConfig(seed=2**64 - 2, epochs=2)
    for epoch in range(cfg.epochs):  # what the loader does with it
        torch.Generator().manual_seed(cfg.seed + epoch)
    with pytest.raises(ValueError):  # one more and torch refuses: the bound is torch's
        torch.Generator().manual_seed(cfg.seed + cfg.epochs)


@pytest.mark.parametrize(
    "address",
    [
        "",
        " ",
        "http://10.0.0.1:8265",
        "10.0.0.1",
        "10.0.0.1:",
        "10.0.0.1:0",
        "10.0.0.1:65536",
        "10.0.0.1:99999999999",
        ":6379",
        "::1:6379",
        "ray://10.0.0.1",
        "ray://:10001",
        "host name:6379",
        "user@host:6379",
    ],
)
def test_malformed_addresses_are_refused(address):
    with pytest.raises(ConfigError, match="--address"):
        RunSettings(address=address)


@pytest.mark.parametrize(
    "address", ["auto", "10.0.0.1:6379", "head.example:6379", "[::1]:6379", "ray://10.0.0.1:10001"]
)
def test_well_formed_addresses_pass(address):
    RunSettings(address=address)


@pytest.mark.parametrize(
    "uri",
    [
        "http://user:secret@mlflow.example:5000",
        "https://token@mlflow.example",
        "postgresql://u:p@db/mlflow",
    ],
)
def test_an_mlflow_uri_with_credentials_is_refused(uri):
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_USERNAME") as info:
        RunSettings.from_flags(mlflow_uri=uri)
    assert "secret" not in str(info.value) and "token@" not in str(info.value)


@pytest.mark.parametrize("uri", ["http://mlflow.example:5000", "file:/tmp/mlruns", "databricks"])
def test_an_mlflow_uri_without_credentials_passes(uri):
    RunSettings.from_flags(mlflow_uri=uri)


@pytest.mark.parametrize(
    "name",
    [
        "a\nb",
        "tab\there",
        "x" * 201,
        "",
        ".",
        "..",
        ".hidden",
        "-rf",
        "a/b",
        "a\\b",
        "run?x=1",
        "run#2",
        "100%",
        "a b",
        "a\x1b[2J",
        "a\x00b",
        "caf\u00e9",
        "a$b",
        "a:b",
    ],
)
def test_names_that_are_no_safe_path_segment_are_refused_with_the_rule(name):
    with pytest.raises(ConfigError, match="--name") as info:
        RunSettings.from_flags(name=name)
    message = str(info.value)
    assert "letters, digits, '.', '_' and '-', not starting with '.' or '-'" in message
    assert "at most 200 characters" in message and "\n" not in message and "\x1b" not in message


@pytest.mark.parametrize("name", ["r", "mnist-2w-0a1b2c3d", "tune-2-4w-x.previous-3", "_a", "A9"])
def test_safe_run_names_pass(name):
    assert RunSettings.from_flags(name=name).storage.name == name


# --------------------------------------------------------------------------- secrets in URIs

SECRET = "wJalrXUtnFEMIK7MDENG"


@pytest.mark.parametrize(
    "field, uri",
    [
        ("storage_path", f"s3://AKIAEXAMPLE:{SECRET}@bucket/runs"),
        ("storage_path", f"s3://AKIAEXAMPLE:{SECRET[:8]}/{SECRET[8:]}@bucket/runs"),
        ("storage_path", f"s3://{SECRET}@bucket/runs"),  # a key alone is a credential
        ("storage_path", f"s3://bucket/runs?access_key=AKIAEXAMPLE&secret_key={SECRET}"),
        ("storage_path", f"s3://bucket/runs?region=us-east-1&session_token={SECRET}"),
        ("storage_path", f"gs://bucket/runs?Access_Token={SECRET}"),
        ("storage_path", f"abfs://container:{SECRET}@account.dfs.core.windows.net/runs"),
        ("storage_path", f"abfs://c@account.dfs.core.windows.net/runs?account_key={SECRET}"),
        ("storage_path", f"abfs://c@account.dfs.core.windows.net/runs?sv=2022&sig={SECRET}"),
        ("mlflow_uri", f"https://user:{SECRET}@mlflow.example"),
        ("mlflow_uri", f"https://mlflow.example/?token={SECRET}"),
        ("data_dir", f"s3://K:{SECRET}@bucket/mnist"),
        # What a URL parser skips before the scheme does not hide one (issue 29).
        ("storage_path", f" s3://AKIAEXAMPLE:{SECRET}@bucket/runs"),
        ("storage_path", f"\t\n s3://bucket/runs?secret_key={SECRET}"),
        ("data_dir", f"\x00s3://K:{SECRET}@bucket/mnist"),
        # A query parameter whose value is a URL with credentials, with a scheme or without,
        # plain or percent-encoded (pyarrow's endpoint_override takes either form).
        ("storage_path", f"s3://bucket/runs?endpoint_override=https://AKIAEXAMPLE:{SECRET}@h:9000"),
        ("storage_path", f"s3://bucket/runs?endpoint_override=AKIAEXAMPLE:{SECRET}@minio:9000"),
        ("storage_path", f"s3://b/r?endpoint_override=http%3A%2F%2FAKIAEXAMPLE%3A{SECRET}%40h"),
        ("storage_path", f"s3://b/r?proxy_options=http://{SECRET}@proxy:3128"),
    ],
)
def test_credentials_in_a_uri_are_refused_and_never_echoed(field, uri):
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ConfigError, match="carries credentials; pass them through the env") as info:
        RunSettings.from_flags(**{field: uri})
    message = str(info.value)
    assert message.startswith(f"{flag} ") and SECRET not in message and SECRET[8:] not in message
    assert "AKIAEXAMPLE" not in message


@pytest.mark.parametrize(
    "uri, shown",
    [
        (f"s3://KEY:{SECRET}@bucket/runs", "s3://***@bucket/runs"),
        (f"s3://bucket/runs?secret_key={SECRET}", "s3://bucket/runs?***"),
        (f"https://u:{SECRET}@h:5000/x?t=1#frag", "https://***@h:5000/x?***#***"),
        ("s3://bucket/runs", "s3://bucket/runs"),
        ("runs", "runs"),
        (f" s3://KEY:{SECRET}@bucket/runs", "s3://***@bucket/runs"),
    ],
)
def test_redact_uri(uri, shown):
    from raytrain_mnist.uris import redact_uri

    assert redact_uri(uri) == shown


@pytest.mark.parametrize(
    "field, uri",
    [
        ("storage_path", "s3://bucket/runs"),
        ("storage_path", "s3://bucket/a@b"),  # an '@' in a key, not in the host part
        ("storage_path", "s3://bucket/runs?region=us-east-1&endpoint_override=127.0.0.1:9000"),
        ("storage_path", "abfs://container@account.dfs.core.windows.net/runs"),  # a container
        ("storage_path", "/tmp/me@host/runs"),  # a local path
        ("storage_path", "s3://bucket/runs?endpoint_override=https://minio.example:9000"),
        ("storage_path", "s3://bucket/runs?endpoint_override=http%3A%2F%2F127.0.0.1%3A9000"),
        ("mlflow_uri", "https://mlflow.example/?owner=me@example.com"),  # an address, no secret
        ("data_dir", "/data/mnist"),
    ],
)
def test_uris_without_credentials_pass(field, uri):
    RunSettings.from_flags(**{field: uri})


def test_a_ray_address_with_a_user_part_is_refused_without_echo():
    with pytest.raises(ConfigError, match="--address: a Ray address holds no user") as info:
        RunSettings(address=f"ray://me:{SECRET}@head:10001")
    assert SECRET not in str(info.value)


@pytest.mark.parametrize(
    "batch, workers, size, message",
    [
        (
            128,
            1,
            100,
            "--batch-size 128 is larger than the 100 training images can fill: an "
            "epoch would have no step; use --batch-size 100 or less",
        ),
        (128, 2, 100, "use --batch-size 100 or less"),
        (96, 3, 64, "use --batch-size 66 or less"),  # shares of 22 (padded), 32 per worker
    ],
)
def test_a_batch_larger_than_the_data_is_refused(batch, workers, size, message):
    train, run = TrainConfig(batch_size=batch), RunSettings.from_flags(num_workers=workers)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_data_fits(train, run, size)


@pytest.mark.parametrize("batch, workers, size", [(100, 1, 100), (100, 2, 100), (66, 3, 64)])
def test_the_largest_batch_the_data_fills_passes(batch, workers, size):
    check_data_fits(
        TrainConfig(batch_size=batch, epochs=2), RunSettings.from_flags(num_workers=workers), size
    )
    assert steps_per_epoch(size, batch, workers) == 1


def test_steps_per_epoch_is_what_the_loader_yields():
    """The driver's count against a DataLoader as the workers build it: drop_last, and a
    DistributedSampler (Ray's, padding every share) when there are several workers."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    for size, batch, workers in [(100, 10, 1), (101, 20, 2), (203, 24, 3), (64, 66, 3), (7, 8, 8)]:
        data = TensorDataset(torch.arange(size))
        for rank in range(workers):
            sampler = (
                DistributedSampler(data, num_replicas=workers, rank=rank) if workers > 1 else None
            )
            loader = DataLoader(data, batch_size=batch // workers, drop_last=True, sampler=sampler)
            assert len(loader) == steps_per_epoch(size, batch, workers), (size, batch, workers)


def test_a_one_cycle_schedule_pytorch_cannot_split_is_refused():
    import torch

    # 1 epoch x 4 steps: OneCycleLR's warm-up is 0.25 * 4 - 1 = 0 steps long and it divides
    # by that length.
    with pytest.raises(ZeroDivisionError):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=4, pct_start=0.25)
    train, run = TrainConfig(epochs=1, batch_size=32), RunSettings.from_flags(num_workers=2)
    with pytest.raises(ConfigError, match="4 steps, a one-cycle warm-up of no step"):
        check_data_fits(train, run, 128)
    check_data_fits(dataclasses.replace(train, schedule="constant"), run, 128)
    check_data_fits(dataclasses.replace(train, epochs=2), run, 128)


def test_every_worker_count_of_an_elastic_range_is_checked():
    # 4 images: 3 workers take shares of 2 (padded) in steps of 2; 4 workers shares of 1.
    check_data_fits(
        TrainConfig(batch_size=8), SimpleNamespace(scaling=SimpleNamespace(num_workers=(3, 3))), 4
    )
    with pytest.raises(ConfigError, match="over 4 workers"):
        check_data_fits(
            TrainConfig(batch_size=8),
            SimpleNamespace(scaling=SimpleNamespace(num_workers=(3, 4))),
            4,
        )
    with pytest.raises(ConfigError, match="smaller than 4 workers"):
        check_data_fits(
            TrainConfig(batch_size=3),
            SimpleNamespace(scaling=SimpleNamespace(num_workers=(1, 4))),
            100,
        )


def test_a_search_space_is_checked_against_the_data_size():
    from raytrain_mnist.driver.searching.space import SearchSpace, TuneSettings

    base, run = TrainConfig(epochs=2), RunSettings.from_flags(num_workers=2)
    space = SearchSpace.from_cli(ranges=["batch_size=64,4096"])
    space.check(base, run)  # valid settings, whatever the data
    space.check_data(base, run, 5000)
    with pytest.raises(
        ConfigError,
        match=r"search space batch_size=choice\(64, 4096\): a trial "
        r"with batch_size=4096, schedule=onecycle fails: --batch-size 4096 is "
        r"larger than the 4000 training images",
    ):
        space.check_data(base, run, 4000)
    # A schedule choice that meets a step count OneCycleLR cannot split (1 x 4 steps).
    space = SearchSpace.from_cli(sets=["batch_size=32"], ranges=["schedule=constant,onecycle"])
    with pytest.raises(ConfigError, match="schedule=onecycle fails: .*one-cycle warm-up"):
        space.check_data(dataclasses.replace(base, epochs=1), run, 128)
    with pytest.raises(ConfigError, match="--search-seed must be at most 4294967295"):
        TuneSettings(search_seed=2**32)
    TuneSettings(search_seed=2**32 - 1)
