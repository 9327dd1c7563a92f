"""The Ray that `fit` starts for itself: its start-up and teardown timeline, what it listens
on, how it authenticates, and what the command prints.

One real `fit` command (the bundled sample, 2 workers, 2 epochs, its own local Ray, started
as a newcomer's first `make fit` would: no RAY_AUTH_MODE, no RAY_ADDRESS, on a machine where
another Ray holds the dashboard agent's default port) is shared by every assertion: its ``summary.json`` ``timeline``, the phase lines it printed, and what a thread
saw while it ran: every socket its processes listened on and the auth mode Ray's servers
were started with. Not timed: the figures are a benchmark's (benchmarks/compare.py); this
checks that they are all there and make sense.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from raytrain_mnist.driver.events import STARTUP, TEARDOWN
from tests.conftest import MARKER_VAR, REPO, is_loopback, kill_marked, listening, marked

_PHASE = re.compile(r"^ +(\d+\.\d) s  (.+)$", re.M)

#: Ray Train's default seconds between the controller's polls of the workers.
RAY_POLL_S = 2.0

#: Ray's default port for a node's dashboard agent (``ray_constants``): another Ray on the
#: machine holds it.
RAY_AGENT_PORT = 52365

#: Ray Train's actors, by the class their process title names.
_TRAIN_ACTORS = ("TrainController", "RayTrainWorker")

#: Ray's own servers, whose environment says which auth mode the cluster was started with.
_RAY_SERVERS = ("gcs_server", "raylet")


def _watch(fit: subprocess.Popen, marker: str, done: threading.Event, seen: dict) -> None:
    """Until ``fit`` exits: every socket that its process tree (and what carries ``marker``)
    listens on into ``seen["sockets"]``, ``(ip, port) -> process name``, the
    ``RAY_AUTH_MODE`` of Ray's servers into ``seen["auth_mode"]``, ``name -> value``, each
    process's command line (a Ray actor's names its class) into ``seen["titles"]``, the
    raylet's whole command line into ``seen["raylet"]``, and into ``seen["torch"]``, for the
    driver and per Ray Train actor class, whether any process of it was ever seen with
    torch's library mapped."""
    try:
        root = psutil.Process(fit.pid)
    except psutil.Error:  # already gone: nothing to watch
        return
    while fit.poll() is None:
        pids = {fit.pid}
        try:
            pids.update(p.pid for p in root.children(recursive=True))
        except psutil.Error:  # the driver went between the poll and the listing
            pass
        # Processes that rename themselves overwrite the environment the marker is in:
        # the run's processes are the driver's descendants, or carry the marker.
        pids |= set(marked(marker))
        seen["sockets"].update(listening(pids))
        for pid in pids:
            try:
                process = psutil.Process(pid)
                title = " ".join(process.cmdline())
                seen["titles"].add(title[:200])
                if process.name() in _RAY_SERVERS and process.name() not in seen["auth_mode"]:
                    seen["auth_mode"][process.name()] = process.environ().get("RAY_AUTH_MODE")
                    if process.name() == "raylet":  # it names the agent's command, log folder
                        seen["raylet"] = " ".join(process.cmdline())
                kinds = [a for a in _TRAIN_ACTORS if title.startswith(f"ray::{a}")]
                for kind in kinds + ["driver"] * (pid == fit.pid):
                    maps = Path(f"/proc/{pid}/maps").read_text()
                    seen["torch"][kind] = seen["torch"].get(kind, False) or "libtorch" in maps
            except (psutil.Error, OSError):  # gone between the listing and the look
                continue
        done.wait(0.5)


