"""What a person is shown of text and values from outside this process: a run's records, a
lease, a checkpoint, a cluster's logs and statuses, the words of a bad flag.

Two jobs, in one place, so that every command shows such values the same way:

* :func:`printable`: text as a terminal may show it. Every character a terminal obeys or
  hides rather than shows is written visibly: C0 controls and DEL in caret notation (ESC is
  ``^[``, BEL ``^G``, CR ``^M``), the C1 set, bidirectional overrides, line and paragraph
  separators, zero-width and other format characters, lone surrogates as escapes
  (``\\x9b``, ``\\u2028``).
* the kinds of stored values (:data:`TEXT`, :data:`COUNT`, :data:`ACCURACY`, :data:`SECONDS`,
  :data:`TIME`, :data:`WORKERS`, :data:`NUMBER`). A record is read like input: each kind
  checks a value's type and range (a count is an int, never a bool, a string, a float or a
  400-digit number; a real number is finite and in its range) and renders it: ``-`` when
  the value is absent (None), ``invalid`` when it fails its check. The readers of records
  use the same checks (:meth:`Kind.check`) to refuse a record that fails them.

Pure: the standard library only.
"""

from __future__ import annotations

import datetime
import math
import re
import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: What a stored value that fails its check is shown as.
INVALID = "invalid"
#: What an absent value (None) is shown as.
ABSENT = "-"
#: The largest count a record may hold (epochs, workers, images, trials): larger is not one.
MAX_COUNT = 10**9
#: The most characters of one stored string shown (a name, a data source): the rest is "…".
MAX_TEXT = 200
#: Unix times from 1970 to the end of 9999 (what a calendar date can show).
MAX_TIME = 253_402_214_400
#: The most seconds a duration may last (about 31 years).
MAX_SECONDS = 1e9
#: The largest magnitude of a plain real number shown (a loss).
MAX_REAL = 1e12

_NOT_PLAIN = re.compile(r"[^\x20-\x7e]+")  # runs of anything but printable ASCII


def _shown(char: str) -> str:
    code = ord(char)
    if code < 0x20 or code == 0x7F:  # C0 and DEL in caret notation: ESC is ^[, BEL ^G
        return "^" + chr(code ^ 0x40)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: Any, lines: bool = True) -> str:
    """``text`` as a terminal may show it: every character that is not printable (ESC and
    so CSI and OSC sequences, BEL, CR, DEL, the C1 set, bidi overrides, U+2028, zero-width
    characters) written visibly, ``\\x1b]0;title\\x07`` as ``^[]0;title^G``; line feeds and
    tabs stay unless ``lines`` is false (one row of a table: ``^J``, ``^I``). Character by
    character, so a sequence split across chunks is caught too."""
    kept = "\n\t" if lines else ""

    def escape(run: re.Match) -> str:
        return "".join(c if c.isprintable() or c in kept else _shown(c) for c in run.group())

    return _NOT_PLAIN.sub(escape, str(text))


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 2, 4, 4
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = 40


def excerpt(value: Any) -> str:
    """A short, printable picture of ``value`` for an error line (a 400-digit number or a
    long string is cut)."""
    return printable(_REPR.repr(value), lines=False)


# --------------------------------------------------------------------------- checks


def is_count(value: Any, low: int = 0, high: int = MAX_COUNT) -> bool:
    """An int (not a bool) from ``low`` to ``high``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_real(value: Any, low: float, high: float) -> bool:
    """A finite int or float (not a bool) from ``low`` to ``high``. An int is compared as it
    is, never made a float (a 400-digit one would not fit)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (isinstance(value, int) or math.isfinite(value)) and low <= value <= high


def _is_workers(value: Any) -> bool:
    if isinstance(value, list):  # an elastic range, [min, max]
        return len(value) == 2 and all(is_count(v, 1) for v in value) and value[0] <= value[1]
    return is_count(value, 1)


def _text(value: str) -> str:
    cut = value if len(value) <= MAX_TEXT else value[:MAX_TEXT] + "…"
    return printable(cut, lines=False)


def _time(value: float) -> str:
    return datetime.datetime.fromtimestamp(value).strftime("%Y-%m-%d %H:%M")


def _workers(value: Any) -> str:
    return f"{value[0]}-{value[1]}" if isinstance(value, list) else str(value)


@dataclass(frozen=True)
class Kind:
    """A kind of stored value: what it must be (``what``, for an error line), the check,
    and how a value that passes is shown."""

    what: str
    valid: Callable[[Any], bool]
    format: Callable[[Any], str]

    def __call__(self, value: Any) -> str:
        """``value`` as a person is shown it: ``-`` when None, ``invalid`` when it fails
        the check."""
        if value is None:
            return ABSENT
        return self.format(value) if self.valid(value) else INVALID

    def check(self, value: Any, where: str) -> Any:
        """``value`` when it is None or passes; else ValueError: ``WHERE VALUE is not
        WHAT``."""
        if value is None or self.valid(value):
            return value
        raise ValueError(f"{where} {excerpt(value)} is not {self.what}")


TEXT = Kind("a string", lambda v: isinstance(v, str), _text)
COUNT = Kind(f"a count (0 to {MAX_COUNT})", is_count, str)
ACCURACY = Kind("an accuracy (0 to 1)", lambda v: is_real(v, 0, 1), lambda v: f"{100 * v:.2f}%")
NUMBER = Kind("a finite number", lambda v: is_real(v, -MAX_REAL, MAX_REAL), lambda v: f"{v:.4f}")
SECONDS = Kind("a duration in seconds", lambda v: is_real(v, 0, MAX_SECONDS), lambda v: f"{v:.0f}")
TIME = Kind("a unix time", lambda v: is_real(v, 0, MAX_TIME), _time)
WORKERS = Kind("a worker count, or [min, max]", _is_workers, _workers)


def epochs(done: Any, planned: Any) -> str:
    """``done/planned`` epochs (``done`` alone when the plan is not known)."""
    return COUNT(done) if planned is None else f"{COUNT(done)}/{COUNT(planned)}"
