"""The defaults reach >= 99.0 % on the full MNIST test set (needs the full data set)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import full_data_dir, run_cli

DATA = full_data_dir()


@pytest.mark.full_data
@pytest.mark.skipif(
    DATA is None,
    reason="full MNIST absent: set RAYTRAIN_MNIST_DATA or provide ../shared/data/mnist",
)
def test_defaults_reach_99_percent_on_two_workers(tmp_path):
    result = run_cli(
        "fit",
        "--num-workers",
        "2",
        "--data-dir",
        str(DATA),
        "--dataset",
        "mnist",
        "--storage-path",
        str(tmp_path),
        "--name",
        "full",
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["val_total"] == 10000 and summary["train_size"] == 60000
    assert "checksums match the published MNIST" in summary["data_source"]
    assert summary["val_accuracy"] >= 0.990, summary["history"]
