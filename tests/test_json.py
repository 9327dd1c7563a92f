"""``--json``: the result as one JSON object on stdout and everything else on stderr, with the
fields of the file the command writes; exit statuses unchanged. ``fit --json`` into s3:// and
the walk-through after a first run on S3 storage, as a user types it (runs, runs show,
predict, export), ride on tests/test_iam.py's first s3 fit, under the worker policy."""

from __future__ import annotations

import json

from tests.conftest import run_cli_here


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
