"""The run's one home (driver/runs/): names, identity, claims, and ``s3://`` with the guarantees
of a local path, against a real S3-compatible server (moto, conftest's ``s3``) on 127.0.0.1.
The s3 run end to end through the CLI (claimed, refused, kept, stopped, resumed, evaluated)
is tests/test_iam.py's, under the worker policy."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig
from raytrain_mnist.driver import runs
from raytrain_mnist.driver.runs import Run, claim
from raytrain_mnist.errors import UserError
from tests.conftest import REPO, run_cli_here

# --------------------------------------------------------------------------- names, identity


def test_default_name_is_deterministic_and_follows_the_settings():
    a, b = FitConfig(), FitConfig()
    assert runs.default_name(a) == runs.default_name(b)
    assert runs.default_name(a).startswith("mnist-2w-")
    assert runs.default_name(FitConfig(TrainConfig(lr=0.05))) != runs.default_name(a)
    assert runs.default_name(FitConfig(run=RunSettings.from_flags(name="mine"))) == "mine"


def test_identity_names_the_data_and_says_what_changed(sample_digits):
    from raytrain_mnist.data import load_sample

    cfg = FitConfig(run=RunSettings.from_flags(dataset="auto"))
    sample = runs.fit_identity(cfg, load_sample())
    assert sample["data"]["kind"] == "sample" and sample["data"]["train_size"] == 4000
    other = {**sample, "data": {**sample["data"], "kind": "mnist", "sha1": "x"}}
    assert "data.kind: 'sample' then, 'mnist' now" in runs.describe_difference(sample, other)


def test_a_search_resumed_from_another_copy_of_its_data_is_the_same_search(tmp_path):
    """search.json records where the search read MNIST beside its identity; a resume that
    reads the same data (its fingerprint) from elsewhere continues it, other data does not."""
    search = Run(tmp_path, "s", record=runs.SEARCH_FILE)
    identity = {"train": {"lr": 0.1}, "data": {"kind": "mnist", "sha1": "abc"}}
    search.write_json(runs.SEARCH_FILE, {**identity, runs.DATA_DIR_KEY: "/data/a"})
    search.check_identity(identity, "search")  # the same data read from /data/b
    other = {**identity, "data": {"kind": "mnist", "sha1": "def"}}
    with pytest.raises(UserError, match="data.sha1: 'abc' then, 'def' now"):
        search.check_identity(other, "search")


@pytest.mark.parametrize(
    "uri", ["s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/runs", "gs://user:wJalrXUtnFEMI@b/x"]
)
def test_credentials_in_a_storage_uri_are_refused(uri):
    with pytest.raises(
        UserError, match="carries credentials; pass them through the environment"
    ) as info:
        Run(uri, "r")
    assert info.value.exit_code == 2 and "wJalrXUtnFEMI" not in str(info.value)


# --------------------------------------------------------------------------- claims


def test_a_local_claim_refuses_a_second_leaves_no_lock_file_and_fresh_keeps_the_old(tmp_path):
    run = Run(tmp_path, "r")
    with run.claim():
        run.write_json("summary.json", {"status": "finished"})
        with pytest.raises(UserError, match="'r' is already running"):
            with Run(tmp_path, "r").claim():
                pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]
    with Run(tmp_path, "r").claim(fresh=True) as again:
        assert not again.exists("summary.json")
        again.write_json("summary.json", {"status": "new"})
    assert Run(tmp_path, "r.previous-1").summary() == {"status": "finished"}
    assert Run(tmp_path, "r").summary() == {"status": "new"}
    # A claim refused before anything was written leaves nothing behind.
    with Run(tmp_path, "empty").claim():
        pass
    assert not (tmp_path / "empty").exists()


def test_an_s3_lease_refuses_a_second_and_a_dead_owners_is_taken_over(s3):
    storage = s3()
    run = Run(storage, "r")
    with run.claim():
        run.write_json("summary.json", {"status": "finished"})
        started = time.monotonic()
        with pytest.raises(UserError, match=r"'r' is already running .*held by pid"):
            with Run(storage, "r").claim():
                pass
        assert time.monotonic() - started < 10
    import pyarrow.fs

    fs, base = run.files.filesystem, run.files.base
    lease = f"{base.rpartition('/')[0]}/.r.lease"
    assert fs.get_file_info(lease).type == pyarrow.fs.FileType.NotFound  # released
    # A lease whose process is gone from this host is stale at once.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    with fs.open_output_stream(lease) as f:
        f.write(
            json.dumps(
                {
                    "token": "old",
                    "host": os.uname().nodename,
                    "host_id": claim.host_id(),  # this host and PID namespace
                    "pid": int(dead),
                    "pid_started": 0,
                    "renewed": time.time(),
                }
            ).encode()
        )
    with Run(storage, "r").claim(fresh=True) as fresh:
        assert not fresh.exists("summary.json")  # --fresh: the old run was copied aside
    assert Run(storage, "r.previous-1").summary() == {"status": "finished"}
    # Someone else's lease on another host is honoured until this command has watched it
    # unchanged for the TTL (its own clock: the lease's timestamp is never compared).
    with fs.open_output_stream(lease) as f:
        f.write(
            json.dumps(
                {
                    "token": "other",
                    "host": "elsewhere",
                    "pid": 1,
                    "renewed": time.time() - runs.LEASE_TTL_S - 1,
                }
            ).encode()
        )
    with Run(storage, "r").claim():
        pass


def test_resume_commands_rebuild_the_same_config_from_every_entry_point(monkeypatch):
    from raytrain_mnist.fit import parse_config, resume_command

    cfg = parse_config(
        [
            "--lr",
            "0.05",
            "--storage-path",
            "my runs",
            "--amp",
            "bf16",
            "--no-tensorboard",
            "--fresh",
        ]
    )
    for argv0, prefix in [
        ("/venv/bin/raytrain-mnist", ["raytrain-mnist", "fit"]),
        (f"{REPO}/raytrain_mnist/__main__.py", ["-m", "raytrain_mnist", "fit"]),
        (f"{REPO}/raytrain_mnist/fit.py", ["-m", "raytrain_mnist.fit"]),
        ("", ["-m", "raytrain_mnist", "fit"]),
    ]:  # fit() from Python
        monkeypatch.setattr(sys, "argv", [argv0])
        words = shlex.split(resume_command(cfg, "the-run"))
        start = words.index(prefix[0])
        assert words[start : start + len(prefix)] == prefix, words
        again = parse_config(words[start + len(prefix) :])
        assert again.train == cfg.train
        assert again.run == RunSettings.from_flags(
            **{**cfg.run.to_dict(), "fresh": False, "name": "the-run"}
        )


def test_a_sample_run_is_not_resumed_on_full_mnist(tmp_path, tiny_mnist):
    """The run remembers what it trained on: other data under its name is refused, and the
    run is left as it was."""
    from tests.test_cli import _tree

    storage = tmp_path / "runs"
    run = Run(storage, "r")
    with run.claim():
        from raytrain_mnist.data import load_sample

        cfg = FitConfig(TrainConfig(), RunSettings.from_flags(name="r"))
        run.write_json(runs.RUN_FILE, runs.fit_identity(cfg, load_sample()))
    before = _tree(storage)
    # Refused before any Ray starts: in this process (the same entry point and streams).
    result = run_cli_here(
        "fit", "--name", "r", "--storage-path", str(storage), "--data-dir", str(tiny_mnist)
    )
    assert result.returncode == 2, result
    assert "data.kind: 'sample' then, 'mnist' now" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert _tree(storage) == before
