"""`evaluate` on the checkpoints of a real `fit`: same accuracy, valid pictures, clear errors."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from PIL import Image

from raytrain_mnist import evaluate
from raytrain_mnist.config import RunSettings
from raytrain_mnist.driver import plots
from raytrain_mnist.driver.evaluation import Evaluation, evaluate_checkpoint
from raytrain_mnist.errors import UserError
from tests.conftest import run_cli, run_cli_here


def _assert_png(path: Path, min_width: int = 300) -> None:
    with Image.open(path) as image:
        image.verify()  # a complete, uncorrupted PNG
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] >= min_width, image.size


def _assert_one_line_error(code: int, err: str, expected_code: int, fragment: str) -> None:
    assert code == expected_code, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert fragment in lines[0], lines[0]


def test_cli_on_a_run_dir_reproduces_the_accuracy_fit_reported(trained_run, tiny_mnist):
    run_dir = Path(trained_run["run_dir"])
    result = run_cli_here("evaluate", str(run_dir), "--data-dir", str(tiny_mnist))
    assert result.returncode == 0, result.stderr + result.stdout

    best = Path(trained_run["best_checkpoint"])
    out = best.parent / f"evaluation_{best.name}"  # default: beside the checkpoint
    report = json.loads((out / "evaluation.json").read_text())
    assert report["checkpoint"] == str(best.resolve())
    # The best checkpoint's epoch, as fit reported it while training.
    reported = trained_run["history"][report["epoch"] - 1]
    assert report["test_size"] == trained_run["val_total"] == 203
    assert report["correct"] == round(reported["val_accuracy"] * 203)
    assert report["accuracy"] == pytest.approx(reported["val_accuracy"], abs=1e-12)
    # The same weights and images: only the order of the float64 sums differs.
    assert report["loss"] == pytest.approx(reported["val_loss"], rel=1e-6)
    # "The best checkpoint" is the best epoch's.
    assert reported["val_accuracy"] == max(h["val_accuracy"] for h in trained_run["history"])
    assert report["reported_val_accuracy"] == reported["val_accuracy"]
    assert sorted(report["per_class_accuracy"]) == [str(d) for d in range(10)]
    assert sum(report["per_class_size"].values()) == 203
    assert sum(map(sum, report["confusion_matrix"])) == 203
    assert len(report["most_confident_errors"]) == min(32, 203 - report["correct"])
    assert f"accuracy {100 * report['accuracy']:.2f}%" in result.stdout
    assert "    9 " in result.stdout  # the per-class table
    _assert_png(out / "confusion_matrix.png", 500)
    # A tile per error, up to 8 a row (plots.misclassified_png): one error draws 160 px wide.
    errors = 203 - report["correct"]
    _assert_png(out / "misclassified.png", 140 * min(8, errors) if errors else 300)

    # Run again: what is there is not overwritten unless asked.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = run_cli_here("evaluate", str(run_dir), "--data-dir", str(tiny_mnist))
    _assert_one_line_error(again.returncode, again.stderr, 2, "pass --overwrite")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    forced = run_cli_here("evaluate", str(run_dir), "--data-dir", str(tiny_mnist), "--overwrite")
    assert forced.returncode == 0, forced.stderr
    assert json.loads((out / "evaluation.json").read_text())["accuracy"] == report["accuracy"]


def test_a_checkpoint_path_recorded_outside_the_run_is_not_followed(trained_run, tmp_path):
    """A run directory's files may name any path; evaluate loads only what lies inside."""
    run_dir = tmp_path / "copied"
    run_dir.mkdir()
    summary = {**trained_run, "best_checkpoint": trained_run["best_checkpoint"]}
    (run_dir / "summary.json").write_text(json.dumps(summary))  # no checkpoints of its own
    result = run_cli_here("evaluate", str(run_dir), "--out", str(tmp_path / "out"))
    _assert_one_line_error(result.returncode, result.stderr, 1, "no checkpoint at")
    assert str(run_dir) in result.stderr and not (tmp_path / "out").exists()


def test_several_workers_score_like_one_process(trained_run, tmp_path):
    """2 Ray workers (exact shards, all-reduced) give the same answer, image for image."""
    latest = Path(trained_run["latest_checkpoint"]) / "state.pt"  # a state.pt file works too
    one = evaluate_checkpoint(latest, out=tmp_path / "one")
    handler = signal.getsignal(signal.SIGINT)
    two = evaluate_checkpoint(
        latest, out=tmp_path / "two", workers=RunSettings.from_flags(num_workers=2)
    )
    # Ray Train's own Ctrl-C handler for the run (it aborts that run's controller) is gone.
    assert signal.getsignal(signal.SIGINT) is handler
    assert isinstance(two, Evaluation)
    assert one.epoch == two.epoch == trained_run["epochs_completed"]
    assert two.test_size == 203 and two.num_workers == 2
    assert two.confusion_matrix == one.confusion_matrix
    assert two.accuracy == one.accuracy == pytest.approx(trained_run["val_accuracy"], abs=1e-12)
    assert two.loss == pytest.approx(one.loss, rel=1e-5)
    assert two.out == tmp_path / "two"
    assert [f.name for f in two.files] == [
        "evaluation.json",
        "confusion_matrix.png",
        "misclassified.png",
    ]
    for path in two.files:
        assert path.is_file() and path.parent == tmp_path / "two"
    # evaluation.json is the result's to_dict(), nothing more
    assert json.loads((tmp_path / "two" / "evaluation.json").read_text()) == two.to_dict()


