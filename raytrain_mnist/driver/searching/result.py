"""What a search returns: :class:`SearchResult` (what ``best.json`` holds), its trials
ranked best first, and ``results.csv``.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_mnist.config import RunSettings, TrainConfig, flags_of
from raytrain_mnist.driver.events import Status
from raytrain_mnist.driver.runs import BEST_FILE, Run
from raytrain_mnist.driver.searching.plan import Plan
from raytrain_mnist.driver.searching.records import TRIAL_STOPPED
from raytrain_mnist.driver.searching.run import Session
from raytrain_mnist.shell import command_line

RESULTS_FILE = "results.csv"
PLOT_FILE = "val_accuracy.png"
#: What a search ended as (``SearchResult.status``).
FINISHED: Status = "finished"
INTERRUPTED: Status = "interrupted"
FAILED: Status = "failed"
#: The error of a trial that Tune ended before its last epoch without one of its own.
NOT_RUN_OUT = "Tune ended the trial before its last epoch (see the search's log)"


@dataclass(frozen=True)
class SearchResult:
    """A search that ended: its trials ranked, the best one, and where it all lies.

    ``status``: ``"finished"`` (every trial ended), ``"interrupted"`` (a Ctrl-C stopped it;
    the same search resumes the ``num_unfinished`` trials) or ``"failed"`` (``num_errors``
    trials failed; searching again retries them). The other fields are what ``best.json``
    holds (:meth:`to_dict`); ``best_metric`` is the best trial's best ``metric``, ``trials``
    each trial (ranked, best first), with its per-epoch ``history``.
    """

    status: Status
    name: str
    experiment_dir: str
    metric: str
    mode: str
    best_trial: str | None
    best_metric: float | None
    best_val_accuracy: float | None
    best_epoch: int | None
    best_config: dict | None  # every TrainConfig field of the best trial
    best_checkpoint: str | None
    fit_command: str | None  # the fit command that trains the best trial's config again
    num_trials: int
    num_finished: int
    num_stopped_early: int
    num_errors: int
    num_unfinished: int
    search_space: dict
    scheduler: str
    max_epochs: int
    num_workers: int
    wall_time_s: float
    trials: list[dict]

    @property
    def files(self) -> tuple[str, ...]:
        """What the search wrote into ``experiment_dir`` besides Tune's state and the runs."""
        return tuple(f"{self.experiment_dir}/{f}" for f in (RESULTS_FILE, PLOT_FILE, BEST_FILE))

    def to_dict(self) -> dict[str, Any]:
        """What ``best.json`` holds: the fields but ``status``, ``best_metric`` named
        ``best_<metric>``, and the trials without their history."""
        record: dict[str, Any] = {
            "name": self.name,
            "experiment_dir": self.experiment_dir,
            "metric": self.metric,
            "mode": self.mode,
            "best_trial": self.best_trial,
            f"best_{self.metric}": self.best_metric,
            "best_val_accuracy": self.best_val_accuracy,
        }
        skip = {"status", "best_metric", "trials", *record}
        record.update(
            {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        )
        record["trials"] = [{k: v for k, v in t.items() if k != "history"} for t in self.trials]
        return record


def collect_trials(plan: Plan, session: Session, mode: str) -> list[dict]:
    """One dict per trial of ``plan``, ranked best first by the best ``metric`` over its
    epochs: an ended trial as its record says, the others as far as they got."""
    metric = session.metric
    trials = [_summary(name, values, session, mode) for name, values in plan]
    sign = -1 if mode == "max" else 1
    trials.sort(
        key=lambda t: (
            t[f"best_{metric}"] is None,
            sign * (t[f"best_{metric}"] or 0),
            t["trial_id"],
        )
    )
    for rank, trial in enumerate(trials, 1):
        trial["rank"] = rank
    return trials


def _summary(name: str, values: dict, session: Session, mode: str) -> dict:
    """Trial ``name`` as a result lists it (its rank comes after)."""
    metric = session.metric
    record = session.ended.get(name)
    if record is not None:
        state, history = record["status"], record["history"]
    else:
        # Only a stopped search leaves a trial unfinished; one Tune ended on its own, with
        # no error of the trial's, failed all the same (the next search trains it again).
        state = "unfinished" if session.interrupted and name not in session.errors else "error"
        history = session.history(name)
    scored = [h for h in history if h[metric] is not None]
    best_row = None
    if scored:
        pick = max if mode == "max" else min
        best_row = pick(scored, key=lambda h: h[metric])
    accuracies = [h["val_accuracy"] for h in history if h["val_accuracy"] is not None]
    return {
        "trial_id": name,
        "config": dict(values),
        "status": state,
        "stopped_early": state == TRIAL_STOPPED,
        "epochs_run": history[-1]["epoch"] if history else 0,
        "best_epoch": best_row["epoch"] if best_row else None,
        f"best_{metric}": best_row[metric] if best_row else None,
        "best_val_accuracy": max(accuracies, default=None),
        # The trial's Train run knows what it kept: the best of those by the metric.
        "best_checkpoint": Run(session.runs_root, name).best_checkpoint(metric, mode),
        "history": history,
        "error": session.errors.get(name, NOT_RUN_OUT) if state == "error" else None,
    }


def fit_command(
    fit_words: Sequence[str], train: TrainConfig, run: RunSettings, config: dict
) -> str:
    """The ``fit`` command (``fit_words`` and flags) that trains ``config`` again."""
    trained = dataclasses.replace(train, **config)
    return command_line([*fit_words, *flags_of(trained, run, skip=("name", "fresh"))])


def results_csv(trials: list[dict], searched: list[str], metric: str) -> bytes:
    """What ``results.csv`` holds: a row per trial, ranked, with its values and epochs."""
    columns = ["rank", "trial_id", *searched, "best_val_accuracy"]
    if metric != "val_accuracy":
        columns.append(f"best_{metric}")
    columns += [
        "best_epoch",
        "epochs_run",
        "stopped_early",
        "status",
        "best_checkpoint",
        "val_accuracy_per_epoch",
    ]
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for t in trials:
        writer.writerow(
            {
                **t,
                **{n: t["config"].get(n) for n in searched},
                "val_accuracy_per_epoch": " ".join(
                    f"{h['val_accuracy']:.6f}" for h in t["history"]
                ),
            }
        )
    return out.getvalue().encode()
