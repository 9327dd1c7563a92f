"""Failures on real Ray: a killed worker, a removed node, too many failures, a killed
driver, two commands under one name, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from raytrain_mnist.nn import checkpoint as ckpt
from tests.conftest import (
    MARKER_VAR,
    REPO,
    committed_workers,
    kill_marked,
    marked,
    tiny_run_flags,
)

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _start(command) -> subprocess.Popen:
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=ENV
    )


def _read_until(process: subprocess.Popen, prefix: str, seen: list[str]) -> None:
    for line in process.stdout:
        seen.append(line)
        if line.startswith(prefix):
            return
    raise AssertionError(f"never printed {prefix!r}:\n" + "".join(seen))


def _wait_gone(pids: set[int], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes {pids} outlived their driver")
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# Three faults and three restarts: 309 s on a quiet 2-core machine (2026-12-02 14:27), so
# twice that with a core busy would meet the suite's 600 s hang guard.
@pytest.mark.timeout(1200)
def test_a_worker_dies_a_node_goes_the_driver_is_killed_and_the_run_ends_as_on_one_node(
    two_nodes, fitted, tiny_mnist, tmp_path
):
    """One run on two nodes, a rank on each, ``--max-failures 1``: a killed worker is
    restarted; a lost node is the failure too many, and the run ends in one line; run again,
    it resumes, and a driver killed mid-epoch loses nothing either. It ends with the very
    weights of the same run on one node, never interrupted (``fitted``)."""
    cluster, nodes = two_nodes
    train, calm = fitted["cfg"].train, fitted["summary"]  # 2 workers on one local node
    storage = tmp_path / "runs"
    command = [
        sys.executable,
        "-m",
        "raytrain_mnist.fit",
        "--address",
        cluster.address,
        "--num-workers",
        "2",
        "--cpus-per-worker",
        "1",
        "--placement-strategy",
        "STRICT_SPREAD",
        "--max-failures",
        "1",
        "--epochs",
        str(train.epochs),
        "--batch-size",
        str(train.batch_size),
        "--lr",
        str(train.lr),
        "--seed",
        str(train.seed),
        "--dataset",
        "mnist",
        "--data-dir",
        str(tiny_mnist),
        "--storage-path",
        str(storage),
        "--name",
        "hurt",
    ]
    run_dir = storage / "hurt"
    run = _start(command)
    seen: list[str] = []

    # A second run under the same name, while this one runs, is refused (before its Ray).
    _read_until(run, "starting run 'hurt'", seen)
    clash = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=ENV, timeout=120)
    assert clash.returncode == 1, clash
    assert "run 'hurt' is already running" in clash.stderr, clash.stderr
    assert "Traceback" not in clash.stderr + clash.stdout

    # 1. SIGKILL a worker once epoch 1's checkpoint is committed: failure 1, a restart.
    _read_until(run, "epoch   1/8", seen)
    first = committed_workers(run_dir)
    os.kill(first[1]["pid"], signal.SIGKILL)
    _read_until(run, "workers restarted from the checkpoint of epoch", seen)

    # 2. Remove the node that hosts rank 1 of the restarted group (and add a fresh one):
    #    failure 2, one more than --max-failures allows. The run ends in one line.
    second = committed_workers(run_dir, after={w["pid"] for w in first})
    node = next(n for n in nodes if n.node_id == second[1]["node_id"])
    cluster.remove_node(node)
    nodes.remove(node)
    nodes.append(cluster.add_node(num_cpus=1))
    out, _ = run.communicate(timeout=180)
    out = "".join(seen) + out
    assert run.returncode == 1, out
    errors = [line for line in out.splitlines() if line.startswith("raytrain-mnist: error:")]
    assert len(errors) == 1 and "training failed:" in errors[0], out
    assert "-m raytrain_mnist.fit " in errors[0].split("resume with: ")[1]
    assert "Traceback" not in out
    assert out.count("workers restarted from the checkpoint of epoch") == 1, out
    failed = json.loads((run_dir / "summary.json").read_text())
    assert failed["status"] == "failed" and failed["latest_checkpoint"]
    assert failed["epochs_completed"] >= 2

    # 3. The same command resumes; SIGKILL its driver once it has trained an epoch.
    rerun = _start(command)
    seen = []
    _read_until(rerun, f"resumed from the checkpoint of epoch {failed['epochs_completed']}", seen)
    _read_until(rerun, "epoch ", seen)
    doomed = committed_workers(run_dir)
    rerun.kill()
    rerun.communicate(timeout=60)
    # Ray ends a dead driver's workers (and their controller) on its own time: rerunning
    # before they are gone would race their last commit.
    _wait_gone({w["pid"] for w in doomed})

    # 4. And again: it resumes from the last committed epoch and finishes.
    last = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=ENV, timeout=400)
    assert last.returncode == 0, "".join(seen) + last.stdout + last.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    resumed = summary["resumed_from_epoch"]
    assert resumed in range(failed["epochs_completed"], 8), last.stdout
    assert f"resumed from the checkpoint of epoch {resumed}" in last.stdout
    assert f"epoch {resumed:3d}/8" not in last.stdout  # finished epochs are not trained again
    assert summary["status"] == "finished" and summary["epochs_completed"] == 8
    assert [h["epoch"] for h in summary["history"]] == list(range(1, 9))

    # Ranks on two nodes of this cluster; the reference's on one.
    spread_nodes = {w["rank"]: w["node_id"] for w in summary["workers"]}
    calm_nodes = {w["rank"]: w["node_id"] for w in calm["workers"]}
    assert set(spread_nodes) == set(calm_nodes) == {0, 1}
    assert len(set(spread_nodes.values())) == 2, summary["workers"]
    assert set(spread_nodes.values()) <= {n.node_id for n in nodes}
    assert len(set(calm_nodes.values())) == 1, calm["workers"]

    # The same weights as the uninterrupted run on one node: model, optimiser, schedule and
    # data order all came back after every failure, and Gloo sums two gradients the same
    # way whichever hosts them.
    assert summary["config"]["train"] == calm["config"]["train"]
    hurt_state = ckpt.load(summary["latest_checkpoint"])
    calm_state = ckpt.load(calm["latest_checkpoint"])
    for key, value in calm_state["model"].items():
        torch.testing.assert_close(hurt_state["model"][key], value, rtol=1e-5, atol=1e-6)
    assert summary["val_accuracy"] == pytest.approx(calm["val_accuracy"], abs=1e-9)


def test_ctrl_c_stops_cleanly_prints_the_resume_command_and_stops_its_own_ray(tiny_mnist, tmp_path):
    marker = uuid.uuid4().hex  # carried by the driver and every process of its Ray
    storage = tmp_path / "runs"
    # No --address: this run starts (and must stop) its own local Ray.
    run = subprocess.Popen(
        # 30 epochs: the run is still going when the first epoch's line has been read.
        [
            sys.executable,
            "-m",
            "raytrain_mnist.fit",
            *tiny_run_flags(tiny_mnist, storage, "stopped", epochs=30),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**ENV, MARKER_VAR: marker},
    )
    try:
        seen: list[str] = []
        _read_until(run, "epoch   1/30", seen)
        run.send_signal(signal.SIGINT)
        out, _ = run.communicate(timeout=120)
        assert run.returncode == 130, "".join(seen) + out
        assert "Traceback" not in out
        resume = [line for line in out.splitlines() if "resume with:" in line]
        assert resume and "--name stopped" in resume[0], out
        summary = json.loads((storage / "stopped" / "summary.json").read_text())
        assert summary["status"] == "interrupted" and summary["epochs_completed"] >= 1
        assert summary["latest_checkpoint"]
        deadline = time.monotonic() + 20  # the last workers may take a moment to exit
        while (left := marked(marker)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"processes of the run's own Ray outlived it: {left}"
    finally:
        kill_marked(marker)


_IN_A_NOTEBOOK = """
import sys
import ray
from raytrain_mnist.driver.cluster import start_local
from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig
from raytrain_mnist.driver import fit

