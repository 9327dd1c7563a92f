"""``raytrain-mnist runs``: the runs and searches under a storage path; ``runs show NAME``: one.

The listing is :func:`raytrain_mnist.driver.runs.listing.list_runs` (newest first, a line
each: name, kind, status, best validation accuracy, epochs done/planned, workers, when it
started, wall seconds, path; a run whose records cannot be read is listed as ``damaged``).
``show`` prints one run's summary, its best checkpoint and the command that resumes it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_mnist._cli import (
    ArgumentParser,
    Command,
    add_json_arg,
    command_line,
    emit_result,
    exit_now,
    invocation,
    printable,
)
from raytrain_mnist.config import DEFAULT_RECIPE, RECIPES
from raytrain_mnist.driver.runs import BEST_FILE, SUMMARY_FILE, Run
from raytrain_mnist.driver.runs.listing import RunEntry, find_run, list_runs
from raytrain_mnist.driver.targets import quietly, resolve_target
from raytrain_mnist.errors import UserError


def _storage_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-path",
        metavar="STORAGE_PATH",
        help="where the runs live: a local path or s3://... (default: "
        "$RAYTRAIN_MNIST_STORAGE_PATH, else runs)",
    )


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist runs",
        usage="raytrain-mnist runs [--storage-path STORAGE_PATH] [--json]\n"
        "       raytrain-mnist runs show NAME [--storage-path STORAGE_PATH] [--json]",
        description="List the runs and searches under a storage path, newest first: name, "
        "kind, status, best validation accuracy, epochs done/planned, workers, start, wall "
        "seconds, path.",
        epilog="'runs show NAME' prints one run's summary, its best checkpoint and the "
        "command that resumes it.",
    )
    _storage_arg(parser)
    add_json_arg(parser)
    return parser


def build_show_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist runs show",
        description="One run's (or search's) summary, its best checkpoint and the command "
        "that resumes it.",
    )
    parser.add_argument("name", metavar="NAME", help="the run's name, as `runs` lists it")
    _storage_arg(parser)
    add_json_arg(parser)
    return parser


@dataclass(frozen=True)
class RunsOptions:
    storage_path: str
    show: str | None  # a run's name: `runs show NAME`
    json: bool


def parse_options(argv: Sequence[str]) -> RunsOptions:
    show = list(argv[:1]) == ["show"]
    args = (build_show_parser() if show else build_parser()).parse_args(argv[1:] if show else argv)
    storage = args.storage_path or os.environ.get("RAYTRAIN_MNIST_STORAGE_PATH") or "runs"
    return RunsOptions(storage, args.name if show else None, args.json)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _when(started: float | None) -> str:
    if started is None:
        return "-"
    return datetime.datetime.fromtimestamp(started).strftime("%Y-%m-%d %H:%M")


def _epochs(done: int | None, planned: int | None) -> str:
    shown = "-" if done is None else str(done)
    return shown if planned is None else f"{shown}/{planned}"


def _workers(value: Any) -> str:
    if isinstance(value, list) and len(value) == 2:
        return f"{value[0]}-{value[1]}"
    return "-" if value is None else str(value)


def format_table(entries: Sequence[RunEntry]) -> str:
    """The listing as ``runs`` prints it: a header and a line per run."""
    rows = [("NAME", "KIND", "STATUS", "BEST_ACC", "EPOCHS", "WORKERS", "STARTED", "WALL_S")]
    for e in entries:
        rows.append(
            (
                printable(e.name, lines=False),
                e.kind,
                e.status,
                _percent(e.best_val_accuracy),
                _epochs(e.epochs_done, e.epochs_planned),
                _workers(e.workers),
                _when(e.started),
                "-" if e.wall_s is None else f"{e.wall_s:.0f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row, entry in zip(rows, [None, *entries], strict=True):
        text = "  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in
                         enumerate(zip(row, widths, strict=True)))  # fmt: skip
        path = "PATH" if entry is None else printable(entry.path, lines=False)
        problem = "" if entry is None or not entry.problem else f"  ({entry.problem})"
        lines.append(f"{text}  {path}{problem}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- show


def fit_resume_command(summary: dict, name: str) -> str | None:
    """The ``fit`` command that continues the run ``summary`` describes: its recorded
    settings as flags (those that differ from fit's defaults), checked by fit's own parse.
    None when the recorded settings are not ones fit takes."""
    from raytrain_mnist import fit

    config = summary.get("config") if isinstance(summary, dict) else None
    if not isinstance(config, dict):
        return None
    values = _flat({**(config.get("run") or {}), **(config.get("train") or {})})
    parser = fit.build_parser()
    words = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "recipe", "fresh", "name"):
            continue
        if action.dest not in values:
            continue
        value = values[action.dest]
        if isinstance(value, list):
            value = "-".join(map(str, value))  # an elastic range, as --num-workers takes it
        # What fit reads when the flag is left out: the default recipe's value, else the
        # field's default.
        default = RECIPES[DEFAULT_RECIPE].get(action.dest, parser.get_default(action.dest))
        if isinstance(action, argparse._StoreTrueAction):
            if value is True:
                words.append(action.option_strings[0])
        elif value is not None and value != default:
            words += [action.option_strings[0], str(value)]
    words += ["--name", name]
    try:
        fit.parse_config(words)
    except (SystemExit, UserError, ValueError, TypeError):
        return None
    return command_line([*invocation("fit"), *words])


def _flat(record: dict) -> dict:
    """Nested sections of settings made one mapping of field names to values."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_flat(value))
        else:
            out[key] = value
    return out


def show_record(entry: RunEntry) -> dict:
    """What ``runs show`` says about ``entry``: the entry, the run's summary (a search's
    ``best.json``), its best checkpoint and the command that resumes it."""
    run = Run.at(entry.path)
    summary = quietly(lambda: run.read_json(BEST_FILE if entry.kind == "tune" else SUMMARY_FILE))
    target = quietly(lambda: resolve_target(entry.path))
    if entry.kind == "tune":
        resume = None  # the search's own command, with the same flags, resumes it
        reproduce = (summary or {}).get("fit_command")
    else:
        resume = fit_resume_command(summary, entry.name) if summary else None
        reproduce = None
    return {
        **entry.to_dict(),
        "best_checkpoint": None if target is None else target.checkpoint,
        "resume_command": resume,
        "fit_command": reproduce,
        "summary": summary,
    }


def format_show(record: dict) -> str:
    name, kind, status = record["name"], record["kind"], record["status"]
    lines = [
        f"{kind} run '{printable(name, lines=False)}': {status}"
        + (f" ({record['problem']})" if record.get("problem") else ""),
        f"path:            {printable(record['path'], lines=False)}",
        f"started:         {_when(record['started'])}"
        + ("" if record["wall_s"] is None else f", {record['wall_s']:.0f} s wall"),
        f"epochs:          {_epochs(record['epochs_done'], record['epochs_planned'])}"
        f", workers {_workers(record['workers'])}",
        f"best val_acc:    {_percent(record['best_val_accuracy'])}",
    ]
    summary = record.get("summary") or {}
    if kind == "fit" and summary.get("val_accuracy") is not None:
        lines.append(
            f"last val_acc:    {_percent(summary['val_accuracy'])} on "
            f"{summary.get('val_total')} test images ({summary.get('dataset')})"
        )
    if kind == "tune" and summary.get("best_trial"):
        lines.append(f"best trial:      {summary['best_trial']}")
    checkpoint = record["best_checkpoint"]
    lines.append(f"best checkpoint: {checkpoint or '-'}")
    if checkpoint:
        lines.append(f"evaluate with:   {command_line([*invocation('evaluate'), record['path']])}")
    if record["resume_command"]:
        what = "train again with" if status == "finished" else "resume with"
        extra = " --fresh" if status == "finished" else ""
        lines.append(f"{what}:{' ' * max(1, 16 - len(what))}{record['resume_command']}{extra}")
    elif kind == "tune":
        lines.append("resume with:     the same tune command that started it")
        if record["fit_command"]:
            lines.append(f"reproduce with:  {record['fit_command']}")
    elif status != "damaged":
        lines.append("resume with:     the same fit command that started it")
    return "\n".join(lines)


def run(options: RunsOptions) -> int:
    if options.show is not None:
        record = show_record(find_run(options.storage_path, options.show))
        emit_result(record)
        print(format_show(record))
        return 0
    entries = list_runs(options.storage_path)
    emit_result({"storage_path": options.storage_path, "runs": [e.to_dict() for e in entries]})
    if not entries:
        print(f"no runs in {options.storage_path}", file=sys.stderr)
        return 0
    print(format_table(entries))
    return 0


COMMAND = Command("runs", build_parser, parse_options, run, json=True)
cli = COMMAND.main


if __name__ == "__main__":
    exit_now(COMMAND.main())
