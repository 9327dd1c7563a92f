"""SIGTERM is Ctrl-C: ``submit stop``, systemd, Docker, Kubernetes and Slurm stop a command
with SIGTERM, and the command stops as it does on Ctrl-C, then exits 143 (128 + 15).

Through the real CLI, each with a local Ray of its own (a private RAY_TMPDIR, and a marker in
the environment of every process it starts): the signal is sent once the command printed
what shows it is training (an epoch committed, a trial started), never after a sleep.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from raytrain_mnist.driver.runs import Run
from tests.conftest import MARKER_VAR, REPO, kill_marked, no_process_left, tiny_run_flags


def _terminate_when(command: list[str], env: dict, ready, tmp_path: Path):
    """Start ``command``, send it SIGTERM once a line of its stdout satisfies ``ready``;
    (exit status, stdout, stderr lines)."""
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO, env=env
        )
        seen: list[str] = []
        try:
            for line in process.stdout:
                seen.append(line)
                if ready(line):
                    break
            else:
                raise AssertionError("".join(seen) + err_path.read_text())
            process.send_signal(signal.SIGTERM)
            out, _ = process.communicate(timeout=600)  # generous: a loaded machine stops slowly
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
    # Ray's own log lines may come after ours while it shuts down (a GCS call that timed out
    # on a loaded machine): set aside, ours end the rest.
    lines = [
        line
        for line in err_path.read_text().splitlines()
        if line.strip() and not RAY_LOG_LINE.match(line)
    ]
    return process.returncode, "".join(seen) + out, lines


#: A line of Ray's logging: its Python loggers' ("2026-12-01 11:20:00,123\tERROR
#: services.py:123 -- ...") or its C++ processes' ("[2026-12-01 11:20:00,123 E 12 34] ...").
RAY_LOG_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+[A-Z]+ \S+\.py:\d+ -- "
    r"|\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z] \d+ \d+\] )"
)


def test_sigterm_stops_fit_as_ctrl_c_does_and_exits_143(tiny_mnist, tmp_path, ray_env, s3):
    """On s3:// (a lease, its heartbeat, pyarrow's S3 up to the end): the stop path with the
    most to finish. Ctrl-C's own on a local disk is test_resilience.py's, the same fit."""
    storage = s3()
    env = {**ray_env, **{k: v for k, v in os.environ.items() if k.startswith("AWS_")}}
    command = [
        sys.executable,
        "-m",
        "raytrain_mnist",
        "fit",
        # 30 epochs: still training when the first epoch's line has been read
        *tiny_run_flags(tiny_mnist, storage, "terminated", epochs=30),
    ]
    status, out, err = _terminate_when(
        command, env, lambda line: line.startswith("epoch   1/30"), tmp_path
    )
    assert status == 143, out[-3000:] + "\n".join(err[-30:])
    assert err[-1] == "raytrain-mnist: terminated", err[-30:]
    assert err[-2].startswith("interrupted after ") and " epoch(s); resume with: " in err[-2]
    assert "--name terminated" in err[-2] and "Traceback" not in out + "\n".join(err)
    assert "SIGTERM: stopping the workers; the last committed checkpoint is kept" in err
    summary = Run(storage, "terminated").summary()
    assert summary["status"] == "interrupted" and 1 <= summary["epochs_completed"] < 30
    assert summary["latest_checkpoint"]
    assert "val_accuracy" in out  # the summary was printed, as after Ctrl-C
    no_process_left(env[MARKER_VAR])


def test_sigterm_stops_tune_as_ctrl_c_does_and_exits_143(tiny_mnist, tmp_path, ray_env):
    command = [
        sys.executable,
        "-m",
        "raytrain_mnist",
        "tune",
        *tiny_run_flags(tiny_mnist, tmp_path, "terminated", cpus_per_worker=1),
        "--num-samples",
        "2",
        "--max-epochs",
        "20",
        "--max-concurrent-trials",
        "1",
        "--scheduler",
        "fifo",
    ]
    status, out, err = _terminate_when(
        command, ray_env, lambda line: line.startswith("trial ") and " started: " in line, tmp_path
    )
    assert status == 143, out[-3000:] + "\n".join(err[-30:])
    assert err[-1] == "raytrain-mnist: terminated", err[-30:]
    assert err[-2].startswith("search interrupted with ") and " resume with: " in err[-2]
    assert "--name terminated" in err[-2] and "Traceback" not in out + "\n".join(err)
    assert "rank" in out and "unfinished" in out, out[-3000:]  # the trials, as after Ctrl-C
    best = json.loads((tmp_path / "terminated" / "best.json").read_text())
    assert best["num_trials"] == 2 and best["num_unfinished"] >= 1 and best["num_finished"] == 0
    no_process_left(ray_env[MARKER_VAR])


_IN_XDIST = bool(os.environ.get("PYTEST_XDIST_WORKER"))


@pytest.mark.skipif(not _IN_XDIST, reason="the test below runs in this process itself")
def test_a_stopped_fit_lets_go_of_ray_before_ray_shuts_down_in_its_own_pytest():
    """Under xdist (make test), the next test in a pytest process of its own: its Ctrl-C
    (``_thread.interrupt_main``) would end the xdist worker it ran in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURR"))}
    test = f"{Path(__file__).name}::test_a_stopped_fit_lets_go_of_ray_before_ray_shuts_down"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/{test}"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0 and "1 passed" in done.stdout, (
        done.stdout[-4000:] + done.stderr[-2000:]
    )


