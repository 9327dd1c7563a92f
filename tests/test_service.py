"""The warm training service end to end on real Ray (CPU, Gloo): `service start` as a user
runs it, `fit --service` from several shells, Ctrl-C, SIGKILL, a worker killed, bad requests.

The service is the suite's one (tests/warm_service.py: its start is the Ray run this file
and tests/test_tune_service.py pay for once): two groups of two workers of one CPU on tiny
MNIST, its own local Ray, in a subprocess like a user's shell. Raw Ray clients attack it as another driver on the cluster could.
Every request is a `fit --service` subprocess too. Everything waits on events (lines a
command prints, files a run holds), never on time.
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

import psutil
import pytest
import torch

from raytrain_mnist.driver.runs import Run
from raytrain_mnist.nn import checkpoint as ckpt
from tests.conftest import (
    MARKER_VAR,
    REPO,
    kill_marked,
    run_cli_here,
    wait_for,
)
from tests.warm_service import (
    NAME,
    TRAIN,
    run_fit,
    running,
    service_command,
    start_service,
    until,
)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    run = Run.at(run_dir)
    with run.local_copy(run.latest_checkpoint()) as directory:
        return ckpt.load(directory)["model"]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- runs


def test_a_service_run_is_an_ordinary_run_and_the_same_request_gives_the_same_weights(
    service,
):
    """Through the service, `fit` prints what it prints without one and leaves an ordinary
    run: summary, run.json and the checkpoints in Ray Train's own record, so `runs` and
    `evaluate` read it with no flag beyond the run; the same name again is already finished, `--fresh` trains it again
    from a fresh model and optimizer: the very same weights, as two plain fits give."""
    storage = service["storage"]
    first = run_fit(service, "same", "--epochs", "3")
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout
    assert "starting run 'same' on service 'svc': 2 worker(s)" in out, out
    assert "epoch   3/3" in out and "best checkpoint: " in out, out
    summary = json.loads((storage / "same" / "summary.json").read_text())
    losses = [h["train_loss"] for h in summary["history"]]
    assert summary["status"] == "finished" and losses[-1] < losses[0], summary
    run = Run(str(storage), "same")
    assert run.latest_checkpoint() == summary["latest_checkpoint"]
    kept = [m["epoch"] for _, m in run.checkpoints()]
    assert len(kept) == 2 and 3 in kept, kept  # --keep-checkpoints 2, the latest among them
    before = _weights(storage / "same")

    listed = run_cli_here("runs", "--storage-path", str(storage))
    assert listed.returncode == 0 and "same" in listed.stdout and "finished" in listed.stdout
    # The run records the service's --data-dir, as a plain fit records its own: no flag.
    scored = run_cli_here("evaluate", str(storage / "same"), "--json")
    assert scored.returncode == 0, scored.stderr
    assert json.loads(scored.stdout)["accuracy"] == pytest.approx(summary["best_val_accuracy"])

    # predict and export take it as they take a plain run; a plain fit of the same name and
    # data (the service's) finds it finished, as it would find its own.
    images = str(service["data"] / "MNIST" / "raw" / "t10k-images-idx3-ubyte")
    pt2 = str(storage / "same.pt2")
    for command in (
        ["predict", str(storage / "same"), images],
        ["export", str(storage / "same"), "--format", "pt2", "--output", pt2],
        [
            "fit",
            "--storage-path",
            str(storage),
            "--name",
            "same",
            "--data-dir",
            str(service["data"]),
            "--dataset",
            "mnist",
            "--num-workers",
            "2",
            "--epochs",
            "3",
            *TRAIN,
        ],
    ):
        done = run_cli_here(*command)
        assert done.returncode == 0 and not done.stderr, (command, done.stdout + done.stderr)
    assert "already finished" in done.stdout, done.stdout

    again = run_fit(service, "same", "--epochs", "3")
    assert again.returncode == 0 and "already finished" in again.stdout, again.stdout
    fresh = run_fit(service, "same", "--epochs", "3", "--fresh")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert _same(before, _weights(storage / "same"))
    assert (storage / "same.previous-1").is_dir()


def test_two_groups_train_two_shells_at_once_and_a_third_waits_its_turn(service):
    """Two shells' requests train at once, one on each group; a third waits and says its
    place; Ctrl-C on the first cancels it (exit 130, resumable) and the third trains on the
    group it freed."""
    storage = service["storage"]
    with running(service, "first", "--epochs", "100") as (first, seen):
        until(first, "first step", seen)
        with running(service, "second", "--epochs", "100") as (second, seen2):
            until(second, "first step", seen2)  # on the other group, while first trains
            with running(service, "third", "--epochs", "1") as (third, waited):
                until(third, "waiting for service 'svc': number 1 in its queue", waited)
                first.send_signal(signal.SIGINT)
                rest, _ = first.communicate(timeout=120)
                after, _ = third.communicate(timeout=300)
            second.send_signal(signal.SIGINT)
            rest2, _ = second.communicate(timeout=120)
    assert first.returncode == 130, "".join(seen) + rest
    assert third.returncode == 0, "".join(waited) + after
    assert second.returncode == 130, "".join(seen2) + rest2
    a = Run(str(storage), "first").latest_metrics()
    b = Run(str(storage), "second").latest_metrics()
    c = json.loads((storage / "third" / "summary.json").read_text())
    assert a["epoch"] >= 1 and b["epoch"] >= 1  # both committed epochs side by side
    # FIFO: the third request trained once the first had stopped.
    assert c["history"][0]["first_step_at"] > a["evaluated_at"]


def test_ctrl_c_cancels_the_request_and_the_same_command_resumes_it(service):
    """Ctrl-C on a `fit --service` cancels its request (exit 130, the resume line); the
    service goes on serving, and the same command resumes the run from its checkpoint."""
    with running(service, "stopped", "--epochs", "8") as (proc, seen):
        until(proc, "epoch   1/8", seen)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    out = "".join(seen) + rest
    assert proc.returncode == 130, out
    assert (
        "interrupted after " in out
        and "--service svc" in out
        and "raytrain-mnist: interrupted" in out
    )
    resumed = run_fit(service, "stopped", "--epochs", "8")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    summary = json.loads((service["storage"] / "stopped" / "summary.json").read_text())
    assert summary["resumed_from_epoch"] >= 1 and summary["epochs_completed"] == 8


def test_a_killed_worker_restarts_the_group_and_the_request_resumes_exactly(service):
    """SIGKILL a worker mid-request: Ray Train restarts the service's worker group, the queue
    hands it the request again and it resumes from the checkpoint filed last; the weights
    are those of the same request never interrupted. The kill follows the first committed
    epoch at once, five epochs before the request could end."""
    storage = service["storage"]
    before = [g["restarts"] for g in _status(service)["group_states"]]
    with running(service, "killed", "--epochs", "6") as (proc, seen):
        until(proc, "epoch   1/6", seen)
        run = Run(str(storage), "killed")
        workers = wait_for(lambda: run.latest_metrics().get("workers"), "a committed epoch")
        os.kill(workers[1]["pid"], signal.SIGKILL)
        rest, _ = proc.communicate(timeout=300)
    out = "".join(seen) + rest
    assert proc.returncode == 0, out
    assert "workers restarted from the checkpoint of epoch" in out, out
    # The service's operator reads it in the service's own output.
    until(service["driver"], "; request 'killed' resumes from its last filed", service["seen"])
    after = [g["restarts"] for g in _status(service)["group_states"]]
    assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 1]  # its group only
    reference = run_fit(service, "unkilled", "--epochs", "6")
    assert reference.returncode == 0, reference.stdout + reference.stderr
    assert _same(_weights(storage / "killed"), _weights(storage / "unkilled"))


def test_a_requester_killed_with_sigkill_loses_its_request_once_its_lease_lapses(service):
    with running(service, "orphan", "--epochs", "50") as (proc, seen):
        until(proc, "epoch   1/50", seen)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    # The service drops the silent request (4 s here) and takes the next one.
    after = run_fit(service, "after-orphan", "--epochs", "1", timeout=240)
    assert after.returncode == 0, after.stdout + after.stderr
    run = Run(str(service["storage"]), "orphan")
    epochs = run.latest_metrics()["epoch"]
    assert 1 <= epochs < 50  # cancelled, its checkpoints kept: resumable


def test_a_diverging_request_fails_alone_in_one_line(service):
    bad = run_fit(service, "diverges", "--epochs", "2", "--lr", "1e6", "--optimizer", "sgd")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    err = [line for line in bad.stderr.splitlines() if line.strip()]
    assert err[-1].startswith("raytrain-mnist: error: training failed: training diverged"), err
    assert "Traceback" not in bad.stderr
    ok = run_fit(service, "after-divergence", "--epochs", "1")
    assert ok.returncode == 0, ok.stdout + ok.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-workers", "4"], "service 'svc' runs 2 worker(s)"),
        (["--use-gpu"], "--use-gpu: service 'svc' trains on CPUs"),
        (["--dataset", "sample"], "--dataset sample: service 'svc' holds its own data"),
        (["--storage-path", "/tmp/elsewhere"], "writes only under"),
    ],
)
def test_what_the_service_cannot_honour_is_refused_in_one_line(service, flags, message):
    bad = run_fit(service, "refused", "--epochs", "1", *flags)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    err = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and message in err[0], bad.stderr
    assert not (service["storage"] / "refused").exists()


#: What a raw Ray client runs first: it joins the service's Ray as any driver can, and
#: holds the claim of the runs it names (``claimed(name)``), as ``fit`` would.
RAW = f"""
import contextlib, json, time, ray
from raytrain_mnist.config import TrainConfig
from raytrain_mnist.driver import cluster, service
from raytrain_mnist.driver.runs import Run
from raytrain_mnist.driver.service.request import write_claim
from raytrain_mnist.service_request import ServiceRequest
cluster._connect_to(service.ServiceClient.address_of({NAME!r}, None))
queue = service.find_queue({NAME!r})
job = ray.get_runtime_context().get_job_id()
claims = contextlib.ExitStack()
def claimed(storage, name, **changes):
    run = claims.enter_context(Run(storage, name).claim())
    write_claim(run.files, "token-" + name)
    request = ServiceRequest(TrainConfig(epochs=1, batch_size=32), storage, name, keep=2,
                             claim="token-" + name)
    return {{**request.to_dict(), **changes}}
