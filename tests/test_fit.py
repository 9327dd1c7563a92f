"""`fit` end to end on real Ray (CPU, Gloo): training, results, finished runs.

(bf16 on CPU: the Jobs test in test_submit.py.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from PIL import Image

from raytrain_mnist.driver.fitting import fit
from raytrain_mnist.driver.runs import Run
from raytrain_mnist.errors import UserError
from raytrain_mnist.fit import fit_and_show
from raytrain_mnist.nn import checkpoint as ckpt

SUMMARY_KEYS = {
    "name",
    "run_dir",
    "status",
    "data_source",
    "train_size",
    "test_size",
    "num_workers",
    "use_gpu",
    "epochs_completed",
    "resumed_from_epoch",
    "val_accuracy",
    "val_total",
    "best_val_accuracy",
    "wall_time_s",
    "best_checkpoint",
    "latest_checkpoint",
    "config",
    "history",
}
HISTORY_KEYS = {"epoch", "train_loss", "val_loss", "val_accuracy", "images_per_s", "epoch_time_s"}


def test_two_workers_train_report_every_epoch_and_write_results(fitted, capsys):
    cfg, summary, out = fitted["cfg"], fitted["summary"], fitted["out"]
    result = fitted["result"]
    assert (result.status, result.error, result.resume_command) == ("finished", None, None)
    assert not result.already_finished and result.run_dir == summary["run_dir"]
    assert result.best_checkpoint == summary["best_checkpoint"]
    assert [line.split()[1] for line in out.splitlines() if line.startswith("epoch  ")] == [
        f"{epoch}/8" for epoch in range(1, 9)
    ]
    assert summary.keys() >= SUMMARY_KEYS
    assert summary["status"] == "finished" and summary["epochs_completed"] == 8
    assert summary["resumed_from_epoch"] is None
    assert summary["val_total"] == summary["test_size"] == 203
    losses = [h["train_loss"] for h in summary["history"]]
    assert losses[-1] < 0.6 * losses[0], f"the loss did not fall: {losses}"
    assert summary["val_accuracy"] > 0.6
    assert all(h.keys() >= HISTORY_KEYS for h in summary["history"])
    assert {w["rank"] for w in summary["workers"]} == {0, 1}

    run_dir = Path(summary["run_dir"])
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    with Image.open(run_dir / "training_curves.png") as image:
        assert image.format == "PNG" and image.size[0] > 400
    state = ckpt.load(summary["best_checkpoint"])
    assert state["epoch"] in range(1, 9) and state["optimizer"]["state"]
    assert ckpt.load(summary["latest_checkpoint"])["epoch"] == 8
    ckpt.load_model(summary["latest_checkpoint"])
    # --keep-checkpoints 2: the two best epochs' checkpoints stay, the best of them is "best".
    kept = Run.at(run_dir).checkpoints()
    assert len(kept) == cfg.run.checkpoint.keep_checkpoints == 2
    # On disk: those, and the latest (what a resume needs) when it is not among them.
    assert {str(p) for p in run_dir.glob("checkpoint_*") if p.is_dir()} == {
        path for path, _ in kept
    } | {summary["latest_checkpoint"]}
    scores = sorted((h["val_accuracy"] for h in summary["history"]), reverse=True)
    assert sorted((m["val_accuracy"] for _, m in kept), reverse=True) == scores[:2]
    assert summary["best_checkpoint"] in {path for path, _ in kept}
    assert ckpt.load(summary["best_checkpoint"])["history"][-1]["val_accuracy"] == scores[0]

    # The same command again reports the finished run and trains nothing.
    before = sorted(p.name for p in run_dir.iterdir())
    again = fit_and_show(cfg)
    assert again.already_finished and again.status == "finished" and again.summary == summary
    assert sorted(p.name for p in run_dir.iterdir()) == before
    shown = capsys.readouterr().out.splitlines()
    assert len(shown) == 2 and shown[0].endswith(
        " s  data loaded: 2048 train / 203 test images (mnist)"
    )
    assert shown[1] == (
        f"run 'fitted' already finished: val_accuracy {100 * summary['val_accuracy']:.2f}% "
        f"after 8 epoch(s); see {run_dir}/summary.json. Add --fresh to train it again."
    )
    # The library alone says nothing.
    assert fit(cfg).summary == summary
    assert capsys.readouterr() == ("", "")

    # Other settings under the same name are refused, and nothing is touched.
    with pytest.raises(UserError, match="other settings .*lr: 0.05 then, 0.1 now") as info:
        fit(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=0.1)))
    assert info.value.exit_code == 2
    assert sorted(p.name for p in run_dir.iterdir()) == before


_IN_A_NOTEBOOK = """
import json, sys
from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig
from raytrain_mnist.driver import fit

seen = []
cfg = FitConfig(TrainConfig(epochs=2, batch_size=32),
                RunSettings.from_flags(num_workers=1, cpus_per_worker=1, dataset="mnist",
                            data_dir=sys.argv[1], storage_path=sys.argv[2], name="nb"))
quiet = fit(cfg)  # the default sink: the log, which nobody configured
again = fit(cfg, on_event=seen.append)
with open(sys.argv[3], "w") as f:
    json.dump({"status": quiet.status, "epochs": quiet.summary["epochs_completed"],
               "best": quiet.best_checkpoint, "again": again.already_finished,
               "seen": [type(e).__name__ for e in seen],
               "commands": sorted(m for m in sys.modules
                                  if m in ("raytrain_mnist._cli", "raytrain_mnist.console"))}, f)
"""


def test_fit_from_a_notebook_prints_nothing_and_returns_its_result(tiny_mnist, tmp_path):
    """A script calls the library's fit() with a fresh Ray of its own: nothing reaches stdout,
    no command module is imported, and the result says how the run ended."""
    import subprocess
    import sys

    from tests.conftest import REPO

    report = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "-c", _IN_A_NOTEBOOK, str(tiny_mnist), str(tmp_path / "runs"), report],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "", done.stdout
    result = json.loads(report.read_text())
    assert result["status"] == "finished" and result["epochs"] == 2, result
    assert result["best"] and Path(result["best"]).is_dir()
    # The second call found the run finished: one phase (the data), nothing trained.
    assert result["again"] and result["seen"] == ["Phase"], result
    assert result["commands"] == [], result
