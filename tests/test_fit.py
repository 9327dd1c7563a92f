"""`fit` end to end on real Ray (CPU, Gloo): training, results, finished runs.

(bf16 on CPU: the Jobs test in test_submit.py.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from PIL import Image

from raytrain_mnist._cli import UserError
from raytrain_mnist.driver.runs import Run
from raytrain_mnist.fit import fit
from raytrain_mnist.worker import checkpoint as ckpt

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
    assert len(kept) == cfg.run.keep_checkpoints == 2
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
    again = fit(cfg)
    assert again == summary
    assert sorted(p.name for p in run_dir.iterdir()) == before
    assert "already finished" in capsys.readouterr().out

    # Other settings under the same name are refused, and nothing is touched.
    with pytest.raises(UserError, match="other settings .*lr: 0.05 then, 0.1 now") as info:
        fit(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=0.1)))
    assert info.value.exit_code == 2
    assert sorted(p.name for p in run_dir.iterdir()) == before
