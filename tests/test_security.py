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


def test_the_token_file_submit_carried_is_deleted_once_read(tmp_path):
    """The ``serve-token`` in Ray's unpacked copy of a job's working directory is gone once
    serve has read it; a token file of the user's own stays."""
    from raytrain_mnist.serve import read_token_file

    token = "t0ken-0123456789abcdef"
    carried = tmp_path / "runtime_resources" / "working_dir_files" / "_ray_pkg_1" / "serve-token"
    carried.parent.mkdir(parents=True)
    carried.write_text(f"{token}\nrandom line\n")
    assert read_token_file(str(carried)) == token
    assert not carried.exists()
    own = tmp_path / "serve-token"
    own.write_text(token + "\n")
    assert read_token_file(str(own)) == token and own.exists()


def test_a_checkpoint_with_non_finite_weights_is_refused_at_load(tmp_path):
    """A diverged run's weights (NaN, inf) would make every /predict an error: serve refuses
    the checkpoint in one line, before anything starts."""
    from raytrain_mnist.nn import checkpoint as ckpt
    from raytrain_mnist.nn.model import ConvNet

    from .conftest import run_cli_here

    weights = ConvNet().state_dict()
    next(v for v in weights.values() if v.is_floating_point()).view(-1)[0] = float("nan")
    path = tmp_path / "checkpoint_000000"
    path.mkdir()
    ckpt.save(path, {"model": weights, "epoch": 0})
    result = run_cli_here("serve", str(path), "--write-config", str(tmp_path / "c.yaml"))
    assert result.returncode != 0 and "non-finite weights" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "c.yaml").exists()
