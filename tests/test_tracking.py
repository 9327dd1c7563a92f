"""TensorBoard event files (and MLflow, when installed) from the epochs of a real `fit`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_mnist._cli import UserError
from raytrain_mnist.driver.tracking import SCALARS, EpochLog

LOGGED = [
    "train_loss",
    "train_accuracy",
    "val_loss",
    "val_accuracy",
    "images_per_s",
    "epoch_time_s",
    "best_val_accuracy",
]


def _replay(log: EpochLog, summary: dict) -> None:
    """What the driver sees per committed epoch: the history entry plus its checkpoint."""
    best = 0.0
    for entry in summary["history"]:
        best = max(best, entry["val_accuracy"])
        log.log(
            {
                **entry,
                "best_val_accuracy": best,
                "history": summary["history"],
                "checkpoint": summary["latest_checkpoint"],
            }
        )
    log.close(summary)


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_every_epoch_becomes_tensorboard_scalars(trained_run, tmp_path):
    run_dir = tmp_path / "run"
    log = EpochLog(run_dir, trained_run["config"])
    _replay(log, trained_run)

    assert list(run_dir.glob("events.out.tfevents.*")), "no event file in the run directory"
    scalars = _scalars(run_dir)
    assert set(LOGGED) <= set(scalars), sorted(scalars)
    assert "lr" in scalars  # the learning rate fit's history reports for each epoch
    history = trained_run["history"]
    for key in LOGGED[:-1]:
        assert [step for step, _ in scalars[key]] == [h["epoch"] for h in history]
        assert [value for _, value in scalars[key]] == pytest.approx(
            [h[key] for h in history], rel=1e-6
        )  # stored as float32
    # The run's settings, as a table in TensorBoard's Text tab (the tag torch's writer gives).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    (text,) = events.Tensors("config/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert table.startswith("| setting | value |") and "| train.lr |" in table, table


def test_the_event_file_is_written_without_torch(tmp_path):
    """The driver of a `fit --service` never imports torch (its import would compete with
    the request's training): TensorBoard's files are written by tensorboard alone."""
    script = (
        "import sys; from raytrain_mnist.driver.tracking import EpochLog; "
        f"log = EpochLog({str(tmp_path)!r}, {{'train': {{'lr': 0.1}}}}); "
        "log.log({'epoch': 1, 'train_loss': 0.5}); log.close(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert _scalars(tmp_path) == {"train_loss": [(1, 0.5)]}


def test_lr_and_unknown_keys(tmp_path):
    log = EpochLog(tmp_path)
    log.log(
        {
            "epoch": 1,
            "train_loss": 0.5,
            "lr": 0.01,
            "workers": [{"rank": 0}],
            "note": "text",
            "val_loss": float("nan"),
        }
    )
    log.close()
    scalars = _scalars(tmp_path)
    assert scalars == {"train_loss": [(1, 0.5)], "lr": [(1, pytest.approx(0.01))]}
    assert set(SCALARS) >= set(scalars)


def test_tensorboard_off(tmp_path):
    log = EpochLog(tmp_path, {"run": {"no_tensorboard": True}})
    log.log({"epoch": 1, "train_loss": 0.5})
    log.close()
    log.close()  # twice is harmless
    assert not list(tmp_path.glob("events.out.tfevents.*"))


def test_mlflow_without_the_extra_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(UserError, match=r"pip install 'raytrain-mnist\[mlflow\]'") as info:
        EpochLog(tmp_path, {"run": {"mlflow_uri": "file:/tmp/x"}}, tensorboard=False)
    assert info.value.exit_code == 2


def test_mlflow_records_params_metrics_and_the_best_checkpoint(trained_run, tmp_path):
    pytest.importorskip("mlflow", reason="the optional extra raytrain-mnist[mlflow]")
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # The best checkpoint lies inside its run (one outside is never copied: the next test).
    best = run_dir / Path(trained_run["best_checkpoint"]).name
    shutil.copytree(trained_run["best_checkpoint"], best)
    summary = {**trained_run, "run_dir": str(run_dir), "best_checkpoint": str(best)}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    log = EpochLog(run_dir, trained_run["config"], tensorboard=False, mlflow=True)
    _replay(log, summary)

    recorded = json.loads((run_dir / "mlflow_run.json").read_text())
    assert recorded["tracking_uri"] == (run_dir / "mlruns").resolve().as_uri()
    client = MlflowClient(recorded["tracking_uri"])
    run = client.get_run(recorded["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["train.lr"] == "0.05" and run.data.params["run.num_workers"] == "2"
    history = client.get_metric_history(run.info.run_id, "val_accuracy")
    assert [(m.step, m.value) for m in history] == [
        (h["epoch"], pytest.approx(h["val_accuracy"])) for h in trained_run["history"]
    ]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"best_checkpoint", "summary.json"} <= artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "best_checkpoint")] == [
        "best_checkpoint/state.pt"
    ]

    # A resumed run keeps logging to the same MLflow run.
    again = EpochLog(run_dir, trained_run["config"], tensorboard=False, mlflow=True)
    again.close({"status": "finished"})
    assert json.loads((run_dir / "mlflow_run.json").read_text()) == recorded


def test_mlflow_never_follows_a_link_out_of_the_run(tmp_path):
    """Links planted in the run (in the best checkpoint, as the checkpoint itself, as
    summary.json) are not followed: nothing outside the run reaches the tracking store."""
    pytest.importorskip("mlflow", reason="the optional extra raytrain-mnist[mlflow]")
    from mlflow.tracking import MlflowClient

    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("not the run's")
    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoint_1"
    (checkpoint / "extra").mkdir(parents=True)
    (checkpoint / "state.pt").write_bytes(b"weights")
    (checkpoint / "extra" / "notes.txt").write_text("the run's own")
    (checkpoint / "leak.txt").symlink_to(secret)
    (checkpoint / "linked_dir").symlink_to(secret.parent, target_is_directory=True)
    (run_dir / "summary.json").symlink_to(secret)
    (run_dir / "elsewhere").symlink_to(secret.parent, target_is_directory=True)

    def logged(best: str) -> set[str]:
        log = EpochLog(run_dir, {"run": {}}, tensorboard=False, mlflow=True)
        log.close({"status": "finished", "best_checkpoint": best})
        recorded = json.loads((run_dir / "mlflow_run.json").read_text())
        (run_dir / "mlflow_run.json").unlink()  # the next one is a run of its own
        client = MlflowClient(recorded["tracking_uri"])

        def walk(path=None):
            for a in client.list_artifacts(recorded["run_id"], path):
                yield from walk(a.path) if a.is_dir else [a.path]

        return set(walk())

    assert logged(str(checkpoint)) == {
        "best_checkpoint/state.pt",
        "best_checkpoint/extra/notes.txt",
    }
    assert logged(str(run_dir / "elsewhere")) == set()  # a checkpoint that is a link out
    stored = [p.read_bytes() for p in (run_dir / "mlruns").rglob("*") if p.is_file()]
    assert not any(b"not the run's" in content for content in stored)
