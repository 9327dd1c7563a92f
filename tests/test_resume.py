"""A driver killed mid-run resumes where it stopped, and ends where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from raytrain_mnist import checkpoint as ckpt
from tests.conftest import REPO, write_tiny_mnist


@pytest.fixture
def ray_cluster():
    """A Ray head started (and stopped) by this test, reached by address like a real one."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 2, "include_dashboard": False})
    yield cluster
    cluster.shutdown()


def _fit_command(address, data, storage, name):
    return [sys.executable, "-m", "raytrain_mnist.fit", "--address", address,
            "--num-workers", "1", "--cpus-per-worker", "1", "--epochs", "4",
            "--batch-size", "16", "--lr", "0.05", "--seed", "3", "--dataset", "mnist",
            "--data-dir", str(data), "--storage-path", str(storage), "--name", name]


def test_driver_killed_after_an_epoch_resumes_at_the_next(ray_cluster, tmp_path, sample_digits):
    data = write_tiny_mnist(tmp_path / "data", sample_digits, n_train=2048, n_test=203)
    storage = tmp_path / "runs"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    driver = subprocess.Popen(_fit_command(ray_cluster.address, data, storage, "killed"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=REPO, env=env)
    seen = []
    for line in driver.stdout:
        seen.append(line)
        if line.startswith("epoch   1/4"):  # printed once epoch 1's checkpoint is committed
            driver.send_signal(signal.SIGKILL)
            break
    driver.wait(timeout=60)
    assert driver.returncode == -signal.SIGKILL, "".join(seen)

    rerun = subprocess.run(_fit_command(ray_cluster.address, data, storage, "killed"),
                           capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    summary = json.loads((storage / "killed" / "summary.json").read_text())
    resumed = summary["resumed_from_epoch"]
    assert resumed in (1, 2, 3), summary
    assert f"resumed from the checkpoint of epoch {resumed}" in rerun.stdout
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3, 4]
    assert "epoch   1/4" not in rerun.stdout  # finished epochs are not trained again

    reference = subprocess.run(_fit_command(ray_cluster.address, data, storage, "straight"),
                               capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    straight = json.loads((storage / "straight" / "summary.json").read_text())

    # Model, optimizer, schedule and data order all came back: the weights end up the same.
    resumed_state = ckpt.load(summary["latest_checkpoint"])
    straight_state = ckpt.load(straight["latest_checkpoint"])
    for key, value in straight_state["model"].items():
        torch.testing.assert_close(resumed_state["model"][key], value, rtol=1e-5, atol=1e-6)
    assert summary["val_accuracy"] == pytest.approx(straight["val_accuracy"], abs=1e-9)