@pytest.mark.skipif(
    _IN_XDIST, reason="its Ctrl-C would end this xdist worker: the test above runs it"
)
def test_a_stopped_fit_lets_go_of_ray_before_ray_shuts_down(tiny_mnist, tmp_path, monkeypatch):
    """The stop protocol, in process: Ctrl-C once the first epoch is committed, and by the
    time ``ray.shutdown()`` starts no thread of the fit that uses Ray runs, no garbage holds
    Ray's objects, and garbage collection is off until Ray is down. (Garbage that holds an object reference or an actor handle is freed by
    whichever thread next collects; one that does so while Ray shuts down makes Ray's core
    worker end the process with exit 1, "The core worker has already been shutdown".)"""
    import _thread
    import gc
    import threading

    import ray

    from raytrain_mnist.driver.events import EpochCommitted
    from raytrain_mnist.driver.fitting import fit
    from raytrain_mnist.fit import parse_config

    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: unix socket paths
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    monkeypatch.setenv(MARKER_VAR, marker := uuid.uuid4().hex)
    seen: dict = {}
    real_shutdown = ray.shutdown

    def shutdown(*args, **kwargs):
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            seen["garbage"] = sorted(
                {type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("ray")}
            )
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        ours = ("trainer.fit", "RunMonitor", "plots", "files")
        seen["threads"] = sorted(t.name for t in threading.enumerate() if t.name in ours)
        seen["collecting"] = gc.isenabled()
        return real_shutdown(*args, **kwargs)

    def on_event(event):
        if isinstance(event, EpochCommitted) and not seen.get("interrupted"):
            seen["interrupted"] = True
            _thread.interrupt_main()  # Ctrl-C, as the main thread receives it

    monkeypatch.setattr(ray, "shutdown", shutdown)
    assert not ray.is_initialized()
    cfg = parse_config(tiny_run_flags(tiny_mnist, tmp_path / "runs", "stopped", epochs=30))
    try:
        result = fit(cfg, on_event)
    finally:
        kill_marked(marker)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert result.status == "interrupted" and 1 <= result.summary["epochs_completed"] < 30
    # Only the files' thread may still run (it touches nothing of Ray), and no thread
    # collects garbage until Ray is down.
    assert set(seen["threads"]) <= {"files"} and seen["collecting"] is False, seen
    assert gc.isenabled()
    assert "ObjectRef" not in seen["garbage"] and "ActorHandle" not in seen["garbage"], seen
