"""``raytrain-mnist runs`` and ``runs show``: every run and search under a storage path,
newest first, on local disks and on S3; a damaged run is listed as such, never a traceback;
a run a command holds reads "running". Uses the session's one fitted run."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli, run_cli_here


@pytest.fixture
def storage(fitted, tmp_path) -> Path:
    """A storage path holding a copy of the fitted run, as 'fitted'."""
    root = tmp_path / "runs"
    shutil.copytree(fitted["summary"]["run_dir"], root / "fitted")
    return root


def _listing(*args) -> dict:
    result = run_cli_here("runs", *args, "--json")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout)


def test_a_finished_run_is_listed_with_its_figures(fitted, storage):
    summary = fitted["summary"]
    (entry,) = _listing("--storage-path", str(storage))["runs"]
    assert entry["name"] == "fitted" and entry["kind"] == "fit"
    assert entry["status"] == "finished"
    assert entry["best_val_accuracy"] == summary["best_val_accuracy"]
    assert (entry["epochs_done"], entry["epochs_planned"]) == (8, 8)
    assert entry["workers"] == 2
    assert entry["wall_s"] == summary["wall_time_s"]
    assert entry["started"] == pytest.approx(summary["timeline"]["t0"])
    assert entry["path"] == str(storage / "fitted")

    text = run_cli_here("runs", "--storage-path", str(storage))
    assert text.returncode == 0, text.stderr
    header, line = text.stdout.splitlines()
    assert header.split() == [
        "NAME", "KIND", "STATUS", "BEST_ACC", "EPOCHS", "WORKERS", "STARTED", "WALL_S", "PATH",
    ]  # fmt: skip
    assert line.split()[:5] == [
        "fitted", "fit", "finished", f"{100 * summary['best_val_accuracy']:.2f}%", "8/8",
    ]  # fmt: skip
    assert line.endswith(str(storage / "fitted"))


def test_runs_are_newest_first_and_damaged_ones_are_listed_as_such(storage):
    old = storage / "fitted"
    for name, damage in [
        ("bad-summary", lambda d: (d / "summary.json").write_text("{half")),
        ("deep-summary", lambda d: (d / "summary.json").write_text("[" * 200_000)),
        ("deep-snapshot", lambda d: _killed(d, "[" * 200_000)),
        ("list-summary", lambda d: (d / "summary.json").write_text("[1, 2]")),
        ("odd-status", lambda d: _edit(d, status="exploded")),
    ]:
        shutil.copytree(old, storage / name)
        damage(storage / name)
    shutil.copytree(old, storage / "newer")
    summary = json.loads((storage / "newer" / "summary.json").read_text())
    _edit(storage / "newer", timeline={**summary["timeline"], "t0": time.time() + 60})
    (storage / "not-a-run").mkdir()
    (storage / "stray.txt").write_text("x")

    entries = {e["name"]: e for e in _listing("--storage-path", str(storage))["runs"]}
    assert set(entries) == {
        "fitted", "newer", "bad-summary", "deep-summary", "deep-snapshot", "list-summary",
        "odd-status",
    }  # fmt: skip
    assert next(iter(entries)) == "newer"
    for name in ("bad-summary", "deep-summary", "list-summary", "odd-status"):
        assert entries[name]["status"] == "damaged", entries[name]
        assert entries[name]["problem"], entries[name]
    assert "RecursionError" in entries["deep-summary"]["problem"]
    assert entries["deep-snapshot"]["status"] == "damaged"
    assert "corrupt" in entries["deep-snapshot"]["problem"]
    text = run_cli_here("runs", "--storage-path", str(storage))
    assert text.returncode == 0 and "Traceback" not in text.stderr + text.stdout
    assert len(text.stdout.splitlines()) == 1 + len(entries)


def _edit(run_dir: Path, **changes) -> None:
    path = run_dir / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _killed(run_dir: Path, snapshot: str | None = None) -> None:
    """The run as a command killed mid-run leaves it: no summary yet."""
    (run_dir / "summary.json").unlink()
    if snapshot is not None:
        (run_dir / "checkpoint_manager_snapshot.json").write_text(snapshot)


def test_a_run_being_trained_reads_running_and_a_killed_one_stopped(storage):
    from raytrain_mnist.driver.runs import Run

    _killed(storage / "fitted")
    (entry,) = _listing("--storage-path", str(storage))["runs"]
    assert entry["status"] == "stopped"
    assert entry["epochs_done"] == 8 and entry["best_val_accuracy"] is not None
    with Run(str(storage), "fitted").claim():  # what fit holds while it trains
        (entry,) = _listing("--storage-path", str(storage))["runs"]
        assert entry["status"] == "running"
        assert entry["wall_s"] is not None
    (entry,) = _listing("--storage-path", str(storage))["runs"]
    assert entry["status"] == "stopped"


def test_show_prints_the_summary_the_best_checkpoint_and_a_resume_command_that_parses(
    fitted, storage
):
    from raytrain_mnist import fit

    result = run_cli_here("runs", "show", "fitted", "--storage-path", str(storage))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    best = Path(fitted["summary"]["best_checkpoint"]).name
    assert f"best checkpoint: {storage / 'fitted' / best}" in text
    assert "fit run 'fitted': finished" in text
    record = _listing("show", "fitted", "--storage-path", str(storage))
    assert record["best_checkpoint"] == str(storage / "fitted" / best)
    assert record["summary"]["best_val_accuracy"] == fitted["summary"]["best_val_accuracy"]
    command = record["resume_command"]
    assert command in text and "--name fitted" in command
    words = command.split()
    cfg = fit.parse_config(words[words.index("fit") + 1 :])
    assert cfg.train == fitted["cfg"].train  # the same run: the same identity

    _killed(storage / "fitted")
    result = run_cli_here("runs", "show", "fitted", "--storage-path", str(storage))
    assert result.returncode == 0 and "stopped" in result.stdout
    assert "resume with:" in result.stdout


def test_show_of_a_run_that_is_not_there_names_the_runs_that_are(storage):
    result = run_cli_here("runs", "show", "nope", "--storage-path", str(storage))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"raytrain-mnist: error: no run 'nope' in {storage}; runs there: fitted"
    )


def test_an_empty_or_missing_storage_lists_nothing(tmp_path):
    assert _listing("--storage-path", str(tmp_path / "none"))["runs"] == []
    result = run_cli_here("runs", "--storage-path", str(tmp_path))
    assert result.returncode == 0 and result.stdout == ""
    assert "no runs in" in result.stderr


def test_the_default_storage_is_the_environments(storage, monkeypatch):
    monkeypatch.setenv("RAYTRAIN_MNIST_STORAGE_PATH", str(storage))
    assert [e["name"] for e in _listing()["runs"]] == ["fitted"]


def test_json_goes_to_stdout_alone_in_a_process_of_its_own(storage):
    result = run_cli("runs", "--storage-path", str(storage), "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)  # nothing else on stdout
    assert [e["name"] for e in record["runs"]] == ["fitted"]


def _upload(s3, local: Path, uri: str) -> None:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    for path in sorted(local.rglob("*")):
        if path.is_file():
            key = f"{prefix}/{local.name}/{path.relative_to(local)}"
            s3.client.upload_file(str(path), bucket, key)


def test_runs_on_s3(s3, storage, fitted, tmp_path):
    uri = s3()
    _upload(s3, storage / "fitted", uri)
    (entry,) = _listing("--storage-path", uri)["runs"]
    assert entry["name"] == "fitted" and entry["status"] == "finished"
    assert entry["path"] == f"{uri}/fitted"
    assert entry["best_val_accuracy"] == fitted["summary"]["best_val_accuracy"]
    record = _listing("show", "fitted", "--storage-path", uri)
    assert record["best_checkpoint"].startswith(f"{uri}/fitted/checkpoint_")
    # A lease beside it from a live process of this host: running.
    from raytrain_mnist.driver.runs import Run

    with Run(uri, "fitted").claim():
        (entry,) = _listing("--storage-path", uri)["runs"]
        assert entry["status"] == "running"
    (entry,) = _listing("--storage-path", uri)["runs"]
    assert entry["status"] == "finished"


def _search(root: Path, name: str, best: dict | None) -> None:
    """A search's directory as tune leaves it: its identity, and best.json once it ended."""
    (root / name).mkdir(parents=True)
    (root / name / "search.json").write_text(json.dumps({"dataset": "mnist"}))
    if best is not None:
        (root / name / "best.json").write_text(json.dumps(best))


