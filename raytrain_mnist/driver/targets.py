"""What RUN_DIR_OR_CHECKPOINT names: the checkpoint to load, and the run that wrote it.

``evaluate`` and ``serve`` take the same argument: a run directory (its ``summary.json``
names the best checkpoint), a Tune experiment directory (its ``best.json`` names the best
trial), a trial's run inside one (``<experiment>/runs/<trial>``: its best checkpoint), a
checkpoint directory (``fit``'s ``checkpoint_*`` or a Tune trial's) or a
``state.pt`` file; a local path or a URI. :func:`resolve_target` turns it into a
:class:`Target`. Only checkpoints that lie inside the run given are followed: a path
recorded in a file of the run never leads elsewhere: the best trial named in ``best.json`` is
one folder under ``runs/`` (a safe name, no link out of the experiment), the checkpoints Ray's
snapshot names are checked by :class:`~raytrain_mnist.driver.runs.records.CheckpointRecord`,
and a path in ``summary.json`` is followed only when it lies inside the run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from raytrain_mnist.config import CHECKPOINT_METRIC
from raytrain_mnist.driver.runs import (
    BEST_FILE,
    DATA_DIR_KEY,
    RUNS_DIR,
    SEARCH_FILE,
    STATE_FILE,
    SUMMARY_FILE,
    CorruptSnapshot,
    Run,
    check_no_credentials,
    is_safe_name,
    is_uri,
)
from raytrain_mnist.errors import EXIT_USAGE, UserError


@dataclass(frozen=True)
class Target:
    """What RUN_DIR_OR_CHECKPOINT resolved to."""

    checkpoint: str  # the checkpoint directory (a local path or a URI), or a bare state.pt
    summary: dict | None  # the summary of the run that wrote it, when found
    run: Run | None  # the run (or Tune experiment) it belongs to, when found


def resolve_target(target: str | os.PathLike) -> Target:
    """A run directory (its best committed checkpoint), a Tune experiment directory (its
    best trial's), a checkpoint directory or a ``state.pt`` file; local or a URI.
    :class:`UserError` (one line) when it is none of them."""
    text = str(target)
    if is_uri(text):
        check_no_credentials(text, "RUN_DIR_OR_CHECKPOINT")
        run = Run.at(text)
        if run.is_file(STATE_FILE):
            return _checkpoint_target(text, run)
        if not run.exists():
            raise UserError(f"{text} does not exist", EXIT_USAGE)
        return _run_target(run)
    path = Path(text).expanduser()
    if not path.exists():
        raise UserError(
            f"{path} does not exist; pass a run directory, a checkpoint "
            f"directory or a {STATE_FILE} file",
            EXIT_USAGE,
        )
    if path.is_file() and path.name in (SUMMARY_FILE, BEST_FILE):
        path = path.parent
    if path.is_dir() and not (path / STATE_FILE).is_file():
        return _run_target(Run.at(path))
    if path.is_file():
        with path.open("rb") as f:
            if f.read(4) != b"PK\x03\x04":  # torch.save writes a zip archive
                raise UserError(
                    f"{path} is not a checkpoint: pass a run directory, a "
                    f"checkpoint directory or a {STATE_FILE} file",
                    EXIT_USAGE,
                )
    return _checkpoint_target(str(path.resolve()), None)


def _run_target(run: Run) -> Target:
    """A fit run (``summary.json``) or a Tune experiment (``best.json``)."""
    try:
        return _recorded_target(run)
    except CorruptSnapshot as exc:
        raise UserError(
            f"cannot read the checkpoints of {run.dir}: {exc.path} is corrupt "
            f"({exc.reason}); move it away"
        ) from exc


def _recorded_target(run: Run) -> Target:
    best = run.read_json(BEST_FILE)
    summary = run.summary()
    if summary is None and best is not None and run.is_file(SEARCH_FILE):
        trial = best.get("best_trial")
        if not trial:
            raise UserError(f"search {run.dir} has no trial with a result yet")
        metric, mode = best.get("metric", CHECKPOINT_METRIC), best.get("mode", "max")
        if not is_safe_name(trial):
            raise UserError(
                f"{run.dir}/{BEST_FILE} names best trial {trial!r}, which is not one "
                f"folder under {RUNS_DIR}/; refusing to follow it (move the file away)"
            )
        if not isinstance(metric, str) or mode not in ("max", "min"):
            raise UserError(
                f"{run.dir}/{BEST_FILE} is not a search record of raytrain_mnist "
                f"(metric {metric!r}, mode {mode!r}); move it away"
            )
        trial_run = Run(f"{run.dir}/{RUNS_DIR}", trial)
        if not run.contains(trial_run.dir):
            raise UserError(
                f"the best trial of {run.dir} ({trial}) leads outside the experiment; "
                "refusing to follow it"
            )
        checkpoint = trial_run.best_checkpoint(metric, mode)
        if checkpoint is None:
            raise UserError(f"the best trial of {run.dir} ({trial}) kept no checkpoint")
        return Target(checkpoint, _search_summary(run), run)
    if summary is None and (trial := _trial_target(run)) is not None:
        return trial
    if summary is None:
        if run.local:
            found = sorted(Path(run.dir).glob(f"checkpoint_*/{STATE_FILE}"))
            hint = f"; pass one of its checkpoints, e.g. {found[-1].parent}" if found else ""
        else:
            hint = ""
        raise UserError(
            f"{run.dir} is neither a run directory (no {SUMMARY_FILE}) nor a "
            f"checkpoint (no {STATE_FILE}){hint}",
            EXIT_USAGE,
        )
    # Ray's record of what it committed names checkpoints relative to the run: always inside.
    checkpoint = run.best_checkpoint() or run.relocate(summary.get("best_checkpoint"))
    if checkpoint is None:
        raise UserError(
            f"run {run.dir} has no checkpoint (status: "
            f"{summary.get('status', 'unknown')}); train it first"
        )
    return Target(checkpoint, summary, run)


def _trial_target(run: Run) -> Target | None:
    """A trial's run inside a search (``<experiment>/runs/<trial>``, which holds no
    ``summary.json``): its best kept checkpoint by the search's metric, and the data the
    search trained on. None when ``run`` is not one."""
    parents = _parents(run.dir)
    if len(parents) < 2 or parents[0].rstrip("/").rpartition("/")[2] != RUNS_DIR:
        return None
    experiment = Run.at(parents[1], record=SEARCH_FILE)
    search = quietly(lambda: experiment.read_json(SEARCH_FILE))
    if not isinstance(search, dict):
        return None
    metric, mode = search.get("metric", CHECKPOINT_METRIC), search.get("mode", "max")
    if not isinstance(metric, str) or mode not in ("max", "min"):
        raise UserError(
            f"{experiment.dir}/{SEARCH_FILE} is not a search record of raytrain_mnist "
            f"(metric {metric!r}, mode {mode!r}); move it away"
        )
    checkpoint = run.best_checkpoint(metric, mode)
    if checkpoint is None:
        raise UserError(f"trial {run.name} of search {experiment.dir} kept no checkpoint yet")
    return Target(checkpoint, _search_summary(experiment, search), run)


def _checkpoint_target(checkpoint: str, run: Run | None) -> Target:
    """A checkpoint inside a run says which data it used: the run's summary, or a Tune
    experiment's search record (``<experiment>/runs/<trial>/checkpoint_*``)."""
    parents = _parents(checkpoint)
    for parent in parents[:4]:
        owner = Run.at(parent)
        summary = quietly(owner.summary)
        if summary is not None and "dataset" in summary:
            return Target(checkpoint, summary, owner)
        search = quietly(lambda owner=owner: owner.read_json(SEARCH_FILE))
        if search is not None and search.get("dataset") in ("mnist", "sample"):
            return Target(checkpoint, _search_summary(owner, search), owner)
    return Target(checkpoint, None, run)


def _parents(path: str) -> list[str]:
    if is_uri(path):
        scheme, _, rest = path.partition("://")
        parts = rest.rstrip("/").split("/")
        return [f"{scheme}://{'/'.join(parts[:i])}" for i in range(len(parts) - 1, 1, -1)]
    return [str(p) for p in Path(path).parents]


def _search_summary(experiment: Run, search: dict | None = None) -> dict:
    """A search's record in the shape of a run's summary: its data set, the data's identity
    and where the search read it (``config.run.data_dir``, as a fit's summary says)."""
    search = search if search is not None else (experiment.read_json(SEARCH_FILE) or {})
    return {
        "dataset": search.get("dataset"),
        "name": experiment.name,
        "data": search.get("data"),
        "config": {"run": {"data_dir": search.get(DATA_DIR_KEY)}},
    }


def quietly(read):
    """``read()``, or None when it raises :class:`UserError` (an unreadable record)."""
    try:
        return read()
    except UserError:
        return None
