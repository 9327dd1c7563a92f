"""Failures on real Ray: a killed worker, a removed node, Ctrl-C, two runs at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def _committed_workers(run_dir: Path) -> list[dict]:
    snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    return snapshot["latest_checkpoint_result"]["metrics"]["workers"]


@pytest.fixture
def three_nodes(tmp_path):
    """A head that hosts no training (0 CPUs) and three 1-CPU nodes, stopped by the test."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    yield cluster, nodes
    cluster.shutdown()


def test_killed_worker_and_removed_node_the_run_goes_on(three_nodes, tmp_path, sample_digits):
    cluster, nodes = three_nodes
    data = write_tiny_mnist(tmp_path / "data", sample_digits, n_train=2048, n_test=203)
    storage = tmp_path / "runs"
    run = _start(_fit(cluster.address, data, storage, "hurt", "--placement-strategy", "SPREAD"))
    seen: list[str] = []

    # 1. SIGKILL a worker process mid-epoch 2 (epoch 1's checkpoint is committed).
    _read_until(run, "epoch   1/4", seen)
    victim = _committed_workers(storage / "hurt")[1]
    os.kill(victim["pid"], signal.SIGKILL)
    _read_until(run, "workers restarted from the checkpoint of epoch", seen)

    # 2. Remove the node that hosts rank 1 of the restarted group.
    _read_until(run, "epoch ", seen)
    host = _committed_workers(storage / "hurt")[1]["node_id"]
    node = next(n for n in nodes if n.node_id == host)
    cluster.remove_node(node)

    out, _ = run.communicate(timeout=400)
    seen.append(out)
    assert run.returncode == 0, "".join(seen)
    summary = json.loads((storage / "hurt" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["epochs_completed"] == 4
    assert summary["worker_restarts"] == 2, "".join(seen)
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3, 4]

    # The same run without failures ends with the same accuracy: restarts lose nothing.
    straight = subprocess.run(_fit(cluster.address, data, storage, "calm",
                                   "--placement-strategy", "SPREAD"),
                              capture_output=True, text=True, cwd=REPO, env=ENV, timeout=400)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    calm = json.loads((storage / "calm" / "summary.json").read_text())
    assert abs(summary["val_accuracy"] - calm["val_accuracy"]) <= 0.003


def test_worker_failures_beyond_max_failures_end_in_one_line(three_nodes, tmp_path,
                                                            sample_digits):
    cluster, _ = three_nodes
    data = write_tiny_mnist(tmp_path / "data", sample_digits, n_train=2048, n_test=203)
    storage = tmp_path / "runs"
    run = _start(_fit(cluster.address, data, storage, "fragile", "--max-failures", "0"))
    seen: list[str] = []
    _read_until(run, "epoch   1/4", seen)
    os.kill(_committed_workers(storage / "fragile")[0]["pid"], signal.SIGKILL)
    out, _ = run.communicate(timeout=300)
    assert run.returncode == 1, out
    errors = [line for line in out.splitlines() if line.startswith("raytrain-mnist: error:")]
    assert len(errors) == 1 and "training failed:" in errors[0], out
    assert "resume with: python -m raytrain_mnist.fit" in errors[0]
    assert "Traceback" not in out
    summary = json.loads((storage / "fragile" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["latest_checkpoint"]


def test_ctrl_c_stops_cleanly_and_prints_the_resume_command(tmp_path, sample_digits):
    data = write_tiny_mnist(tmp_path / "data", sample_digits, n_train=2048, n_test=203)
    storage = tmp_path / "runs"
    command = _fit("", data, storage, "stopped")
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


def test_two_runs_at_once_and_a_name_already_running(three_nodes, tmp_path, sample_digits):
    cluster, _ = three_nodes
    data = write_tiny_mnist(tmp_path / "data", sample_digits, n_train=1024, n_test=203)
    storage = tmp_path / "runs"
    first = _start(_fit(cluster.address, data, storage, "first", "--num-workers", "1",
                        epochs=2))
    second = _start(_fit(cluster.address, data, storage, "second", "--num-workers", "1",
                         epochs=2))
    _read_until(first, "starting run 'first'", [])

    started = time.monotonic()
    clash = subprocess.run(_fit(cluster.address, data, storage, "first", "--num-workers", "1",
                                epochs=2), capture_output=True, text=True, cwd=REPO, env=ENV,
                           timeout=60)
    assert clash.returncode == 1 and time.monotonic() - started < 30
    assert "run 'first' is already running" in clash.stderr
    assert "Traceback" not in clash.stderr + clash.stdout

    for run, name in ((first, "first"), (second, "second")):
        out, _ = run.communicate(timeout=300)
        assert run.returncode == 0, out
        summary = json.loads((storage / name / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["epochs_completed"] == 2
        assert Path(summary["latest_checkpoint"]).parent == storage / name