def test_searches_are_listed_with_their_trials_epochs(tmp_path):
    from raytrain_mnist._cli import command_line, invocation
    from raytrain_mnist.config import TrainConfig

    trials = [{"trial_id": f"t{i}", "epochs_run": e} for i, e in enumerate([2, 1, 1, 2])]
    best = {
        "name": "tune-a", "best_trial": "t0", "best_val_accuracy": 0.97, "num_trials": 4,
        "max_epochs": 2, "num_workers": 1, "num_unfinished": 0, "num_errors": 0,
        "wall_time_s": 80.5, "trials": trials, "fit_command": "raytrain-mnist fit --lr 0.1",
        "best_config": TrainConfig(lr=0.1).to_dict(),
    }  # fmt: skip
    _search(tmp_path, "tune-a", best)
    _search(tmp_path, "tune-b", {**best, "num_unfinished": 2})
    _search(tmp_path, "tune-c", {**best, "num_errors": 1})
    _search(tmp_path, "tune-d", None)
    entries = {e["name"]: e for e in _listing("--storage-path", str(tmp_path))["runs"]}
    assert {n: e["status"] for n, e in entries.items()} == {
        "tune-a": "finished", "tune-b": "stopped", "tune-c": "failed", "tune-d": "stopped",
    }  # fmt: skip
    a = entries["tune-a"]
    assert (a["kind"], a["epochs_done"], a["epochs_planned"]) == ("tune", 6, 8)
    assert (a["best_val_accuracy"], a["workers"], a["wall_s"]) == (0.97, 1, 80.5)
    shown = run_cli_here("runs", "show", "tune-a", "--storage-path", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    # Rebuilt from the settings fit parses, after this process's own `fit`.
    reproduce = command_line([*invocation("fit"), "--lr", "0.1"])
    assert f"reproduce with:  {reproduce}" in shown.stdout
    assert "the same tune command" in shown.stdout
