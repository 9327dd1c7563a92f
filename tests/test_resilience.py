"""Failures on real Ray: a killed worker, a removed node, a killed driver, Ctrl-C, too many
failures, two runs at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from raytrain_mnist import checkpoint as ckpt
from tests.conftest import REPO, write_tiny_mnist

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _fit(address, data, storage, name, *extra, epochs=4):
    return [sys.executable, "-m", "raytrain_mnist.fit", "--address", address,
            "--num-workers", "2", "--cpus-per-worker", "1", "--epochs", str(epochs),
            "--batch-size", "32", "--lr", "0.05", "--seed", "5", "--dataset", "mnist",
            "--data-dir", str(data), "--storage-path", str(storage), "--name", name, *extra]


def _start(command) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO, env=ENV)


def _read_until(process: subprocess.Popen, prefix: str, seen: list[str]) -> None:
    for line in process.stdout:
        seen.append(line)
        if line.startswith(prefix):
            return
    raise AssertionError(f"never printed {prefix!r}:\n" + "".join(seen))


def _committed_workers(run_dir: Path, after: set[int] = frozenset(),
                       timeout: float = 60) -> list[dict]:
    """The workers (rank order) behind the latest committed checkpoint, waiting until they
    are none of the processes in ``after``: the snapshot file can lag the printed epoch."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
            workers = snapshot["latest_checkpoint_result"]["metrics"]["workers"]
            if not after & {w["pid"] for w in workers}:
                return workers
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not written yet, or caught mid-write
        if time.monotonic() > deadline:
            raise AssertionError(f"no committed checkpoint from new workers in {run_dir}")
        time.sleep(0.2)


def test_a_worker_a_node_and_the_driver_die_and_the_run_ends_like_a_calm_one(
        three_nodes, tmp_path, sample_digits):
    cluster, nodes = three_nodes
    data = write_tiny_mnist(tmp_path / "data", sample_digits, n_train=2048, n_test=203)
    storage = tmp_path / "runs"
    def command(name: str) -> list[str]:
        return _fit(cluster.address, data, storage, name, "--placement-strategy", "SPREAD",
                    epochs=8)

    run = _start(command("hurt"))
    seen: list[str] = []

    # 1. SIGKILL a worker process once epoch 1's checkpoint is committed.
    _read_until(run, "epoch   1/8", seen)
    first = _committed_workers(storage / "hurt")
    os.kill(first[1]["pid"], signal.SIGKILL)
    _read_until(run, "workers restarted from the checkpoint of epoch", seen)

    # 2. Remove the node that hosts rank 1 of the restarted group (and add a fresh one, for
    #    the tests after this one).
    second = _committed_workers(storage / "hurt", after={w["pid"] for w in first})
    node = next(n for n in nodes if n.node_id == second[1]["node_id"])
    cluster.remove_node(node)
    nodes.remove(node)
    nodes.append(cluster.add_node(num_cpus=1))

    # 3. SIGKILL the driver once another epoch is committed. (Whether the removed node's
    #    worker dies before that epoch ends is Ray's timing: seen both ways here, so the count
    #    of restarts is at least the killed worker's one.)
    _read_until(run, "epoch ", seen)
    run.kill()
    seen.append(run.communicate(timeout=60)[0])
    assert "".join(seen).count("workers restarted from the checkpoint of epoch") >= 1

    # The same command again resumes from the last committed epoch and finishes.
    rerun = subprocess.run(command("hurt"), capture_output=True, text=True, cwd=REPO, env=ENV,
                           timeout=400)
    assert rerun.returncode == 0, "".join(seen) + rerun.stdout + rerun.stderr
    summary = json.loads((storage / "hurt" / "summary.json").read_text())
    resumed = summary["resumed_from_epoch"]
    assert resumed in range(2, 8), rerun.stdout
    assert f"resumed from the checkpoint of epoch {resumed}" in rerun.stdout
    assert f"epoch {resumed:3d}/8" not in rerun.stdout  # finished epochs are not trained again
    assert summary["status"] == "finished" and summary["epochs_completed"] == 8
    assert [h["epoch"] for h in summary["history"]] == list(range(1, 9))

    # An uninterrupted run of the same command ends with the same weights: model, optimiser,
    # schedule and data order all came back after every failure.
    calm = subprocess.run(command("calm"), capture_output=True, text=True, cwd=REPO, env=ENV,
                          timeout=400)
    assert calm.returncode == 0, calm.stdout + calm.stderr
    straight = json.loads((storage / "calm" / "summary.json").read_text())
    hurt_state = ckpt.load(summary["latest_checkpoint"])
    calm_state = ckpt.load(straight["latest_checkpoint"])
    for key, value in calm_state["model"].items():
        torch.testing.assert_close(hurt_state["model"][key], value, rtol=1e-5, atol=1e-6)
    assert summary["val_accuracy"] == pytest.approx(straight["val_accuracy"], abs=1e-9)


