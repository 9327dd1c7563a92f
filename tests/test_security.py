"""What a run exposes: the sockets of the Ray it starts, the token it sends, the files it loads."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import psutil

from .conftest import (
    MARKER_VAR,
    REPO,
    is_loopback,
    kill_marked,
    listening,
    marked,
    tiny_run_flags,
    write_tiny_mnist,
)


def test_the_ray_that_fit_starts_listens_on_loopback_only(tmp_path, sample_digits):
    """Every socket that `fit`'s own Ray listens on, for the whole run (GCS, raylet, object
    manager, dashboard and its agents, Train workers and torch's rendezvous), is loopback."""
    data = write_tiny_mnist(tmp_path / "data", sample_digits, n_train=256, n_test=64)
    marker = uuid.uuid4().hex
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "GLOO_SOCKET_IFNAME")
    }
    env[MARKER_VAR] = marker
    fit = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "raytrain_mnist",
            "fit",
            *tiny_run_flags(data, tmp_path / "runs", num_workers=2, cpus_per_worker=1, epochs=1),
        ],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    seen: dict[tuple[str, int], str] = {}
    try:
        root = psutil.Process(fit.pid)
        while fit.poll() is None:
            try:
                pids = {fit.pid, *(p.pid for p in root.children(recursive=True))}
            except psutil.Error:
                break
            # Processes that rename themselves overwrite the environment the marker is in:
            # the run's processes are the driver's descendants, or carry the marker.
            seen.update(listening(pids | set(marked(marker))))
            time.sleep(1.0)
        output = fit.communicate(timeout=60)[0].decode()
    finally:
        kill_marked(marker)
    exposed = {f"{ip}:{port} ({name})" for (ip, port), name in seen.items() if not is_loopback(ip)}
    assert not exposed, f"listening beyond loopback: {sorted(exposed)}"
    # The run was watched while it ran: its Ray and its Train workers were listening.
    assert {"gcs_server", "raylet", "ray::RayTrainWorker"} <= set(seen.values()), seen
    assert fit.returncode == 0, output[-3000:]
