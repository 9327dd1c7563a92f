"""``--json``: the result as one JSON object on stdout and everything else on stderr, with the
fields of the file the command writes; exit statuses unchanged. And the walk-through after a
first run on S3 storage, as a user types it: fit, runs, runs show, predict, export."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from tests.conftest import REPO, run_cli_here, tiny_run_flags


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "raytrain_mnist", *args]


def _run(args, env, timeout=600):
    import subprocess

    return subprocess.run(
        _command(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env
    )


def test_evaluate_json_is_evaluation_json(trained_run, tmp_path):
    out = tmp_path / "report"
    result = run_cli_here("evaluate", trained_run["run_dir"], "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record == json.loads((out / "evaluation.json").read_text())
    assert "accuracy" in result.stderr  # the report, on stderr


def test_a_usage_error_prints_no_json_and_keeps_its_status(tmp_path):
    result = run_cli_here("fit", "--epochs", "0", "--json", "--storage-path", str(tmp_path))
    assert result.returncode == 2 and result.stdout == ""
    assert "--epochs must be an integer >= 1" in result.stderr


def test_the_first_hour_on_s3(s3, tiny_mnist, sample_digits, tmp_path, ray_env):
    """fit --json into s3://, then runs, runs show, predict on PNG files of test digits and
    export, each through the real CLI, reading the run from the bucket. fit runs in a
    process of its own (it starts its Ray); the rest start none, so they run in this one
    (``run_cli_here``: the same entry point, stdout and stderr apart)."""
    from PIL import Image

    storage = s3()
    fit = _run(["fit", *tiny_run_flags(tiny_mnist, storage, "first", epochs=1), "--json"], ray_env)
    assert fit.returncode == 0, fit.stderr[-3000:]
    summary = json.loads(fit.stdout)  # stdout holds the one object, nothing else
    assert summary["status"] == "finished" and summary["name"] == "first"
    assert summary["run_dir"] == f"{storage}/first"
    assert "epoch   1/1" in fit.stderr  # the run's lines went to stderr

    runs = json.loads(run_cli_here("runs", "--storage-path", storage, "--json").stdout)
    (entry,) = runs["runs"]
    assert (entry["name"], entry["status"], entry["epochs_done"]) == ("first", "finished", 1)
    assert entry["best_val_accuracy"] == summary["best_val_accuracy"]
    show = run_cli_here("runs", "show", "first", "--storage-path", storage)
    assert show.returncode == 0, show.stderr
    assert f"best checkpoint: {summary['best_checkpoint']}" in show.stdout
    assert "fit" in show.stdout.split("train again with:")[1]

    images, _ = sample_digits
    pngs = []
    for i in range(8):  # the tiny set's first test digits, dark on light, 112x112
        path = tmp_path / f"digit{i}.png"
        Image.fromarray(255 - images[2048 + i]).resize((112, 112)).save(path)
        pngs.append(str(path))
    predict = run_cli_here("predict", f"{storage}/first", *pngs, "--json")
    assert predict.returncode == 0, predict.stderr
    predicted = json.loads(predict.stdout)["predictions"]
    assert [p["source"] for p in predicted] == pngs
    assert all(0 <= p["label"] <= 9 for p in predicted)

    output = tmp_path / "first.pt2"
    export = run_cli_here(
        "export", f"{storage}/first", "--format", "pt2", "--output", str(output), "--json"
    )
    assert export.returncode == 0, export.stderr
    assert json.loads(export.stdout)["output"] == str(output)
    assert Path(f"{output}.json").is_file()
    _check_program(output, pngs, predicted)


def _check_program(path: Path, pngs: list[str], predicted: list[dict]) -> None:
    """The exported program labels the PNGs as predict did."""
    import torch

    from raytrain_mnist.nn.model import normalize
    from raytrain_mnist.serving.images import png_to_mnist

    pixels = np.stack([png_to_mnist(Path(p).read_bytes()) for p in pngs])
    program = torch.export.load(str(path)).module()
    with torch.no_grad():
        logits = program(normalize(torch.from_numpy(pixels)))
    assert logits.argmax(1).tolist() == [p["label"] for p in predicted]
