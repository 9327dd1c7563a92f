"""Command-line plumbing shared by every entry point: the command layer only.

Every command has one shape, :class:`Command`: a parser, a parse of the words after the
command name into an options dataclass, and a run of those options that returns an exit
status. ``__main__`` registers them once; ``submit`` checks any command's words through the
same parse before it contacts a cluster.

Flags are generated from the config dataclasses' fields, so each default and help text is
written once (in :mod:`raytrain_mnist.config`). Every error a user can cause ends as one
line on stderr and a non-zero exit status, never a traceback.

SIGTERM is Ctrl-C: ``submit stop``, systemd, Docker, Kubernetes and Slurm stop a command
with SIGTERM, and for as long as a command runs (:func:`run_cli`) that signal is handed to
whatever handles SIGINT at that moment (Python's ``KeyboardInterrupt``, Tune's graceful stop
while a search runs), so the library takes its Ctrl-C path: fit writes its summary, tune its
``best.json``, and the resume command is printed. The command then says ``terminated``
instead of ``interrupted`` and exits 143 (:data:`~raytrain_mnist.errors.EXIT_TERMINATED`)
instead of 130.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import difflib
import gc
import json
import logging
import os
import signal
import sys
import threading
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from raytrain_mnist.config import (
    DEFAULT_RECIPE,
    RECIPE_SUMMARY,
    RECIPES,
    flag_fields,
)
from raytrain_mnist.config import flags_of as flags_of  # re-exported
from raytrain_mnist.display import printable as printable  # re-exported
from raytrain_mnist.errors import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    ConfigError,
    UserError,
    first_line,
)
from raytrain_mnist.shell import command_line as command_line  # re-exported
from raytrain_mnist.shell import python_command
from raytrain_mnist.uris import check_no_credentials


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is a single line naming the flag and pointing at --help,
    and a flag is only ever its whole name: argparse's prefix matching read ``--epoch 2`` as
    ``--epochs 2``; here it is refused, with the flag meant suggested."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, but ``--flag=--`` is refused as the flag without its value. Python
        3.11's argparse drops a ``--`` that is a flag's whole value and then stores an empty
        list for a flag that takes one string (3.12 keeps the ``--``); no flag of ours takes
        ``--``, so it is refused the same way on every Python."""
        words = list(sys.argv[1:] if args is None else args)
        for word in words:
            if word == "--":  # the words after it are not flags
                break
            flag, equals, value = word.partition("=")
            if equals and value == "--" and flag in self._option_string_actions:
                self.error(f"argument {flag}: expected one argument")
        return super().parse_known_args(words, namespace)

    def error(self, message: str) -> typing.NoReturn:
        # The message quotes the user's words: one line, whatever they hold.
        self.exit(
            EXIT_USAGE,
            f"{self.prog}: error: {printable(message, lines=False)}{self._suggestion(message)}"
            " (see --help)\n",
        )

    def _suggestion(self, message: str) -> str:
        """``; did you mean --epochs?`` for the first unknown flag of ``message`` that is
        close to one of this parser's."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [s for s in self._option_string_actions if s.startswith("--")]
        for word in message.removeprefix("unrecognized arguments:").split():
            flag = word.partition("=")[0]
            if flag.startswith("--"):
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.7)
                if not close:
                    close = [k for k in known if k.startswith(flag)][:1]
                if close:
                    return f"; did you mean {close[0]}?"
        return ""


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    """``--json``: the command's result as one JSON object on stdout, everything else on
    stderr (:meth:`Command.main` does it; the command hands its result to :func:`emit_result`)."""
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object on stdout (the fields of the files the "
        "command writes); everything else goes to stderr; exit statuses are unchanged",
    )


def add_dataclass_args(
    parser: argparse.ArgumentParser,
    cls: type,
    title: str,
    only: Sequence[str] | None = None,
    defaults: dict[str, Any] | None = None,
    types: dict[str, Callable[[str], Any]] | None = None,
    helps: dict[str, str] | None = None,
) -> None:
    """One flag per field of ``cls`` (or of those named in ``only``): ``--field-name``,
    typed, with the field's default (or the one ``defaults`` gives for this command), read
    by the field's type or the parser ``types`` gives for this command, and explained by
    the field's help (or the text ``helps`` gives for this command)."""
    group = parser.add_argument_group(title)
    for f, hint in flag_fields(cls).values():
        if only is not None and f.name not in only:
            continue
        flag = "--" + f.name.replace("_", "-")
        meta = {**f.metadata, **({"help": helps[f.name]} if f.name in (helps or {}) else {})}
        default = (defaults or {}).get(f.name, f.default)
        kind = _base_type(hint)
        if kind is bool:
            group.add_argument(
                flag, dest=f.name, action="store_true", default=default, help=meta.get("help")
            )
            continue
        shown = "" if default is None else f" (default: {default})"
        group.add_argument(
            flag,
            dest=f.name,
            type=(types or {}).get(f.name, kind),
            default=default,
            choices=meta.get("choices"),
            help=f"{meta.get('help')}{shown}",
            metavar=None if meta.get("choices") else f.name.upper(),
        )