def test_a_bare_checkpoint_dir_uses_the_flags(trained_run, tiny_mnist, tmp_path):
    """A checkpoint outside any run directory (as a Tune trial's best can be)."""
    bare = tmp_path / "somewhere" / "best"
    shutil.copytree(trained_run["best_checkpoint"], bare)
    code = evaluate.cli([str(bare), "--data-dir", str(tiny_mnist), "--dataset", "mnist"])
    assert code == 0
    report = json.loads(
        (tmp_path / "somewhere" / "evaluation_best" / "evaluation.json").read_text()
    )
    assert report["test_size"] == 203 and report["run"] is None
    assert report["accuracy"] == report["reported_val_accuracy"]


def test_a_tune_experiment_and_its_trials_runs_resolve_to_their_best_checkpoints(
    trained_run, tiny_mnist, tmp_path, capsys
):
    """tune's layout: <experiment>/search.json (it says where the search read MNIST),
    best.json, runs/<trial id>/ (a Train run with no summary.json); the best trial's best kept
    checkpoint is taken, by Ray's record of what it committed, and a trial's run gives its
    own, with no flag beyond the path."""
    experiment = tmp_path / "tune-2w-x"
    trial_run = experiment / "runs" / "t0"
    shutil.copytree(trained_run["run_dir"], trial_run)
    (trial_run / "summary.json").unlink()
    (trial_run / "run.json").unlink()
    checkpoint = trial_run / Path(trained_run["best_checkpoint"]).name
    search = {"dataset": "mnist", "metric": "val_accuracy", "mode": "max"}
    (experiment / "search.json").write_text(json.dumps({**search, "data_dir": str(tiny_mnist)}))
    (experiment / "best.json").write_text(
        json.dumps(
            {
                "experiment_dir": "/elsewhere/tune-2w-x",
                "best_trial": "t0",
                "metric": "val_accuracy",
                "mode": "max",
                "best_checkpoint": "/elsewhere/tune-2w-x/runs/t0/checkpoint_000",
            }
        )
    )
    report = evaluate_checkpoint(experiment, out=tmp_path / "out")
    assert capsys.readouterr().out == ""  # a library call: the result, never a print
    assert report.checkpoint == str(checkpoint.resolve()) and report.dataset == "mnist"
    assert report.accuracy == report.reported_val_accuracy
    trial = evaluate_checkpoint(trial_run, out=tmp_path / "trial")
    assert (trial.checkpoint, trial.accuracy) == (report.checkpoint, report.accuracy)
    with pytest.raises(UserError, match="trained and scored on the 'mnist'"):
        evaluate_checkpoint(experiment, dataset="sample")
    (experiment / "search.json").write_text(json.dumps({**search, "mode": "sideways"}))
    with pytest.raises(UserError, match="is not a search record of raytrain_mnist"):
        evaluate_checkpoint(trial_run)


def test_the_most_confident_errors_are_ranked_once_for_the_report_and_the_picture():
    """Wrong predictions only, the surest first, ties in test-set order, at most ``limit``."""
    labels = [0, 1, 2, 3, 4, 5]
    predictions = [0, 7, 2, 8, 9, 6]  # 1, 3, 4 and 5 are wrong
    confidence = [0.99, 0.6, 0.97, 0.9, 0.6, 0.8]
    order = plots.most_confident_errors(labels, predictions, confidence, limit=3)
    assert order.tolist() == [3, 5, 1]
    assert plots.most_confident_errors(labels, labels, confidence, limit=3).tolist() == []


def _corrupt(tmp_path: Path) -> Path:
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "state.pt").write_bytes(b"PK\x03\x04 truncated")
    return tmp_path / "corrupt"


def _foreign(tmp_path: Path) -> Path:
    torch.save({"weights": torch.zeros(3)}, tmp_path / "foreign.pt")
    return tmp_path / "foreign.pt"


def _text(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    return tmp_path / "notes.txt"


def _empty(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


@pytest.mark.parametrize(
    "make, code, fragment",
    [
        (lambda tmp: tmp / "missing", 2, "does not exist"),
        (_empty, 2, "is neither a run directory"),
        (_corrupt, 1, "is corrupt or truncated"),
        (_foreign, 1, "is not a raytrain_mnist checkpoint"),
        (_text, 2, "is not a checkpoint"),
    ],
)
def test_bad_targets_are_one_line(make, code, fragment, tmp_path, capsys):
    target = make(tmp_path)
    _assert_one_line_error(evaluate.cli([str(target)]), capsys.readouterr().err, code, fragment)


def test_a_different_dataset_than_training_is_refused(trained_run, capsys):
    code = evaluate.cli([trained_run["run_dir"], "--dataset", "sample"])
    _assert_one_line_error(
        code, capsys.readouterr().err, 2, "trained and scored on the 'mnist' data set"
    )


def test_bad_input_through_the_real_cli(tmp_path):
    result = run_cli("evaluate", str(tmp_path / "nope"), timeout=60)
    _assert_one_line_error(result.returncode, result.stderr, 2, "does not exist")
    result = run_cli("evaluate", str(tmp_path), "--num-workers", "0", timeout=60)
    _assert_one_line_error(result.returncode, result.stderr, 2, "--num-workers must be")
