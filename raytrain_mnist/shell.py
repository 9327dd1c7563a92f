"""Commands as a shell reads them: what a resume line or a job's entry point prints."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Sequence


def command_line(words: Sequence[str]) -> str:
    """``words`` as one shell command line."""
    return " ".join(shlex.quote(w) for w in words)


def python_command() -> str:
    """The first word of a command that runs this interpreter again: ``python`` when that is
    the one on ``PATH``, else its full path."""
    found = shutil.which("python")
    same = bool(found) and os.path.realpath(found) == os.path.realpath(sys.executable)
    return "python" if same else sys.executable
