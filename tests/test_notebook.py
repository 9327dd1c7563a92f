"""notebooks/quickstart.ipynb runs top to bottom, headless, with small settings."""

from __future__ import annotations

import base64
import io
import json
import time

import nbformat
import pytest
from nbclient import NotebookClient
from PIL import Image

from tests.conftest import REPO

NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"


def _outputs(nb, kind: str) -> list:
    return [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if kind in out.get("data", {})
    ]


def _stdout(nb, marker: str) -> str:
    """What the code cell whose source holds ``marker`` wrote to stdout."""
    cell = next(c for c in nb.cells if c.cell_type == "code" and marker in c.source)
    return "".join(
        out.get("text", "")
        for out in cell.outputs
        if out.get("output_type") == "stream" and out.get("name") == "stdout"
    )


def _text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", "") + out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def test_the_committed_notebook_is_clean_and_imports_rather_than_redefines():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert all(
        not c.outputs and c.execution_count is None for c in nb.cells if c.cell_type == "code"
    ), "commit the notebook without outputs"
    for redefinition in (
        "class ConvNet",
        "nn.Module",
        "def train",
        "optim.SGD",
        "lr=0.1",
        "batch_size=",
    ):
        assert redefinition not in code, redefinition
    assert "from raytrain_mnist" in code


def test_quickstart_runs_headless(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    # Papermill-style: a cell after the parameters cell overrides them.
    nb.cells.insert(
        params + 1,
        nbformat.v4.new_code_cell(
            f"EPOCHS = 1\nNUM_WORKERS = 1\nSTORAGE = {str(tmp_path / 'runs')!r}\nTUNE_SAMPLES = 1"
        ),
    )
    started = time.monotonic()
    # The kernel inherits this process's environment (RAY_AUTH_MODE=disabled, the cache).
    NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    elapsed = time.monotonic() - started

    text = _text(nb)
    assert "epoch   1/1" in text, text[-3000:]
    assert "digit  accuracy" in text and "fit reported" in text
    images = _outputs(nb, "image/png")
    tune_ran = "best trial" in text
    assert len(images) == (4 if tune_ran else 3), f"{len(images)} images; output:\n{text[-3000:]}"
    for out in images:
        with Image.open(io.BytesIO(base64.b64decode(out["data"]["image/png"]))) as image:
            assert image.format == "PNG" and image.size[0] >= 300
    summaries = list((tmp_path / "runs").glob("*/summary.json"))
    assert len(summaries) == 1
    summary = json.loads(summaries[0].read_text())
    assert summary["status"] == "finished" and summary["dataset"] == "sample"
    evaluations = list((tmp_path / "runs").glob("*/evaluation_checkpoint_*/evaluation.json"))
    assert evaluations, "the notebook's evaluation wrote nothing beside the checkpoint"

    # The library calls print nothing: a cell's stdout is exactly what the cell prints.
    from raytrain_mnist.driver.evaluation import REPORT_FILES, Evaluation
    from raytrain_mnist.evaluate import format_report

    out_dir = evaluations[0].parent
    evaluation = Evaluation(
        **json.loads(evaluations[0].read_text()),
        out=out_dir,
        files=tuple(out_dir / f for f in REPORT_FILES),
    )
    assert _stdout(nb, "evaluate_checkpoint(run_dir") == format_report(evaluation) + "\n"
    if tune_ran:
        experiments = list((tmp_path / "runs").glob("*/best.json"))
        assert experiments, "no Tune experiment"
        best = json.loads(experiments[0].read_text())
        printed = _stdout(nb, "search(").splitlines()
        assert len(printed) == 1 and printed[0].startswith(f"best trial {best['best_trial']}: "), (
            printed
        )
    else:
        pytest.importorskip("raytrain_mnist.tune")  # the cell may skip only without tune
        pytest.fail("the Tune cell skipped although raytrain_mnist.tune exists")
    print(f"notebook: {elapsed:.0f} s")
