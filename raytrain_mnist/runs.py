"""``raytrain-mnist runs``: the runs and searches under a storage path; ``runs show NAME``: one.

The listing is :func:`raytrain_mnist.driver.runs.listing.list_runs` (newest first, a line
each: name, kind, status, best validation accuracy, epochs done/planned, workers, when it
started, wall seconds, path; a run whose records cannot be read is listed as ``damaged``,
with the reason). ``show`` prints one run's summary, its best checkpoint and the command that
resumes it (a damaged run: one line, exit 1). Every value from a record is shown through
:mod:`raytrain_mnist.display`: escaped, its type checked.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import shlex
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
from raytrain_mnist.display import ACCURACY, COUNT, SECONDS, TEXT, TIME, WORKERS, epochs
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


def format_table(entries: Sequence[RunEntry]) -> str:
    """The listing as ``runs`` prints it: a header and a line per run, every value from the
    runs' records rendered by :mod:`raytrain_mnist.display`."""
    rows = [("NAME", "KIND", "STATUS", "BEST_ACC", "EPOCHS", "WORKERS", "STARTED", "WALL_S")]
    for e in entries:
        rows.append(
            (
                printable(e.name, lines=False),
                e.kind,
                e.status,
                ACCURACY(e.best_val_accuracy),
                epochs(e.epochs_done, e.epochs_planned),
                WORKERS(e.workers),
                TIME(e.started),
                SECONDS(e.wall_s),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row, entry in zip(rows, [None, *entries], strict=True):
        text = "  ".join(
            cell.ljust(w) if i < 3 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        path = "PATH" if entry is None else printable(entry.path, lines=False)
        problem = "" if entry is None or not entry.problem else f"  ({entry.problem})"
        lines.append(f"{text}  {path}{printable(problem, lines=False)}")
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
    run, train = config.get("run") or {}, config.get("train") or {}
    if not isinstance(run, dict) or not isinstance(train, dict):
        return None
    values = _flat({**run, **train})
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
    if _parsed(words) is None:
        return None
    return command_line([*invocation("fit"), *words])


def search_fit_command(best: dict) -> str | None:
    """The ``fit`` command that trains a search's best trial again, rebuilt as
    :func:`fit_resume_command` is, never handed on as ``best.json`` holds it: the flags the
    recorded command gives ``fit`` are read by fit's own parse, must train the best trial's
    recorded settings (``best_config``), and are written out anew from the parsed settings
    after this process's own ``fit`` (so no word of the record reaches the command
    unquoted, and nothing before ``fit`` reaches it at all). None when they do not parse or
    train another config."""
    from raytrain_mnist.config import TrainConfig, flags_of

    recorded, config = best.get("fit_command"), best.get("best_config")
    if not isinstance(recorded, str) or not isinstance(config, dict):
        return None
    try:
        words = shlex.split(recorded)
        cfg = _parsed(words[words.index("fit") + 1 :])
        trains = TrainConfig.from_dict(config)
    except (ValueError, TypeError):  # no "fit", unbalanced quotes, settings not TrainConfig's
        return None
    if cfg is None or cfg.train != trains:
        return None
    recipe = [] if cfg.recipe == DEFAULT_RECIPE else ["--recipe", cfg.recipe]
    flags = flags_of(cfg.train, cfg.run, skip=("fresh", "name"), defaults=RECIPES[cfg.recipe])
    again = _parsed([*recipe, *flags])
    if again is None or again.train != cfg.train:
        return None
    return command_line([*invocation("fit"), *recipe, *flags])


def _parsed(words: Sequence[str]):
    """``words`` as fit parses them (a FitConfig), or None when fit would refuse them; the
    refusal's own line is not printed."""
    from raytrain_mnist import fit

    with contextlib.redirect_stderr(io.StringIO()):
        try:
            return fit.parse_config(words)
        except (SystemExit, UserError, ValueError, TypeError):
            return None


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
    ``best.json``), its best checkpoint and the command that resumes it (a search's: the
    command that trains its best trial again, rebuilt)."""
    run = Run.at(entry.path)
    summary = quietly(lambda: run.read_json(BEST_FILE if entry.kind == "tune" else SUMMARY_FILE))
    target = quietly(lambda: resolve_target(entry.path))
    if entry.kind == "tune":
        resume = None  # the search's own command, with the same flags, resumes it
        reproduce = search_fit_command(summary) if summary else None
        if summary:  # the recorded command is never handed on, in --json either
            summary = {**summary, "fit_command": reproduce}
    else:
        resume = fit_resume_command(summary, entry.name) if summary else None
        reproduce = None
    return {
        **entry.to_dict(),
        "best_checkpoint": None if target is None else target.checkpoint,
        "resume_command": resume,
        "fit_command": reproduce,
        "summary": _finite(summary),
    }


def _finite(value: Any) -> Any:
    """``value`` with every number that is not finite (a diverged run's NaN loss) as None,
    as strict JSON takes it (records nest a few levels: :data:`MAX_RECORD_DEPTH`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def format_show(record: dict) -> str:
    """``runs show`` in words: every value from the run's records rendered by
    :mod:`raytrain_mnist.display` (escaped, its type checked), the commands rebuilt."""
    name, kind, status = record["name"], record["kind"], record["status"]
    wall = record["wall_s"]
    lines = [
        f"{kind} run '{printable(name, lines=False)}': {status}",
        f"path:            {printable(record['path'], lines=False)}",
        f"started:         {TIME(record['started'])}"
        + ("" if wall is None else f", {SECONDS(wall)} s wall"),
        f"epochs:          {epochs(record['epochs_done'], record['epochs_planned'])}"
        f", workers {WORKERS(record['workers'])}",
        f"best val_acc:    {ACCURACY(record['best_val_accuracy'])}",
    ]
    summary = record.get("summary") or {}
    if kind == "fit" and summary.get("val_accuracy") is not None:
        lines.append(
            f"last val_acc:    {ACCURACY(summary['val_accuracy'])} on "
            f"{COUNT(summary.get('val_total'))} test images ({TEXT(summary.get('dataset'))})"
        )
    if kind == "tune" and summary.get("best_trial"):
        lines.append(f"best trial:      {TEXT(summary['best_trial'])}")
    checkpoint = record["best_checkpoint"]
    lines.append(f"best checkpoint: {printable(checkpoint or '-', lines=False)}")
    if checkpoint:
        evaluate = command_line([*invocation("evaluate"), record["path"]])
        lines.append(f"evaluate with:   {printable(evaluate, lines=False)}")
    if record["resume_command"]:
        what = "train again with" if status == "finished" else "resume with"
        extra = " --fresh" if status == "finished" else ""
        command = printable(record["resume_command"], lines=False)
        lines.append(f"{what}:{' ' * max(1, 16 - len(what))}{command}{extra}")
    elif kind == "tune":
        lines.append("resume with:     the same tune command that started it")
        if record["fit_command"]:
            lines.append(f"reproduce with:  {printable(record['fit_command'], lines=False)}")
    else:
        lines.append("resume with:     the same fit command that started it")
    return "\n".join(lines)


def run(options: RunsOptions) -> int:
    if options.show is not None:
        entry = find_run(options.storage_path, options.show)
        if entry.status == "damaged":  # nothing of it can be trusted to show
            raise UserError(f"cannot show run '{entry.name}': {entry.problem}")
        record = show_record(entry)
        emit_result(record)
        print(format_show(record))
        return 0
    entries = list_runs(options.storage_path)
    emit_result({"storage_path": options.storage_path, "runs": [e.to_dict() for e in entries]})
    if not entries:
        print(f"no runs in {printable(options.storage_path, lines=False)}", file=sys.stderr)
        return 0
    print(format_table(entries))
    return 0


COMMAND = Command("runs", build_parser, parse_options, run, json=True)
cli = COMMAND.main


if __name__ == "__main__":
    exit_now(COMMAND.main())
