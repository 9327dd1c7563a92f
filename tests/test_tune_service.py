"""`tune --service`: a search whose trials are requests to a warm service, against the same
search as today's `tune` (every trial a TorchTrainer of its own), on real Ray (CPU, Gloo).

The service is the suite's one (tests/warm_service.py, shared with tests/test_service.py,
started as a user's shell starts it); every search is a subprocess, as a user runs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_mnist.driver.runs import Run
from raytrain_mnist.driver.searching import on_service
from raytrain_mnist.errors import UserError
from tests.conftest import REPO, run_cli_here, wait_for
from tests.warm_service import NAME, service_command

#: The search of both sides: seed 2 draws lr 0.05 then 1e-6; one trial at a time, so the
#: hopeless second trial reaches its first rung after the first finished, and ASHA stops it.
SEARCH = shlex.split(
    "--dataset mnist --batch-size 32 --num-samples 2 --max-epochs 3 --range lr=1e-6,0.05 "
    "--search-seed 2 --scheduler asha --grace-period 1 --progress lines"
)


def _tune(storage: Path, name: str, *flags: str) -> list[str]:
    tune = [sys.executable, "-m", "raytrain_mnist", "tune"]
    return [*tune, "--storage-path", str(storage), "--name", name, *flags]


def _run(command: list[str], env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done


def _trials(experiment: Path) -> dict[str, dict]:
    """Each trial's ``trial.json`` record, by name."""
    return {
        path.parent.name: json.loads(path.read_text())
        for path in sorted(experiment.glob("runs/*/trial.json"))
    }


# --------------------------------------------------------------------------- no Ray


def test_a_search_on_a_service_runs_as_many_trials_as_it_has_free_groups():
    assert on_service.concurrency({"groups": 4, "free_groups": 3}, None, 8) == 3
    assert on_service.concurrency({"groups": 4, "free_groups": 0}, None, 8) == 1  # all busy
    assert on_service.concurrency({"name": "older"}, None, 8) == 1  # says nothing: one
    assert on_service.concurrency({"groups": 4, "free_groups": 4}, None, 2) == 2  # 2 left
    assert on_service.concurrency({"groups": 4, "free_groups": 1}, 3, 8) == 3  # asked for
    with pytest.raises(UserError, match="--max-concurrent-trials 5: service 's' trains 4"):
        on_service.concurrency({"name": "s", "groups": 4}, 5, 8)


def test_a_trial_on_a_service_asks_a_sliver_of_a_cpu_where_one_is_free():
    assert on_service.trial_resources(2.0, 4) == {"CPU": on_service.TRIAL_CPU}
    # The service holds every CPU (a machine its size): a trial asks none, only memory.
    assert on_service.trial_resources(0.0, 1) == on_service.NO_CPU
    assert on_service.NO_CPU["CPU"] == 0 and on_service.NO_CPU["memory"] > 0


class _Client:
    """A ServiceClient as a trial uses one once its request is sent."""

    name = "s"

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def channel(self, request_id: str):
        return None

    def cancel(self, request_id: str, reason: str) -> None:
        self.cancelled.append(request_id)


def test_a_trial_relays_committed_epochs_and_cancels_only_a_request_still_training():
    client = _Client()
    stopped = on_service.TrialRequest(client, "r1", 3, contextlib.ExitStack())
    stopped._take({"progress": "step", "epoch": 1})  # rank 0's progress: not an epoch
    stopped._take({"epoch": 1, "val_accuracy": 0.5, "checkpoint": "/c1", "received": 2.0})
    result = stopped._result(stopped._epochs.pop(0))
    assert result["checkpoint_path"] == "/c1" and "received" not in result
    assert result["trial_imported_torch"] == ("torch" in sys.modules)
    assert "done" not in result
    stopped.close("ASHA stopped it")  # after epoch 1 of 3: the request trains on
    assert client.cancelled == ["r1"]

    finished = on_service.TrialRequest(client, "r2", 1, contextlib.ExitStack())
    finished._take({"epoch": 1, "val_accuracy": 0.9, "checkpoint": None})
    assert finished._result(finished._epochs.pop(0))["done"] is True
    finished.close("the trial ended")  # its last epoch went to Tune: nothing to cancel

    failed = on_service.TrialRequest(client, "r3", 2, contextlib.ExitStack())
    failed._take({"progress": "request", "state": "failed", "error": "training diverged"})
    with pytest.raises(UserError, match="service 's': training diverged"):
        failed._check_end()
    failed.close("the trial failed")
    assert client.cancelled == ["r1"]


def test_a_search_on_no_such_service_is_one_line(tmp_path):
    done = run_cli_here("tune", "--service", "nosuch", "--storage-path", str(tmp_path))
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert "--service nosuch: no service of that name" in lines[0]


# --------------------------------------------------------------------------- on the service


