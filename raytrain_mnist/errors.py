"""Errors a user can cause, their exit statuses, and the one line that tells them.

Every layer may import this module (it imports nothing of ours); the command layer turns
these into one line on stderr and an exit status (:func:`raytrain_mnist._cli.run_cli`).
"""

from __future__ import annotations

#: Exit status of a run that failed for a reason other than its input.
EXIT_FAILURE = 1
#: Exit status of usage errors (bad flags, bad config), as argparse uses.
EXIT_USAGE = 2
#: Exit status after Ctrl-C, as shells report SIGINT.
EXIT_INTERRUPTED = 130
#: Exit status after SIGTERM (``submit stop``, systemd, Docker, Kubernetes, Slurm): 128 + 15,
#: as shells report it. The command stops as it does on Ctrl-C.
EXIT_TERMINATED = 143

#: The most characters of a message that one error line quotes.
MAX_LINE = 300


class ConfigError(ValueError):
    """A setting the user can fix. The message names the setting and the fix."""


class UserError(Exception):
    """An error the user can fix; printed as one line. ``exit_code`` picks the status."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Diverged(ValueError):
    """The training loss is not a number: the run cannot go on from here. Raised by every
    worker of the run at the same epoch, before that epoch is reported, so the run's last
    checkpoint is its last good one; the message is the line the user reads."""


def diverged_line(exc: BaseException) -> str | None:
    """The message of the :class:`Diverged` that ended a run, read through Ray's wrapping of
    a worker's error (whose last line is the worker's exception); None for other errors."""
    line = cause_line(exc)
    name = f"{Diverged.__module__}.{Diverged.__qualname__}: "
    return line.removeprefix(name) if line.startswith(name) else None


def _lines(exc: BaseException) -> list[str]:
    return [line.strip() for line in str(exc).splitlines() if line.strip()]


def first_line(exc: BaseException) -> str:
    """The first non-blank line of an error's message (its class name when it has none), at
    most :data:`MAX_LINE` characters: what a one-line error quotes of a library's exception."""
    lines = _lines(exc)
    return lines[0][:MAX_LINE] if lines else exc.__class__.__name__


def cause_line(exc: BaseException) -> str:
    """The line of an error message that names the cause. Ray wraps a worker's exception
    in its own text; the last line is the worker's."""
    lines = _lines(exc)
    return lines[-1][:MAX_LINE] if lines else exc.__class__.__name__
