"""The suite's one warm training service: `raytrain-mnist service start` as a user's shell
runs it (a subprocess on a Ray of its own), shared by every test that asks for ``service``
(tests/test_service.py and tests/test_tune_service.py: one xdist group, conftest).

Two groups of two workers of one CPU on tiny MNIST. It starts with the first test that uses
it and stops after the last (conftest's ``stopped_after_last_user``), by ``service stop`` in the middle of a
request, which is checked too. Its start is the Ray run those modules pay for once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from raytrain_mnist.driver.runs import Run
from tests.conftest import MARKER_VAR, REPO, kill_marked, no_process_left, stopped_after_last_user

NAME = "svc"
#: The training flags of every request here: tiny data, batches of 32 over two workers.
TRAIN = ["--batch-size", "32", "--lr", "0.05", "--progress", "lines"]


@pytest.fixture(scope="session")
def service(tmp_path_factory, tiny_mnist, sample_digits):
    """`raytrain-mnist service start` in the foreground, as a user's shell runs it; stopped
    by `service stop` after the last test that uses it, which checks nothing of it is left."""
    import shutil
    import tempfile
    import uuid

    root = tmp_path_factory.mktemp("service")
    ray_tmp = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "RAY_TMPDIR": str(ray_tmp),
        MARKER_VAR: uuid.uuid4().hex,
        "RAYTRAIN_MNIST_CACHE": str(root / "cache"),  # where the service registers itself
        # A requester killed with SIGKILL is given up on after this much silence.
        "RAYTRAIN_MNIST_REQUEST_LEASE_S": "4",
    }
    service = {"env": env, "storage": root / "runs", "data": tiny_mnist}
    try:
        start_service(service)
        stop = stopped_after_last_user("service", lambda: _stop_service(service))
        yield service
        stop()
    finally:
        driver = service.get("driver")
        if driver is not None and driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=30)
        kill_marked(env[MARKER_VAR])
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _stop_service(service: dict) -> None:
    """`service stop` in the middle of a request: the run's summary holds the epoch filed
    last, the service says it stopped, and nothing of it is left."""
    driver, seen, env = service["driver"], service["seen"], service["env"]
    storage = service["storage"]
    with running(service, "stopped-mid", "--epochs", "50") as (proc, lines):
        until(proc, "epoch   1/50", lines)
        stopped = subprocess.run(
            service_command("stop", "--name", NAME),
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=120,
        )
        lines.append(proc.communicate(timeout=120)[0])
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    summary = json.loads((storage / "stopped-mid" / "summary.json").read_text())
    filed = Run(str(storage), "stopped-mid").latest_metrics()["epoch"]
    assert summary["epochs_completed"] == filed, "".join(lines)
    assert "Traceback" not in "".join(lines)
    rest, _ = driver.communicate(timeout=120)
    assert driver.returncode == 0, "".join(seen) + rest
    assert f"service '{NAME}' stopped after" in rest, rest
    assert "Traceback" not in "".join(seen) + rest
    no_process_left(env[MARKER_VAR])


def start_service(service: dict) -> None:
    """`raytrain-mnist service start` in the foreground, on a Ray of its own, until it says
    it is ready: two workers of one CPU on tiny MNIST."""
    command = service_command(
        "start",
        "--name",
        NAME,
        "--num-workers",
        "2",
        "--groups",
        "2",
        "--cpus-per-worker",
        "1",
        "--dataset",
        "mnist",
        "--data-dir",
        str(service["data"]),
        "--storage-path",
        str(service["storage"]),
    )
    service["seen"] = []
    service["driver"] = driver = _popen(service, command)
    until(driver, f"service '{NAME}' ready", service["seen"])
    assert driver.poll() is None, "".join(service["seen"])


def fit_command(service, name: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "raytrain_mnist",
        "fit",
        "--service",
        NAME,
        "--storage-path",
        str(service["storage"]),
        "--name",
        name,
        *TRAIN,
        *extra,
    ]


def run_fit(service, name: str, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        fit_command(service, name, *extra),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=service["env"],
        timeout=timeout,
    )


def start_fit(service, name: str, *extra: str) -> subprocess.Popen:
    return _popen(service, fit_command(service, name, *extra))


def service_command(*args: str) -> list[str]:
    """``raytrain-mnist service ARGS`` as a user's shell runs it."""
    return [sys.executable, "-m", "raytrain_mnist", "service", *args]


def _popen(service: dict, command: list[str]) -> subprocess.Popen:
    """``command`` in a session of its own (killed whole on the way out), its output (and
    errors) read line by line."""
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=service["env"],
        start_new_session=True,
    )


@contextlib.contextmanager
def running(service, name: str, *extra: str) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """A `fit --service` started in its own session, and the lines read from it so far;
    killed on the way out if it is still running (a failed assertion)."""
    proc = start_fit(service, name, *extra)
    try:
        yield proc, []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def until(proc: subprocess.Popen, text: str, seen: list[str]) -> None:
    """Read ``proc``'s output until a line holds ``text``."""
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"{text!r} never came: " + "".join(seen))
