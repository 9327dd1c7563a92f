"""The CLI as users call it: bad input is one line and a non-zero exit, never a traceback or
a hang. (Error paths that end before Ray starts run in this process, the rest as subprocesses.)"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from tests.conftest import run_cli_here


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


@pytest.mark.parametrize(
    "args, code, fragment",
    [
        (["--epochs", "0"], 2, "--epochs must be an integer >= 1"),
        (["--epochs", "two"], 2, "argument --epochs: invalid int value"),
        (["--lr", "nan"], 2, "--lr must be a positive number"),
        (["--lr", "-1"], 2, "--lr must be a positive number"),
        (["--num-workers", "0"], 2, "--num-workers must be a count >= 1"),
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
        (
            ["--data-dir", "/nonexistent/mnist"],
            2,
            "--data-dir /nonexistent/mnist is not a directory",
        ),
        (["--dataset", "mnist"], 1, "full MNIST not found; tried"),
        (["--seed", str(2**64)], 2, "--seed must be at most"),
        (["--seed", "-1"], 2, "--seed must be an integer >= 0"),
        (["--address", "http://127.0.0.1:8265"], 2, "submit jobs to a dashboard URL"),
        (["--address", "127.0.0.1:99999"], 2, "is not HOST:PORT with a port from 1 to 65535"),
        (["--address", ""], 2, "--address is empty"),
        (["--mlflow-uri", "http://me:hunter2@mlflow.example"], 2, "MLFLOW_TRACKING_USERNAME"),
        (["--name", "a\nb"], 2, "is not a valid run name"),
    ],
)
def test_bad_flags(args, code, fragment, tmp_path):
    result = run_cli_here("fit", "--storage-path", str(tmp_path / "runs"), *args)
    _assert_one_line_error(result, code, fragment)
    assert not (tmp_path / "runs").exists(), "a refused command wrote into the storage path"


def test_unreachable_cluster_address_fails_fast(tmp_path):
    started = time.monotonic()
    result = run_cli_here(
        "fit",
        "--dataset",
        "sample",
        "--storage-path",
        str(tmp_path),
        "--address",
        f"127.0.0.1:{_unused_port()}",
    )
    _assert_one_line_error(result, 1, "no Ray cluster answers at 127.0.0.1:")
    assert time.monotonic() - started < 30


def test_storage_path_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("precious")
    result = run_cli_here("fit", "--dataset", "sample", "--storage-path", str(tmp_path / "file"))
    _assert_one_line_error(result, 2, "is a file, not a directory")
    assert (tmp_path / "file").read_text() == "precious"


def test_use_gpu_without_enough_gpus_is_one_clear_error_within_30_s(tmp_path):
    import torch

    # One worker more than this machine has GPUs: refused on any host, GPUs or not.
    gpus = torch.cuda.device_count()
    workers = gpus + 1
    started = time.monotonic()
    result = run_cli_here(
        "fit",
        "--use-gpu",
        "--num-workers",
        str(workers),
        "--batch-size",
        str(32 * workers),
        "--dataset",
        "sample",
        "--storage-path",
        str(tmp_path),
    )
    _assert_one_line_error(
        result, 1, f"--use-gpu asks for {workers} GPU worker(s) but the cluster has {gpus} GPU(s)"
    )
    assert time.monotonic() - started < 30


def _flags_of_config(*classes) -> set[str]:
    from raytrain_mnist.config import flag_fields

    return {"--" + name.replace("_", "-") for cls in classes for name in flag_fields(cls)}


def _command_flags() -> dict[str, set[str]]:
    """Every flag of every command: what its parser defines, and, where the command is built
    from config dataclasses, one flag per field (so a field without a flag shows too)."""
    import importlib

    from raytrain_mnist.__main__ import COMMANDS
    from raytrain_mnist.config import RunSettings, TrainConfig
    from raytrain_mnist.driver.searching.space import TuneSettings

    from_config = {
        "fit": _flags_of_config(TrainConfig, RunSettings),
        "tune": _flags_of_config(TrainConfig, RunSettings, TuneSettings),
    }
    flags = {}
    for command in COMMANDS:
        parser = importlib.import_module(f"raytrain_mnist.{command}").build_parser()
        defined = {
            option
            for action in parser._actions
            for option in action.option_strings
            if option not in ("-h", "--help")
        }
        assert from_config.get(command, set()) <= defined, (command, from_config[command] - defined)
        flags[command] = defined
    return flags


def test_help_lists_every_flag_of_every_command():
    flags = _command_flags()
    assert set(flags) >= {"fit", "tune", "evaluate", "submit"}
    assert len(flags["fit"]) >= 27
    for command, expected in flags.items():
        result = run_cli_here(command, "--help")
        assert result.returncode == 0, result.stderr
        missing = sorted(flag for flag in expected if flag not in result.stdout)
        assert not missing, f"{command} --help lacks {missing}"


def test_console_script_dispatches(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "raytrain-mnist"
    if not script.exists():
        pytest.skip("package not installed as a console script in this environment")
    result = subprocess.run(
        [str(script), "fit", "--epochs", "0"], capture_output=True, text=True, timeout=60
    )
    _assert_one_line_error(result, 2, "--epochs must be")
    result = subprocess.run([str(script), "nonsense"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown command 'nonsense'" in result.stderr


def test_a_command_process_ends_with_its_status_after_every_exit_handler(tmp_path):
    """``exit_now`` (every command's ``__main__`` and the console script) skips CPython's
    teardown (a speed: benchmarks/README.md), and nothing else: the status as given, every
    exit handler registered after the import (Ray's shutdown, temporary folders'), piped
    output whole, logging flushed."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent(
        f"""
        import atexit, logging, sys, tempfile
        from pathlib import Path
        from raytrain_mnist._cli import exit_now

        marks = Path({str(tmp_path)!r})
        folder = tempfile.TemporaryDirectory(dir=marks)
        (marks / "folder").write_text(folder.name)
        atexit.register(lambda: (marks / "handler").write_text("ran"))
        logging.basicConfig(filename=marks / "log", level=logging.INFO)
        logging.getLogger("x").info("logged")
        sys.stdout.write("x" * 1_000_000 + "\\n")
        exit_now(int(sys.argv[1]))
        """
    )
    for status in (0, 3, 130):
        result = subprocess.run(
            [sys.executable, "-c", script, str(status)], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == status, result.stderr
        assert result.stdout == "x" * 1_000_000 + "\n"
        assert (tmp_path / "handler").read_text() == "ran"
        assert not Path((tmp_path / "folder").read_text()).exists()
        assert "logged" in (tmp_path / "log").read_text()
        (tmp_path / "handler").unlink()


def test_a_ray_call_with_no_ray_connected_fails_in_a_command_and_starts_no_ray(tmp_path):
    """A command connects to its Ray itself. A Ray call made with none connected (a thread
    that outlived the command's Ray) is one line and exit 1, never Ray's auto-init, which
    joins whatever other Ray runs on the machine (a service's watcher did, once its own Ray
    had shut down, 2026-12-07) or starts one."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from raytrain_mnist._cli import run_cli\n"
        "def main(argv):\n"
        "    import ray\n"
        "    ray.put(1)\n"
        "    return 0\n"
        "sys.exit(run_cli(main))\n"
    )
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path)}
    env.pop("RAY_ENABLE_AUTO_CONNECT", None)
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    _assert_one_line_error(result, 1, "internal error: RaySystemError")
    assert "Ray has not been started yet" in result.stderr
    assert not list(tmp_path.rglob("session_*")), "Ray's auto-init started a Ray"


def _tree(root) -> dict:
    """Every file under ``root`` with its bytes: to prove a refused command changed nothing."""
    from pathlib import Path

    root = Path(root)
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _broken_data(tmp_path, sample_digits, name, mutate):
    from tests.conftest import write_tiny_mnist

    root = write_tiny_mnist(tmp_path / "data", sample_digits, 64, 9)
    path = root / "MNIST" / "raw" / name
    path.write_bytes(mutate(path.read_bytes()))
    return root


@pytest.mark.parametrize(
    "name, mutate, fragment",
    [
        ("train-images-idx3-ubyte", lambda b: b[:-7], "is truncated"),
        ("train-labels-idx1-ubyte", lambda b: b"\x00\x00\x08\x99" + b[4:], "magic number"),
        ("t10k-labels-idx1-ubyte", lambda b: b[:-1] + b"\x0b", "label 11"),
    ],
)
def test_broken_data_files(tmp_path, sample_digits, name, mutate, fragment):
    data = _broken_data(tmp_path, sample_digits, name, mutate)
    result = run_cli_here("fit", "--data-dir", str(data), "--storage-path", str(tmp_path / "runs"))
    _assert_one_line_error(result, 1, fragment)
    assert not (tmp_path / "runs").exists()


def _run_dir_with_checkpoint(tmp_path, payload: bytes | None = None, state: dict | None = None):
    """A run directory as Ray leaves it, whose latest committed checkpoint is ours to shape."""
    import torch

    from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig
    from raytrain_mnist.data import load_sample
    from raytrain_mnist.driver.runs import RUN_FILE, fit_identity

    storage = tmp_path / "runs"
    run_dir = storage / "r"
    checkpoint = run_dir / "checkpoint_2026-01-01_00-00-00.000000"
    checkpoint.mkdir(parents=True)
    if payload is not None:
        (checkpoint / "state.pt").write_bytes(payload)
    else:
        torch.save(state, checkpoint / "state.pt")
    snapshot = {
        "latest_checkpoint_result": {
            "checkpoint_dir_name": checkpoint.name,
            "metrics": {"epoch": 1},
        }
    }
    (run_dir / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
    cfg = FitConfig(TrainConfig(epochs=2), RunSettings.from_flags(dataset="sample", name="r"))
    (run_dir / RUN_FILE).write_text(json.dumps(fit_identity(cfg, load_sample())))
    return storage


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/raytrain_mnist_cli_pwned",))


def _exploit_bytes() -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save({"format": "raytrain_mnist/1", "model": _Exploit()}, buffer)
    return buffer.getvalue()


def _foreign_model_state() -> dict:
    import torch

    return {
        "format": "raytrain_mnist/1",
        "model": {"linear.weight": torch.zeros(2, 2)},
        "optimizer": {},
        "scheduler": {},
        "scaler": {},
        "epoch": 1,
        "best_val_accuracy": 0.0,
        "history": [],
        "rng": {},
        "config": {},
    }


@pytest.mark.parametrize(
    "shape, fragment",
    [
        ({"payload": b"PK\x03\x04 not really a zip"}, "is corrupt or truncated"),
        ({"payload": None, "state": {"weights": 1}}, "is not a raytrain_mnist checkpoint"),
        ({"payload": None, "state": "foreign"}, "holds weights of a different model"),
        ({"payload": "exploit"}, "refusing to load"),
    ],
)
def test_checkpoints_that_cannot_resume(tmp_path, shape, fragment):
    payload, state = shape.get("payload"), shape.get("state")
    if payload == "exploit":
        payload = _exploit_bytes()
    if state == "foreign":
        state = _foreign_model_state()
    storage = _run_dir_with_checkpoint(tmp_path, payload, state)
    before = _tree(storage)
    result = run_cli_here(
        "fit", "--dataset", "sample", "--epochs", "2", "--storage-path", str(storage), "--name", "r"
    )
    _assert_one_line_error(result, 1, fragment)
    assert "cannot resume run 'r'" in result.stderr
    assert _tree(storage) == before
    assert not os.path.exists("/tmp/raytrain_mnist_cli_pwned")


def test_resuming_with_other_settings_is_refused(tmp_path):
    from raytrain_mnist.nn.model import ConvNet

    storage = _run_dir_with_checkpoint(tmp_path, state={"model": ConvNet().state_dict()})
    before = _tree(storage)
    result = run_cli_here(
        "fit",
        "--dataset",
        "sample",
        "--epochs",
        "2",
        "--storage-path",
        str(storage),
        "--name",
        "r",
        "--lr",
        "0.01",
    )
    _assert_one_line_error(result, 2, "was started with other settings (lr: 0.02 then, 0.01 now)")
    assert _tree(storage) == before


def test_unwritable_storage_path(tmp_path):
    result = run_cli_here("fit", "--dataset", "sample", "--storage-path", "/proc/raytrain_runs")
    _assert_one_line_error(result, 2, "--storage-path /proc/raytrain_runs is not writable")


def test_corrupt_run_file(tmp_path):
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "run.json").write_text("{not json")
    result = run_cli_here(
        "fit", "--dataset", "sample", "--storage-path", str(tmp_path / "runs"), "--name", "r"
    )
    _assert_one_line_error(result, 1, "run.json is unreadable")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["tune", "--search-seed", str(2**32)], "--search-seed must be at most 4294967295"),
        (["tune", "--seed", str(2**64)], "--seed must be at most"),
        (["tune", "--range", "seed=0,18446744073709551616"], "--seed must be at most"),
        (["tune", "--range", "momentum=0.5:1"], "--momentum must be in [0, 1)"),
        (["evaluate", "nowhere", "--num-workers", "0"], "--num-workers must be a count >= 1"),
        # Python 3.11's argparse made each of these a list (Hypothesis found them)
        (["tune", "--range=--"], "argument --range: expected one argument"),
        (["tune", "--address=--"], "argument --address: expected one argument"),
        (["fit", "--recipe=--"], "argument --recipe: expected one argument"),
        (["evaluate", "nowhere", "--set=--"], "unrecognized arguments: --set=--"),
        # A service's name names its registry file and its queue: never a path
        (["service", "status", "--name", "../../etc"], "--name '../../etc' is not a valid service"),
        (["service", "stop", "--name", "a b"], "--name 'a b' is not a valid service name"),
        (["service", "start", "--name", "../x"], "--name '../x' is not a valid service name"),
        (["fit", "--service", "a/b"], "--service 'a/b' is not a valid service name"),
    ],
)
def test_bad_flags_of_the_other_commands_before_ray_starts(tmp_path, args, fragment):
    import sys

    started = time.monotonic()
    result = (
        run_cli_here(*args, "--storage-path", str(tmp_path / "runs"))
        if args[0] == "tune"
        else run_cli_here(*args)
    )
    _assert_one_line_error(result, 2, fragment)
    assert time.monotonic() - started < 5
    assert not (tmp_path / "runs").exists()
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()


def test_an_address_in_ray_address_is_checked_like_the_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:http")
    result = run_cli_here("fit", "--dataset", "sample", "--storage-path", str(tmp_path))
    _assert_one_line_error(result, 2, "RAY_ADDRESS '10.0.0.1:http' is not HOST:PORT")


# --------------------------------------------------------------------------- habits (issue 30)


def test_version():
    from raytrain_mnist import __version__

    for args in (["--version"], ["-V"]):
        result = run_cli_here(*args)
        assert result.returncode == 0
        assert result.stdout.strip() == f"raytrain-mnist {__version__}"


@pytest.mark.parametrize(
    "command, args, suggestion",
    [
        ("fit", ["--epoch", "2"], "--epochs"),
        ("fit", ["--epoch=2"], "--epochs"),
        ("fit", ["--num-work", "3"], "--num-workers"),
        ("tune", ["--num-sample", "2"], "--num-samples"),
        ("evaluate", ["RUN", "--over"], "--overwrite"),
        ("serve", ["RUN", "--replica", "2"], "--replicas"),
        ("runs", ["--storage", "x"], "--storage-path"),
        ("submit", ["--no-wai", "--", "fit"], "--no-wait"),
    ],
)
def test_abbreviated_flags_are_refused_with_the_flag_meant(command, args, suggestion, tmp_path):
    """argparse's prefix matching once read `fit --epoch 2` as `--epochs 2` and trained."""
    result = run_cli_here(command, *[str(tmp_path) if a == "RUN" else a for a in args])
    _assert_one_line_error(result, 2, "unrecognized arguments:")
    assert f"did you mean {suggestion}?" in result.stderr


def test_every_command_refuses_abbreviations():
    from raytrain_mnist.__main__ import COMMANDS, load_command

    for name in COMMANDS:
        parser = load_command(name).build_parser()
        assert parser.allow_abbrev is False, name


def test_evaluate_help_is_its_own():
    text = run_cli_here("evaluate", "--help").stdout
    fit_text = run_cli_here("fit", "--help").stdout
    assert "train on GPUs" not in text and "elastic run" not in text
    assert "score on this many Ray Train workers" in text
    assert "train on GPUs" in fit_text


def test_fit_help_says_how_to_resume():
    text = " ".join(run_cli_here("fit", "--help").stdout.split())
    assert "run the same command again" in text and "runs show NAME" in text


@pytest.mark.parametrize("shell, marker", [("bash", "complete "), ("zsh", "#compdef")])
def test_completion_scripts(shell, marker):
    result = run_cli_here("completion", shell)
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert marker in script
    for word in ("fit", "evaluate", "runs", "predict", "export", "--num-workers", "--top-k"):
        assert word in script, word


def test_completion_of_an_unknown_shell_is_refused():
    result = run_cli_here("completion", "fish")
    assert result.returncode == 2 and "usage: raytrain-mnist completion {bash,zsh}" in result.stderr