def add_recipe_arg(parser: argparse.ArgumentParser) -> None:
    """``--recipe NAME``: the training flags' defaults come from that named recipe
    (``config.RECIPES``); training flags given beside it change its values."""
    parser.add_argument(
        "--recipe",
        choices=tuple(RECIPES),
        default=DEFAULT_RECIPE,
        help="start from a named recipe: "
        + "; ".join(f"{name} = {text}" for name, text in RECIPE_SUMMARY.items())
        + f" (default: {DEFAULT_RECIPE})",
    )


def parse_with_recipe(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    namespace: argparse.Namespace | None = None,
) -> argparse.Namespace:
    """``parser.parse_args`` with the training flags' defaults taken from ``--recipe``'s
    values (read first, so that a flag beside it wins wherever it stands)."""
    first = ArgumentParser(prog=parser.prog, add_help=False)
    add_recipe_arg(first)
    known, _ = first.parse_known_args(argv)
    parser.set_defaults(**RECIPES[known.recipe])
    return parser.parse_args(argv, namespace=namespace)


def invocation(command: str) -> list[str]:
    """How this process was started, as the words that start ``command`` again: the console
    script, ``python -m raytrain_mnist COMMAND``, or ``python -m raytrain_mnist.COMMAND``.
    From Python (a notebook), the ``-m`` form."""
    script = Path(sys.argv[0] if sys.argv and sys.argv[0] else "")
    if script.name == "raytrain-mnist":
        return ["raytrain-mnist", command]
    python = python_command()
    if script.parent.name == "raytrain_mnist" and script.stem == command:
        return [python, "-m", f"raytrain_mnist.{command}"]
    return [python, "-m", "raytrain_mnist", command]