start_local(num_cpus=2)  # the notebook's own Ray, started before fit
cfg = FitConfig(TrainConfig(epochs=30, batch_size=32),
                RunSettings.from_flags(num_workers=1, dataset="mnist", data_dir=sys.argv[1],
                            storage_path=sys.argv[2], name="nb"))
result = fit(cfg, on_event=lambda event: print(event.text, flush=True))
if result.status == "interrupted":
    print("fit interrupted; Ray still up:", ray.is_initialized(),
          ray.cluster_resources().get("CPU"), flush=True)
    ray.shutdown()
"""


def test_ctrl_c_in_a_ray_fit_did_not_start_stops_only_the_run(tiny_mnist, tmp_path):
    """A notebook's Ray outlives a Ctrl-C of fit(): only the run's controller is aborted."""
    marker = uuid.uuid4().hex
    run = subprocess.Popen(
        [sys.executable, "-c", _IN_A_NOTEBOOK, str(tiny_mnist), str(tmp_path / "runs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**ENV, MARKER_VAR: marker},
    )
    try:
        seen: list[str] = []
        _read_until(run, "epoch   1/30", seen)
        run.send_signal(signal.SIGINT)
        out, _ = run.communicate(timeout=180)
    finally:
        kill_marked(marker)
    out = "".join(seen) + out
    assert "fit interrupted; Ray still up: True 2.0" in out, out
    summary = json.loads((tmp_path / "runs" / "nb" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and 1 <= summary["epochs_completed"] < 30