@pytest.mark.timeout(1500)
def test_the_same_search_through_the_service_and_on_its_own_trains_the_same_trials(
    service,
    tmp_path,
    ray_env,
):
    """The same ASHA search (seed, space, scheduler, one trial at a time, two workers per
    trial) through the service and through today's `tune` draws the same trials, stops the
    same one, and every trial reaches the same validation accuracy at every epoch. On the
    service no trial's actor imports torch, and the stopped trial's request is cancelled
    between epochs: its run stays resumable, short of the epochs it would have trained."""
    storage = service["storage"]
    data = ["--data-dir", str(service["data"])]
    too_many = ["--max-concurrent-trials", "9"]
    refused = _run(_tune(storage, "many", "--service", NAME, *SEARCH, *too_many), service["env"])
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"--max-concurrent-trials 9: service '{NAME}' trains" in refused.stderr

    one = ["--max-concurrent-trials", "1", *data]
    served = _run(_tune(storage, "asha", "--service", NAME, *SEARCH, *one), service["env"])
    assert served.returncode == 0, served.stdout + served.stderr
    alone = ["--num-workers", "2", "--cpus-per-worker", "1"]
    plain = _run(_tune(tmp_path, "asha", *SEARCH, *one, *alone), ray_env)
    assert plain.returncode == 0, plain.stdout + plain.stderr

    served, alone = _trials(storage / "asha"), _trials(tmp_path / "asha")  # trial -> record
    assert served.keys() == alone.keys() and len(served) == 2, (served, alone)
    for name, record in served.items():
        assert record["config"] == alone[name]["config"]
        assert record["status"] == alone[name]["status"], (name, record, alone[name])
        accuracies = [[h["val_accuracy"] for h in r["history"]] for r in (record, alone[name])]
        assert accuracies[0] == accuracies[1], (name, accuracies)
    stopped = [n for n, r in served.items() if r["status"] == "stopped early"]
    assert len(stopped) == 1, served
    best = [json.loads((d / "asha" / "best.json").read_text()) for d in (storage, tmp_path)]
    assert best[0]["best_trial"] == best[1]["best_trial"]
    assert best[0]["best_val_accuracy"] == best[1]["best_val_accuracy"]
    assert f"--service {NAME}" in best[0]["fit_command"]

    # Each trial's actor said with every epoch whether it had imported torch.
    results = [
        json.loads(line)
        for path in (storage / "asha").glob("trial_*/result.json")
        for line in path.read_text().splitlines()
    ]
    assert len(results) == 4 and not any(r["trial_imported_torch"] for r in results), results
    # ASHA's stop cancelled the stopped trial's request in its second epoch, not after three.
    run = Run(str(storage / "asha" / "runs"), stopped[0])
    assert run.latest_checkpoint() is not None
    assert run.latest_metrics()["epoch"] < 3

    # A service-trained trial's run is an ordinary run: evaluate, predict, export and serve
    # (its config for `serve deploy`: the target resolved and loaded as `serve` does before
    # it starts Serve) take it with no flag beyond its path (the search recorded where the
    # service read MNIST), and evaluate scores what the trial reported.
    trial = str(storage / "asha" / "runs" / best[0]["best_trial"])
    images = str(service["data"] / "MNIST" / "raw" / "t10k-images-idx3-ubyte")
    pt2, deploy = str(tmp_path / "best.pt2"), tmp_path / "serve.yaml"
    scored = run_cli_here("evaluate", trial, "--json")
    assert scored.returncode == 0, scored.stdout + scored.stderr
    report = json.loads(scored.stdout)
    assert report["accuracy"] == report["reported_val_accuracy"], report
    for command in (
        ["predict", trial, images],
        ["export", trial, "--format", "pt2", "--output", pt2],
        ["serve", trial, "--write-config", str(deploy)],
    ):
        done = run_cli_here(*command)
        assert done.returncode == 0 and not done.stderr, (command, done.stdout + done.stderr)
    assert f"{trial}/checkpoint_" in deploy.read_text()  # the trial's best kept checkpoint


@pytest.mark.timeout(900)
def test_ctrl_c_cancels_the_trials_requests_and_the_same_command_resumes_the_search(
    service,
):
    """The search runs as many trials at once as the service has free groups. Ctrl-C
    stops it (exit 130, its resume line) and leaves nothing training on the service; the
    same command then finishes it, every trial's epochs joined up."""
    storage = service["storage"]
    free = _service_status(service).get("free_groups") or 1
    flags = "--dataset mnist --batch-size 32 --num-samples 2 --max-epochs 8 --progress lines"
    command = _tune(
        storage, "stopped", "--service", NAME, "--scheduler", "fifo", *shlex.split(flags)
    )
    driver = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=service["env"],
        start_new_session=True,
    )
    seen: list[str] = []
    try:
        for line in driver.stdout:  # a trial's first epoch commits: stop the search there
            seen.append(line)
            if " started: " in line:
                break
        _first_epoch(storage / "stopped" / "runs")
        driver.send_signal(signal.SIGINT)
        out, err = driver.communicate(timeout=240)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=30)
    out = "".join(seen) + out
    assert driver.returncode == 130, out + err
    assert f"{min(free, 2)} at a time" in out, out
    assert "resume with: " in err and "Traceback" not in out + err
    info = _service_status(service)
    assert not info["in_flight"] and not info["queue"], info

    resumed = _run(command, service["env"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    records = _trials(storage / "stopped").values()
    assert [r["status"] for r in records] == ["finished", "finished"], records
    assert all([h["epoch"] for h in r["history"]] == list(range(1, 9)) for r in records)


def _service_status(running: dict) -> dict:
    """``service status --json`` of the module's service."""
    status = service_command("status", "--name", NAME, "--json")
    return json.loads(_run(status, running["env"]).stdout)


def _first_epoch(runs: Path) -> None:
    """Wait for the trial's run to hold its first committed checkpoint."""
    wait_for(lambda: any(runs.glob("*/checkpoint_*")), "the trial's first checkpoint")