def answer(call):
    try:
        return ray.get(call, timeout=60)
    except Exception as exc:
        return {{"raised": str(exc).strip().splitlines()[-1]}}
"""


def _raw(service, body: str) -> dict:
    """What a raw Ray client's script prints last, as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", RAW + body],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=service["env"],
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _status(service) -> dict:
    done = subprocess.run(
        service_command("status", "--name", NAME, "--json"),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=service["env"],
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_a_raw_client_can_neither_escape_the_roots_nor_act_as_a_worker(service, tmp_path):
    """A client that skips `fit`'s checks (its own Ray driver on the cluster) cannot make
    the service write outside its roots, train a run it does not hold, read the request in
    flight or file a checkpoint; 200 long polls never hold `service status` up."""
    storage = str(service["storage"])
    (service["storage"] / "planted").symlink_to(tmp_path)
    answers = _raw(
        service,
        f"""
base = claimed({storage!r}, "raw")
refused = [ray.get(queue.submit.remote(r, job)) for r in [
    {{**base, "storage": {str(tmp_path)!r}}},
    {{**base, "storage": "file://" + {storage!r} + "/%2e%2e"}},
    {{**base, "storage": {storage!r} + "/planted/.."}},
    {{**base, "name": "planted"}},
    {{**base, "name": "../x"}},
    {{**base, "resume_from": "/etc"}},
    {{**base, "code": "import os"}},
    {{**base, "claim": "guess"}},
    {{**base, "train": TrainConfig(epochs=1, batch_size=4096).to_dict()}},
]] + [ray.get(queue.submit.remote(base, "ffffffff"))]
worker = [answer(queue.take.remote("guess", 0, 0.0)),
          answer(queue.filed.remote("guess", "x", "/etc")),
          answer(queue.group_started.remote(None, 0, 0.0, 1, "cpu"))]
unknown = {{"state": "cancelled", "place": None, "error": "unknown request"}}
polls = [queue.state.remote("0" * 32, unknown, 5.0) for _ in range(200)]  # each waits 5 s
started = time.monotonic()
ray.get(queue.info.remote(), timeout=30)
print(json.dumps({{"refused": refused, "worker": worker, "info_s": time.monotonic() - started}}))
""",
    )
    refused = [a.get("refused", a) for a in answers["refused"]]
    assert all(isinstance(r, str) for r in refused), refused
    assert all("outside the service's storage roots" in r for r in refused[:3]), refused
    assert "is a symbolic link" in refused[3] and "is not a plain name" in refused[4]
    assert "is not one of run 'raw''s" in refused[5] and "a request holds" in refused[6]
    assert "is not claimed by this request's requester" in refused[7]
    assert "an epoch would have no step" in refused[8]
    assert "is no live Ray job on this cluster" in refused[9]
    assert all("only the service's own workers" in w["raised"] for w in answers["worker"])
    assert answers["info_s"] < 1.0, answers
    assert not any(tmp_path.iterdir())


def test_a_poison_request_fails_alone_and_the_one_behind_it_trains(service):
    """A request whose checkpoint makes its workers fail every time (inside its run, so
    the queue takes it) fails its group twice, then fails alone with one line; that group
    restarts without it, the other never restarts, and a good request finishes."""
    storage = str(service["storage"])
    before = _status(service)["group_states"]
    answers = _raw(
        service,
        f"""
import torch
from raytrain_mnist.nn.checkpoint import FORMAT
poison = claimed({storage!r}, "poison")
bad = {storage!r} + "/poison/checkpoint_bad"
import os; os.makedirs(bad)
torch.save({{"format": FORMAT, "epoch": 1, "history": []}}, bad + "/state.pt")
ids = [ray.get(queue.submit.remote({{**poison, "resume_from": bad}}, job))["id"],
       ray.get(queue.submit.remote(claimed({storage!r}, "good"), job))["id"]]
states = [None, None]
while any(s is None or s["state"] not in ("finished", "failed", "cancelled") for s in states):
    states = [ray.get(queue.state.remote(i, s, 1.0)) for i, s in zip(ids, states)]
print(json.dumps(states))
""",
    )
    assert answers[0]["state"] == "failed", answers
    assert answers[0]["error"].startswith("the request failed its worker group 2 times"), answers
    assert answers[1]["state"] == "finished", answers
    after = _status(service)["group_states"]
    assert sorted(a["restarts"] - b["restarts"] for a, b in zip(after, before, strict=True)) == [
        0,
        2,
    ]
    assert _status(service)["failed"] is None


def test_a_second_start_of_a_running_name_is_refused_and_leaves_it_be(service):
    again = subprocess.run(
        service_command(
            "start", "--name", NAME, "--num-workers", "1", "--storage-path", str(service["storage"])
        ),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=service["env"],
        timeout=120,
    )
    assert again.returncode == 2, again.stdout + again.stderr
    assert f"a service named '{NAME}' already runs on this machine" in again.stderr
    assert _status(service)["name"] == NAME  # its registry entry still finds it


def test_service_status_shows_its_workers_queue_and_what_it_served(service):
    done = subprocess.run(
        service_command("status", "--name", NAME, "--json"),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=service["env"],
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    info = json.loads(done.stdout)
    assert info["workers"] == 2 and info["device"] == "cpu" and info["backend"] == "gloo"
    assert info["queue"] == 0 and info["served"] >= 1
    assert info["groups"] == 2 and info["free_groups"] == 2
    assert [g["group"] for g in info["group_states"]] == [0, 1]
    assert "workers:" in done.stderr and "served:" in done.stderr
    assert "group 1:" in done.stderr


def test_a_service_on_a_ray_of_its_own_starts_no_process_that_guards_nothing(service):
    # Its Ray stops with it, as a fit's own: no placement-group cleaner per group (a process
    # each, ticking for the service's whole life), no AutoscalingCoordinator.
    titles = []
    for process in psutil.Process(service["driver"].pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            titles.append(" ".join(process.cmdline()))
    assert sum("ray::TrainController" in t for t in titles) == 2, titles  # one per group
    assert not any("PlacementGroupCleaner" in t or "Autoscaling" in t for t in titles), titles


def test_the_service_driver_killed_ends_its_request_resumable_by_a_new_start(service):
    """SIGKILL the service's driver mid-request: its Ray goes with it (it started that Ray),
    the requester ends in one line that gives its resume command; `service start` again with
    the same name serves, and that very command resumes the run from its last filed
    checkpoint. Last in the module: the service after it is the new one."""
    with running(service, "driver-lost", "--epochs", "8") as (proc, seen):
        until(proc, "epoch   1/8", seen)
        service["driver"].kill()
        rest, _ = proc.communicate(timeout=180)
    service["driver"].wait(timeout=60)
    out = "".join(seen) + rest
    assert proc.returncode == 1, out
    last = rest.strip().splitlines()[-1]
    prefix = "raytrain-mnist: error: training failed: service 'svc' went away; resume with: "
    assert last.startswith(prefix) and "Traceback" not in out, out
    assert "(worker logs: " in last, last  # the service's, on its node
    resume = shlex.split(last[len(prefix) :].split(" (worker logs: ")[0])
    epochs = Run(str(service["storage"]), "driver-lost").latest_metrics()["epoch"]
    assert 1 <= epochs < 8

    # What is left of the killed service's Ray, Ray's reaper ends within a minute (its agents
    # poll for their raylet); ended now, so that the new service starts on free cores.
    kill_marked(service["env"][MARKER_VAR])
    start_service(service)
    resumed = subprocess.run(
        resume, capture_output=True, text=True, cwd=REPO, env=service["env"], timeout=300
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from the checkpoint of epoch {epochs}" in resumed.stdout, resumed.stdout
    summary = json.loads((service["storage"] / "driver-lost" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["epochs_completed"] == 8


def test_no_service_of_that_name_is_one_line(tmp_path):
    bad = run_cli_here("fit", "--service", "nowhere", "--storage-path", str(tmp_path))
    assert bad.returncode == 1, bad.stderr
    assert bad.stderr.startswith("raytrain-mnist: error: --service nowhere: no service")
    assert bad.stderr.count("\n") == 1