def test_ctrl_c_stops_cleanly_and_prints_the_resume_command(tmp_path, sample_digits):
    data = write_tiny_mnist(tmp_path / "data", sample_digits, n_train=2048, n_test=203)
    storage = tmp_path / "runs"
    command = _fit("", data, storage, "stopped", "--num-workers", "1")
    del command[3:5]  # no --address: this run starts (and must stop) its own local Ray
    run = _start(command)
    seen: list[str] = []
    _read_until(run, "epoch   1/4", seen)
    run.send_signal(signal.SIGINT)
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 130, "".join(seen) + out
    assert "Traceback" not in out
    resume = [line for line in out.splitlines() if "resume with:" in line]
    assert resume and "--name stopped" in resume[0], out
    summary = json.loads((storage / "stopped" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["epochs_completed"] >= 1
    assert summary["latest_checkpoint"]


def test_two_runs_at_once_one_fails_beyond_max_failures_one_trains_in_bf16(
        three_nodes, tmp_path, sample_digits):
    """Two runs share a cluster: one loses a worker with --max-failures 0 and ends in one
    line; the other, in bf16 autocast on CPU, trains on undisturbed; a third run under a
    name already running is refused."""
    cluster, _ = three_nodes
    storage = tmp_path / "runs"
    small = write_tiny_mnist(tmp_path / "small", sample_digits, n_train=1024, n_test=203)
    large = write_tiny_mnist(tmp_path / "large", sample_digits, n_train=2048, n_test=203)
    steady = _start(_fit(cluster.address, small, storage, "steady", "--num-workers", "1",
                         "--amp", "bf16", epochs=2))
    fragile = _start(_fit(cluster.address, large, storage, "fragile", "--num-workers", "1",
                          "--max-failures", "0", epochs=8))
    _read_until(steady, "starting run 'steady'", [])

    started = time.monotonic()
    clash = subprocess.run(_fit(cluster.address, small, storage, "steady", "--num-workers",
                                "1", "--amp", "bf16", epochs=2), capture_output=True,
                           text=True, cwd=REPO, env=ENV, timeout=60)
    assert clash.returncode == 1 and time.monotonic() - started < 30
    assert "run 'steady' is already running" in clash.stderr
    assert "Traceback" not in clash.stderr + clash.stdout

    seen: list[str] = []
    _read_until(fragile, "epoch   1/8", seen)
    os.kill(_committed_workers(storage / "fragile")[0]["pid"], signal.SIGKILL)
    out, _ = fragile.communicate(timeout=300)
    assert fragile.returncode == 1, "".join(seen) + out
    errors = [line for line in out.splitlines() if line.startswith("raytrain-mnist: error:")]
    assert len(errors) == 1 and "training failed:" in errors[0], out
    assert "resume with: python -m raytrain_mnist.fit" in errors[0]
    assert "Traceback" not in out
    failed = json.loads((storage / "fragile" / "summary.json").read_text())
    assert failed["status"] == "failed" and failed["latest_checkpoint"]

    out, _ = steady.communicate(timeout=300)
    assert steady.returncode == 0, out
    summary = json.loads((storage / "steady" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["epochs_completed"] == 2
    assert Path(summary["latest_checkpoint"]).parent == storage / "steady"
    assert summary["config"]["train"]["amp"] == "bf16"
    losses = [h["train_loss"] for h in summary["history"]]
    assert losses[1] < losses[0] and summary["val_accuracy"] > 0.3  # chance is 0.1
