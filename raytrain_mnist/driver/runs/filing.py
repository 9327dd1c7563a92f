"""Filing a checkpoint that a warm service's Train run committed into the run it was
trained for: the folder copied beside the run's others, and Ray Train's record of them
(``checkpoint_manager_snapshot.json``) rewritten as Ray's own checkpoint manager would
have, so that ``runs``, ``evaluate``, a resume by a plain ``fit`` and Ray Train itself read
a service-trained run as any other.
"""

from __future__ import annotations

import math
from typing import Any

from raytrain_mnist import compat
from raytrain_mnist.config import CHECKPOINT_METRIC
from raytrain_mnist.driver.runs.records import SNAPSHOT_FILE, CheckpointRecord
from raytrain_mnist.driver.runs.storage import RunStorage, is_safe_name


def file_checkpoint(
    files: RunStorage, source_path: str, source_filesystem, metrics: dict[str, Any], keep: int
) -> str:
    """Copy the checkpoint folder at ``source_path`` (in ``source_filesystem``) into the run
    ``files``, add it to the run's record as its latest, drop (record and folder) what Ray
    would no longer keep: the ``keep`` best by validation accuracy, the latest always.
    Returns the filed checkpoint's path (or URI)."""
    import pyarrow.fs

    name = source_path.rstrip("/").rsplit("/", 1)[-1]
    if not is_safe_name(name):
        raise ValueError(f"not a checkpoint folder name: {name!r}")
    files.filesystem.create_dir(files.path(name), recursive=True)  # copy_files makes none
    pyarrow.fs.copy_files(
        source_path,
        files.path(name),
        source_filesystem=source_filesystem,
        destination_filesystem=files.filesystem,
    )
    snapshot = CheckpointRecord(files).snapshot()
    results = [
        (r["checkpoint_dir_name"], r["metrics"], index)
        for r, index in zip(
            snapshot.get("checkpoint_results") or [],
            snapshot.get("checkpoint_report_indices") or [],
            strict=False,
        )
        if r["checkpoint_dir_name"] != name
    ]
    report = int(snapshot.get("current_report_index", 0))
    results.append((name, metrics, report))
    kept, dropped = _retain(results, keep)
    files.write_bytes(
        SNAPSHOT_FILE, compat.checkpoint_manager_snapshot(kept, latest=name, reports=report + 1)
    )
    for gone, _, _ in dropped:
        files.filesystem.delete_dir(files.path(gone))
    return f"{files.dir}/{name}"


def _score(metrics: dict[str, Any]) -> float:
    value = metrics.get(CHECKPOINT_METRIC)
    ok = isinstance(value, (int, float)) and not math.isnan(value)
    return float(value) if ok else float("-inf")  # a preemption's: below every evaluated one


def _retain(results: list, keep: int) -> tuple[list, list]:
    """What Ray's checkpoint manager keeps of ``results`` (the latest last), in its order
    (by the score, worst first): the ``keep`` best, and the latest whatever its score."""
    ranked = sorted(results, key=lambda r: _score(r[1]))  # stable: report order in a tie
    best = ranked[-keep:]
    kept = [r for r in ranked if r in best or r is results[-1]]
    return kept, [r for r in ranked if r not in kept]