def add_target_argument(parser: argparse.ArgumentParser) -> None:
    """RUN_DIR_OR_CHECKPOINT, as ``driver.targets.resolve_target`` takes it (evaluate, serve)."""
    parser.add_argument(
        "target",
        type=_target,
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run directory (its best checkpoint), a Tune experiment (its "
        "best trial's) or one of its trials' runs, a checkpoint directory or a state.pt "
        "file; a "
        "local path or a URI such as s3://bucket/runs/NAME",
    )


def _target(text: str) -> str:
    """RUN_DIR_OR_CHECKPOINT without credentials in it (refused, redacted, at parse time)."""
    try:
        check_no_credentials(text, "RUN_DIR_OR_CHECKPOINT")
    except ConfigError as exc:  # argparse would echo the value after a ValueError
        raise argparse.ArgumentTypeError(str(exc).removeprefix("RUN_DIR_OR_CHECKPOINT ")) from None
    return text


def dataclass_from_args(
    cls: type, args: argparse.Namespace, only: Sequence[str] | None = None
) -> Any:
    """``cls`` from the parsed flags (those in ``only``; the rest keep their defaults)."""
    values = {
        name: getattr(args, name) for name in flag_fields(cls) if only is None or name in only
    }
    return cls.from_flags(**values) if hasattr(cls, "from_flags") else cls(**values)


def _base_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


#: The status a command's process exits with, once :func:`exit_now` was given it.
_EXIT_STATUS: list[int] = []


def _last_at_exit() -> None:
    """This process's last exit handler: it is registered when this module is first imported,
    before any command runs, so every handler registered later (Ray's shutdown, MLflow's,
    temporary folders') has run, and Python has joined every non-daemon thread. What is left
    is CPython's own teardown: a garbage collection that walks every object torch, Ray and
    pandas made, then each module's freeing, 0.4-0.8 s of a command's exit on these machines
    even with that collection skipped (benchmarks/README.md). A command process
    (:func:`exit_now`) skips it: streams flushed, logging shut down (its handler, registered
    at its import, is the one before this), then ``os._exit``. Any other process (a library
    import, the test suite's in-process commands) only freezes what exists, so that the last
    collection skips it (frozen objects are still freed by reference counting)."""
    gc.freeze()
    if not _EXIT_STATUS:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a reader gone: nothing more to tell it
            stream.flush()
    logging.shutdown()
    os._exit(_EXIT_STATUS[-1])


atexit.register(_last_at_exit)


def exit_now(status: int) -> typing.NoReturn:
    """End a command's process with ``status`` (its ``__main__`` and console script call
    this, never library code): exit handlers and threads as ``sys.exit`` runs them, without
    CPython's teardown after them (:func:`_last_at_exit`)."""
    _EXIT_STATUS.append(status)
    sys.exit(status)


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Run ``main`` and turn the errors a user can cause into one line and an exit status.

    While it runs, SIGTERM stops it as Ctrl-C does (:func:`sigterm_is_ctrl_c`); a command
    stopped either way exits 130 after Ctrl-C, 143 after SIGTERM (:func:`interrupted`)."""
    prog = "raytrain-mnist"
    # A command connects to its Ray itself (driver/cluster.py). A Ray call made with none
    # connected (a thread that outlived its Ray) must fail, not have Ray's auto-init join
    # whatever other Ray runs on this machine, or start one. Read when Ray is imported.
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    with sigterm_is_ctrl_c():
        try:
            status = main(argv)
            return EXIT_TERMINATED if status == EXIT_INTERRUPTED and terminated() else status
        except ConfigError as exc:
            print(f"{prog}: error: {printable(str(exc), lines=False)}", file=sys.stderr)
            return EXIT_USAGE
        except UserError as exc:
            print(f"{prog}: error: {printable(str(exc), lines=False)}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            return interrupted()
        except Exception as exc:  # a bug or an environment problem: still one line by default
            if os.environ.get("RAYTRAIN_MNIST_TRACEBACK"):
                raise
            print(
                f"{prog}: internal error: {exc.__class__.__name__}: "
                f"{printable(first_line(exc), lines=False)} "
                "(set RAYTRAIN_MNIST_TRACEBACK=1 for the traceback)",
                file=sys.stderr,
            )
            return EXIT_FAILURE


#: The SIGTERMs the running command received (a list: the handler only appends).
_TERMINATED: list[int] = []


def on_sigterm(signum: int, frame) -> None:
    """The SIGTERM handler of a running command: note it, then do what Ctrl-C does now.

    SIGINT's handler at this moment decides: Python's own raises ``KeyboardInterrupt``;
    Tune's, while a search runs, stops it gracefully (and a second signal then raises). A
    SIGINT that is ignored (a shell's background job) or left to the system still stops the
    command: ``KeyboardInterrupt``. Public so that a command can put it back after a library
    replaced it (``serve``, once Ray Serve is up)."""
    _TERMINATED.append(signum)
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and handler is not on_sigterm:
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt


def terminated() -> bool:
    """Whether the running command received SIGTERM."""
    return bool(_TERMINATED)


def interrupted() -> int:
    """Say that the command was stopped (``raytrain-mnist: interrupted`` after Ctrl-C,
    ``raytrain-mnist: terminated`` after SIGTERM) and return its exit status (130 or 143)."""
    print(f"raytrain-mnist: {'terminated' if terminated() else 'interrupted'}", file=sys.stderr)
    return EXIT_TERMINATED if terminated() else EXIT_INTERRUPTED


@contextlib.contextmanager
def sigterm_is_ctrl_c() -> Iterator[None]:
    """SIGTERM is Ctrl-C inside the block (:func:`on_sigterm`); the previous handler is put
    back after it. Only the main thread can set handlers: elsewhere the block changes
    nothing. ``ray.init`` replaces the handler with its own (an immediate ``sys.exit``);
    :func:`raytrain_mnist.driver.cluster.connect` puts ours back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _TERMINATED.clear()
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def setup_logging(verbose: bool = False) -> None:
    """A command's log: this package's INFO lines (DEBUG with ``verbose``) on stdout, other
    libraries' from WARNING up (their INFO lines, such as matplotlib's "generated new
    fontManager" on a first run, are nothing a user can act on)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logging.getLogger("raytrain_mnist").setLevel(logging.DEBUG if verbose else logging.INFO)


@dataclasses.dataclass(frozen=True)
class Command:
    """One command of ``raytrain-mnist``.

    ``parse(argv)`` turns the words after the command's name into its options (a dataclass),
    raising :class:`SystemExit` (argparse's usage errors, ``--help``), ``ConfigError`` or
    ``UserError`` for bad input; it starts nothing. ``run(options)`` does the work and returns
    the exit status. Only commands print and choose exit statuses.
    """

    name: str
    build_parser: Callable[[], argparse.ArgumentParser]
    parse: Callable[[Sequence[str]], Any]
    run: Callable[[Any], int]
    #: Whether the command takes ``--json`` (its parser has :func:`add_json_arg`).
    json: bool = False

    def main(self, argv: Sequence[str] | None = None) -> int:
        """Parse and run as a user's command does: every error one line and a status.

        With ``--json`` (a command that takes it), everything the command prints goes to
        stderr, and what it handed to :func:`emit_result` is printed on stdout as one JSON
        object at the end, whatever the exit status."""
        words = list(sys.argv[1:] if argv is None else argv)
        if not (self.json and "--json" in words[: _end_of_flags(words)]):
            return run_cli(lambda given: self.run(self.parse(given)), words)
        _RESULT.clear()
        with _stdout_to_stderr() as stdout:
            try:
                return run_cli(lambda given: self.run(self.parse(given)), words)
            finally:
                if _RESULT:
                    stdout.write(json.dumps(_RESULT[-1], default=str) + "\n")
                    stdout.flush()


#: What the running command handed to :func:`emit_result` (its last record counts).
_RESULT: list[dict] = []


def emit_result(record: dict) -> None:
    """The running command's result, as ``--json`` prints it: the fields of the file it
    writes (``summary.json``, ``best.json``, ``evaluation.json``...)."""
    _RESULT.append(record)


def _end_of_flags(words: Sequence[str]) -> int:
    return words.index("--") if "--" in words else len(words)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[typing.TextIO]:
    """Inside the block, stdout is stderr: Python's ``sys.stdout`` and, where it is the
    process's file descriptor 1, that descriptor too (Ray's and torch's own writes and
    child processes included). Yields the stream that is stdout outside the block."""
    stdout = sys.stdout
    saved = None
    with contextlib.suppress(AttributeError, ValueError, OSError):
        if stdout.fileno() == 1 and sys.stderr.fileno() == 2:
            stdout.flush()
            saved = os.dup(1)
            os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            if saved is None:
                yield stdout
            else:
                with open(os.dup(saved), "w", encoding="utf-8") as real:
                    yield real
    finally:
        if saved is not None:
            sys.stderr.flush()
            os.dup2(saved, 1)
            os.close(saved)
