"""A trial's record of its epochs: ``runs/<trial>/trial.json`` once it ended, and the
per-epoch history read back from what Tune reported and from its checkpoint. A record is
read like input: one this search did not write for that trial is one line, never trusted.
"""

from __future__ import annotations

import logging
from typing import Any

from raytrain_mnist.config import TrainConfig, finite_number
from raytrain_mnist.driver.runs import RUNS_DIR, Run
from raytrain_mnist.errors import EXIT_USAGE, UserError, first_line

logger = logging.getLogger(__name__)

#: ``runs/<trial>/trial.json``: a trial that ended (finished, or stopped early): its values,
#: its status and its per-epoch metrics. Such a trial is never trained again.
TRIAL_FILE = "trial.json"
#: How a trial ended, in its ``trial.json`` (the trials of a result also read "error" and
#: "unfinished": those are trained again by the next search).
TRIAL_FINISHED = "finished"
TRIAL_STOPPED = "stopped early"
ENDED = (TRIAL_FINISHED, TRIAL_STOPPED)


def epoch_entry(result: dict, metric: str) -> dict | None:
    """One epoch of a trial's history, as its record keeps it: the epoch, ``val_accuracy``,
    ``val_loss`` and ``metric`` (None where the number is not finite: a diverged trial)."""
    epoch = result.get("epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
        return None
    if result.get("progress") == "checkpoint":  # a preemption's mid-epoch checkpoint
        return None
    keys = dict.fromkeys(("val_accuracy", "val_loss", metric))
    return {"epoch": epoch, **{k: finite_number(result.get(k)) for k in keys}}


def trial_record(name: str, values: dict, status: str, history: list[dict]) -> dict:
    """What ``trial.json`` holds."""
    return {"trial_id": name, "config": values, "status": status, "history": history}


def record_problem(record: Any, name: str, values: dict, epochs: int, metric: str) -> str | None:
    """What is wrong with ``record`` as the ``trial.json`` of trial ``name`` (its values
    ``values``, at most ``epochs`` epochs), or None: it is read like input."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("trial_id") != name:
        return f"it names trial {record.get('trial_id')!r}"
    if record.get("config") != values:
        return "its values are not the ones this search draws for the trial"
    status = record.get("status")
    if status not in ENDED:
        return f"status {status!r} is not one of {', '.join(ENDED)}"
    history = record.get("history")
    if not isinstance(history, list) or not history or len(history) > epochs:
        return f"its history is not a list of 1 to {epochs} epochs"
    problem = _history_problem(history, metric)
    if problem:
        return problem
    if (status == TRIAL_FINISHED) != (len(history) == epochs):
        return f"{status!r} after {len(history)} of {epochs} epochs"
    return None


def _history_problem(history: list, metric: str) -> str | None:
    """What is wrong with the epochs of a record (1 to N, finite numbers), or None."""
    keys = {"epoch", "val_accuracy", "val_loss", metric}
    for number, entry in enumerate(history, 1):
        if not isinstance(entry, dict) or set(entry) != keys:
            return f"epoch record {number} does not hold exactly {', '.join(sorted(keys))}"
        epoch = entry["epoch"]
        if isinstance(epoch, bool) or epoch != number:
            return f"epoch record {number} is of epoch {epoch!r}"
        for key in keys - {"epoch"}:
            value = entry[key]
            if value is not None and finite_number(value) is None:
                return f"epoch {number}: {key} {value!r} is not a finite number"
        accuracy = entry["val_accuracy"]
        if accuracy is not None and not 0 <= accuracy <= 1:
            return f"epoch {number}: val_accuracy {accuracy!r} is not an accuracy"
    return None


def read_ended_trials(
    experiment: Run, plan: list[tuple[str, dict]], train: TrainConfig, metric: str
) -> dict[str, dict]:
    """The ``trial.json`` records of the trials of ``plan`` that ended, by name. A record
    that is not one this search wrote for that trial is one line (:class:`UserError`)."""
    ended = {}
    for name, values in plan:
        trial_run = Run(f"{experiment.dir}/{RUNS_DIR}", name)
        record = trial_run.read_json(TRIAL_FILE)
        if record is None:
            continue
        problem = record_problem(record, name, values, train.epochs, metric)
        if problem:
            raise UserError(
                f"{trial_run.dir}/{TRIAL_FILE} is not a record of this search's trial "
                f"{name} ({problem}); move it away to train the trial again, or add --fresh",
                EXIT_USAGE,
            )
        ended[name] = record
    return ended


def _checkpoint_history(runs_root: str, name: str, train: dict, metric: str) -> list[dict]:
    """The per-epoch history that trial ``name``'s latest committed checkpoint holds (loaded
    weights-only), [] when it has none or it is not the trial's (``train``: its config)."""
    from raytrain_mnist.nn import checkpoint as ckpt

    trial_run = Run(runs_root, name)
    try:
        latest = trial_run.latest_checkpoint()
        if latest is None:
            return []
        with trial_run.local_copy(latest) as directory:
            state = ckpt.load(directory)
    except (UserError, OSError) as exc:
        logger.warning("trial %s: its checkpoint is unreadable (%s)", name, first_line(exc))
        return []
    history = state.get("history")
    if state.get("config") != train or not isinstance(history, list):
        logger.warning("trial %s: its latest checkpoint is not of this trial", name)
        return []
    entries = [epoch_entry(h, metric) for h in history if isinstance(h, dict)]
    return [e for e in entries if e is not None]


def trial_history(
    runs_root: str,
    name: str,
    train: dict,
    seen: dict[int, dict],
    metric: str,
    through_run: bool = False,
) -> list[dict]:
    """Trial ``name``'s epochs: those Tune reported in this search (``seen``, by epoch), after
    those its checkpoint holds when it resumed (its first epoch here was not epoch 1); up to
    the last epoch reported here, or with ``through_run`` up to the last its Train run
    committed. Epochs 1 to N, or [] when they do not join up."""
    reported = sorted(seen)
    if reported == list(range(1, len(reported) + 1)) and reported and not through_run:
        return [seen[e] for e in reported]
    merged = {e["epoch"]: e for e in _checkpoint_history(runs_root, name, train, metric)}
    merged.update(seen)
    last = reported[-1] if reported and not through_run else max(merged, default=0)
    history = [merged[e] for e in sorted(merged) if e <= last]
    if [e["epoch"] for e in history] != list(range(1, len(history) + 1)):
        logger.warning("trial %s: its epochs do not join up (%s)", name, sorted(merged))
        return []
    return history
