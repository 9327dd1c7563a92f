"""The real CLI: bad input is one line and a non-zero exit, never a traceback or a hang."""

from __future__ import annotations

import socket
import time

import pytest

from tests.conftest import run_cli


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_one_line_error(result, code: int, fragment: str) -> None:
    assert result.returncode == code, result.stderr + result.stdout
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("args, code, fragment", [
    (["--epochs", "0"], 2, "--epochs must be an integer >= 1"),
    (["--epochs", "two"], 2, "argument --epochs: invalid int value"),
    (["--lr", "nan"], 2, "--lr must be a positive number"),
    (["--lr", "-1"], 2, "--lr must be a positive number"),
    (["--num-workers", "0"], 2, "--num-workers must be an integer >= 1"),
    (["--num-workers", "4", "--batch-size", "3"], 2, "smaller than --num-workers"),
    (["--batch-size", "100", "--num-workers", "3"], 2, "multiple of 3"),
    (["--amp", "fp8"], 2, "argument --amp: invalid choice"),
    (["--amp", "fp16"], 2, "--amp fp16 needs --use-gpu"),
    (["--sync-bn", "on"], 2, "SyncBatchNorm runs only on GPUs"),
    (["--backend", "nccl"], 2, "--backend nccl needs --use-gpu"),
    (["--init-method", "file"], 2, "argument --init-method: invalid choice"),
    (["--dataset", "cifar"], 2, "argument --dataset: invalid choice"),
    (["--momentum", "1.5"], 2, "--momentum must be in [0, 1)"),
    (["--name", "a/b"], 2, "is not a valid run name"),
    (["--keep-checkpoints", "0"], 2, "--keep-checkpoints must be an integer >= 1"),
    (["--frobnicate"], 2, "unrecognized arguments: --frobnicate"),
    (["--data-dir", "/nonexistent/mnist"], 2, "--data-dir /nonexistent/mnist is not a directory"),
    (["--dataset", "mnist"], 1, "full MNIST not found; tried"),
])
def test_bad_flags(args, code, fragment, tmp_path):
    result = run_cli("fit", "--storage-path", str(tmp_path / "runs"), *args, timeout=60)
    _assert_one_line_error(result, code, fragment)
    assert not (tmp_path / "runs").exists(), "a refused command wrote into the storage path"


def test_unreachable_cluster_address_fails_fast(tmp_path):
    started = time.monotonic()
    result = run_cli("fit", "--dataset", "sample", "--storage-path", str(tmp_path),
                     "--address", f"127.0.0.1:{_unused_port()}", timeout=60)
    _assert_one_line_error(result, 1, "no Ray cluster answers at 127.0.0.1:")
    assert time.monotonic() - started < 30


def test_storage_path_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("precious")
    result = run_cli("fit", "--dataset", "sample", "--storage-path", str(tmp_path / "file"))
    _assert_one_line_error(result, 2, "is a file, not a directory")
    assert (tmp_path / "file").read_text() == "precious"


def test_use_gpu_without_gpus_is_one_clear_error_within_30_s(tmp_path):
    started = time.monotonic()
    result = run_cli("fit", "--use-gpu", "--dataset", "sample", "--storage-path",
                     str(tmp_path), timeout=90)
    _assert_one_line_error(result, 1, "--use-gpu asks for 2 GPU worker(s) but the cluster has 0")
    assert time.monotonic() - started < 30


def test_help_lists_every_flag():
    result = run_cli("fit", "--help", timeout=60)
    assert result.returncode == 0
    for flag in ("--num-workers", "--use-gpu", "--cpus-per-worker", "--epochs", "--batch-size",
                 "--lr", "--momentum", "--weight-decay", "--amp", "--sync-bn", "--backend",
                 "--init-method", "--seed", "--data-dir", "--dataset", "--storage-path",
                 "--name", "--address", "--max-failures", "--keep-checkpoints"):
        assert flag in result.stdout, flag


def test_console_script_dispatches(tmp_path):
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "raytrain-mnist"
    if not script.exists():
        pytest.skip("package not installed as a console script in this environment")
    result = subprocess.run([str(script), "fit", "--epochs", "0"], capture_output=True,
                            text=True, timeout=60)
    _assert_one_line_error(result, 2, "--epochs must be")
    result = subprocess.run([str(script), "nonsense"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown command 'nonsense'" in result.stderr