@pytest.fixture(scope="module")
def timed_fit(tmp_path_factory) -> dict:
    storage = tmp_path_factory.mktemp("startup")
    home = tmp_path_factory.mktemp("home")  # Ray writes ~/.ray/auth_token
    marker = uuid.uuid4().hex
    unset = ("RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    env = {k: v for k, v in os.environ.items() if k not in (*unset, "GLOO_SOCKET_IFNAME")}
    env.update({"HOME": str(home), MARKER_VAR: marker})
    # Ray Train's own poll, not the suite's faster one: how a run's end is seen is asserted.
    env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(RAY_POLL_S)
    command = [sys.executable, "-m", "raytrain_mnist", "fit", "--dataset", "sample"]
    command += ["--epochs", "2", "--num-workers", "2", "--cpus-per-worker", "1"]
    command += ["--progress", "lines", "--storage-path", str(storage), "--name", "timed"]
    seen: dict = {"sockets": {}, "auth_mode": {}, "titles": set(), "raylet": "", "torch": {}}
    done = threading.Event()
    # As another Ray on this machine would (here, someone else's may already).
    held = contextlib.ExitStack()
    with contextlib.suppress(OSError):
        held.enter_context(socket.create_server(("127.0.0.1", RAY_AGENT_PORT)))
    before = time.time()
    fit = subprocess.Popen(
        command,
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    watcher = threading.Thread(target=_watch, args=(fit, marker, done, seen), daemon=True)
    watcher.start()
    try:
        out, err = fit.communicate(timeout=600)
        after = time.time()
    finally:
        done.set()
        watcher.join(timeout=60)
        if fit.poll() is None:
            fit.kill()
        kill_marked(marker)
        held.close()
    assert fit.returncode == 0, out[-3000:] + err[-3000:]
    run = storage / "timed"
    return {
        "summary": json.loads((run / "summary.json").read_text()),
        "out": out,
        "err": err,
        "before": before,
        "after": after,
        "png": (run / "training_curves.png").read_bytes(),
        "home": home,
        **seen,
    }


def test_every_startup_and_teardown_moment_is_recorded_in_order(timed_fit):
    timeline = timed_fit["summary"]["timeline"]
    assert timeline["t0_is"] == "process start"
    assert list(timeline["startup_s"]) == list(STARTUP), timeline
    assert list(timeline["teardown_s"]) == list(TEARDOWN), timeline
    moments = [*timeline["startup_s"].values(), *timeline["teardown_s"].values()]
    assert moments == sorted(moments), timeline
    assert moments[0] > 0
    # Two epochs of training lie between the first step and the last report.
    assert timeline["teardown_s"]["last_report"] > timeline["startup_s"]["first_step"]
    assert "same clock" in timeline["worker_clock"]
    # Ray Train's PlacementGroupCleaner held the worker group's shutdown for 12 s (its State
    # API call); asking the GCS takes milliseconds (compat.lighter_run_callbacks).
    teardown = timeline["teardown_s"]
    assert teardown["worker_group_shut_down"] - teardown["workers_finished"] < 6, teardown
    # The controller saw the end at a poll soon after the last checkpoint's commit, not at its
    # next regular one, a whole interval on (worker/endpoll.py).
    end_seen = teardown["workers_finished"] - teardown["checkpoint_committed"]
    assert end_seen < RAY_POLL_S, teardown
    # The curves were drawn and written (while Ray shut down).
    assert timed_fit["png"].startswith(b"\x89PNG")


def test_the_timeline_lies_within_the_commands_wall_time(timed_fit):
    timeline, before, after = (
        timed_fit["summary"]["timeline"],
        timed_fit["before"],
        timed_fit["after"],
    )
    # t0 is the process's start (10 ms ticks), after the test started it.
    assert before - 0.05 <= timeline["t0"] <= before + 5, (before, timeline["t0"])
    last = timeline["t0"] + timeline["teardown_s"]["files_written"]
    assert last <= after, (last, after)
    # What the summary does not cover (Python's exit) is small beside the run.
    assert after - last < 0.5 * (after - before), (after - last, after - before)


def test_phase_lines_show_the_moments_as_recorded(timed_fit):
    out, startup = timed_fit["out"], timed_fit["summary"]["timeline"]["startup_s"]
    lines = {text: float(seconds) for seconds, text in _PHASE.findall(out)}
    expected = {
        "Ray ready": "ray_ready",
        "workers starting": "trainer_started",
        "controller started": "controller_started",
        "2 worker(s) started": "worker_group_started",
        "process group formed (gloo)": "process_group_formed",
        "model prepared": "model_prepared",
        "first step": "first_step",
    }
    for text, key in expected.items():
        assert text in lines, out
        assert abs(lines[text] - startup[key]) <= 0.06, (text, lines[text], startup[key])
    shown = [float(seconds) for seconds, _ in _PHASE.findall(out)]
    assert shown == sorted(shown), out


def test_a_run_on_its_own_ray_starts_no_process_that_serves_nothing(timed_fit):
    # The Ray goes with the run: no placement-group cleaner (it guards a cluster that outlives
    # a dead controller) and no DatasetManager (the run passes no Ray Datasets).
    actors = sorted(t for t in timed_fit["titles"] if t.startswith("ray::"))
    assert any("TrainController" in t for t in actors), actors  # the watcher saw the run's
    assert not any("PlacementGroupCleaner" in t or "DatasetManager" in t for t in actors), actors
    # Nor an AutoscalingCoordinator: a fixed-size run on a Ray without an autoscaler asks
    # none for resources.
    assert not any("AutoscalingCoordinator" in t for t in actors), actors
    # Nor a log monitor: the workers' output stays in their files (no log_to_driver), which
    # is all it would tail, to publish to no one. Ray's other servers did run.
    titles = timed_fit["titles"]
    assert any("gcs_server" in t for t in titles) and any("raylet" in t for t in titles), titles
    assert not any("log_monitor.py" in t for t in titles), sorted(titles)
    # Nor an autoscaler monitor: nothing to scale, and Ray's shutdown waited 1 s for it.
    assert not any("autoscaler/_private/monitor.py" in t for t in titles), sorted(titles)
    # Nor a dashboard process: without a dashboard Ray starts one to report usage statistics
    # only (0.7 s of `ray.init`). The dashboard agent, which Ray Train's workers report to,
    # runs.
    assert not any("dashboard/dashboard.py" in t for t in titles), sorted(titles)
    # (its title is its command line or, once Ray renamed it, ray::DashboardAgent)
    assert any("dashboard/agent.py" in t or "DashboardAgent" in t for t in titles), titles


def test_neither_the_driver_nor_the_runs_controller_loads_torch(timed_fit):
    # They load the data, order the workers' process group and never touch a tensor: Ray's
    # TorchConfig and TorchTrainer, or data as tensors, would have them import torch, seconds
    # of every run's start-up (compat.torch_config, data.MnistData). The workers, which
    # train, show that the look can see torch where it is.
    expected = {"driver": False, "TrainController": False, "RayTrainWorker": True}
    assert timed_fit["torch"] == expected


def test_a_port_another_ray_holds_does_not_hold_up_the_start(timed_fit):
    """Ray's dashboard agent listens on a fixed port by default; where another Ray on the
    machine holds it, the agent retried the bind for 3.4 s and ``ray.init`` waited (2.2 s
    against 5.2 s, benchmarks/README.md). fit's agent listens where the system put it."""
    log_dir = re.search(r"--log-dir=(\S+)", timed_fit["raylet"]).group(1)
    log = (Path(log_dir) / "dashboard_agent.log").read_text()
    assert "Failed to bind" not in log, log[-3000:]
    served = re.findall(r"Dashboard agent http address: [\d.]+:(\d+)", log)
    assert served and int(served[0]) != RAY_AGENT_PORT, log[-3000:]


def test_the_ray_that_fit_starts_listens_on_loopback_only(timed_fit):
    """Every socket that `fit`'s own Ray listens on, for the whole run (GCS, raylet, object
    manager, Train workers and torch's rendezvous), is loopback."""
    seen = timed_fit["sockets"]
    exposed = {f"{ip}:{port} ({name})" for (ip, port), name in seen.items() if not is_loopback(ip)}
    assert not exposed, f"listening beyond loopback: {sorted(exposed)}"
    # The run was watched while it ran: its Ray and its Train workers were listening.
    assert {"gcs_server", "raylet", "ray::RayTrainWorker"} <= set(seen.values()), seen


def test_the_ray_that_fit_starts_uses_token_auth_and_says_nothing_about_it(timed_fit):
    """With RAY_AUTH_MODE unset (a newcomer's first `make fit`), the local Ray that fit starts
    uses token authentication, Ray's default, without Ray's WARNING that it chose it; the run
    trained on it."""
    assert timed_fit["auth_mode"] == dict.fromkeys(_RAY_SERVERS, "token"), timed_fit["auth_mode"]
    assert (timed_fit["home"] / ".ray" / "auth_token").is_file()
    output = timed_fit["out"] + timed_fit["err"]
    assert "Token authentication" not in output, output[-3000:]
    assert timed_fit["summary"]["status"] == "finished", timed_fit["summary"]


def test_rank_0_asks_for_fast_polls_an_interval_before_the_run_ends(monkeypatch):
    """The controller takes a new poll interval only after the wait it is in, so rank 0 asks
    once the training left (this epoch's steps and every later epoch's) should take less
    than an interval and a margin: the wait in progress then ends before the last report."""
    from raytrain_mnist.worker import endpoll

    asked, clock = [], [0.0]
    monkeypatch.setattr(endpoll.compat, "poll_workers_every", lambda s: asked.append(s) or True)
    monkeypatch.setattr(endpoll.time, "perf_counter", lambda: clock[0])
    end = endpoll.EndPoll(steps_per_epoch=100, interval_s=2.0)  # steps of 0.1 s below

    def run_epoch(epochs_after: int) -> int | None:
        end.epoch_start(epochs_after)
        for step in range(1, 101):
            clock[0] += 0.1
            end.on_step(step)
            if asked:
                return step
        return None

    assert run_epoch(epochs_after=1) is None  # 10 s and more were left all along
    # Asked once 2.5 s (25 steps) or less were left, and only once.
    assert run_epoch(epochs_after=0) == 75 and asked == [endpoll.END_POLL_S]
    end.now()
    end.on_step(100)
    assert asked == [endpoll.END_POLL_S]

    # Epochs shorter than an interval: asked in the one before the last.
    asked.clear()
    short = endpoll.EndPoll(steps_per_epoch=10, interval_s=2.0)
    short.epoch_start(epochs_after=1)
    for step in range(1, 11):
        clock[0] += 0.1
        short.on_step(step)
    assert asked == [endpoll.END_POLL_S]


def test_the_process_group_config_falls_back_to_rays_where_a_name_it_sends_moved(monkeypatch):
    from ray.train.torch import TorchConfig

    from raytrain_mnist import compat
    from raytrain_mnist.compat import process_group

    ours = compat.torch_config("gloo", "env")
    assert not isinstance(ours, TorchConfig)  # its module imports no torch
    assert (ours.backend, ours.init_method, ours.to_dict()["timeout_s"]) == ("gloo", "env", 1800)
    # A Ray release that renamed one of them (the check reads Ray's source, not its module).
    renamed = (*process_group._RAY_TORCH_NAMES[1:], "_setup_torch_process_group_renamed")
    monkeypatch.setattr(process_group, "_RAY_TORCH_NAMES", renamed)
    rays = compat.torch_config("nccl", "tcp")
    assert type(rays) is TorchConfig and (rays.backend, rays.init_method) == ("nccl", "tcp")
