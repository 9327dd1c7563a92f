"""The node-side spot watcher: an EC2 spot interruption notice becomes a Ray drain.

    python -m raytrain_mnist.spot --address HEAD:6379 [--interval 5] [--node-id ID]
        [--metadata-url http://169.254.169.254] [--metadata-timeout 2] [--drain-timeout 20]
        [--once] [--dry-run]

AWS announces a spot reclaim about two minutes ahead in the instance metadata (IMDSv2):
``GET /latest/meta-data/spot/instance-action`` answers 404 until then, and then
``{"action": "terminate", "time": "2026-12-01T17:02:00Z"}``. Every request needs a session
token, asked first with ``PUT /latest/api/token``. On a notice the watcher runs::

    ray drain-node --address HEAD:6379 --node-id ID --reason DRAIN_NODE_REASON_PREEMPTION
        --reason-message "spot instance-action terminate at ..." --deadline-remaining-seconds N

Ray Train then tells the training run (``ray.train.get_preemption_info()``): it checkpoints
just in time and resumes elsewhere from that step (``worker/preempt.py``). The cluster's
worker start commands (``cluster.yaml``) start this on every spot node under ``nohup``, with
nothing to restart it, so it outlives any answer: every metadata answer is bounded in bytes
and in wall-clock time and validated, a look that fails is one logged line and the next look
comes later (backing off), and a drain that fails or hangs is killed and tried again until
the notice's deadline. It logs to stderr and exits 0 after a drain that Ray accepted, at once
on an on-demand instance or where nothing answers as IMDS, or with ``--once`` after one look
(1 if that look or its drain failed).
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from types import SimpleNamespace

from raytrain_mnist.errors import MAX_LINE, first_line

logger = logging.getLogger("raytrain_mnist.spot")

METADATA_URL = "http://169.254.169.254"
TOKEN_TTL_S = 21600  # IMDSv2's longest
#: Seconds one whole metadata answer may take: connect, status, headers and body together.
METADATA_TIMEOUT_S = 2.0
#: The most bytes of one metadata answer, headers included: IMDS sends a few hundred.
MAX_ANSWER_BYTES = 16 * 1024
#: Seconds one ``ray drain-node`` (or node-id lookup) may run before it is killed and tried
#: again: it takes a few when Ray answers, and a notice gives about 120.
DRAIN_TIMEOUT_S = 20.0
#: The first wait between drain attempts; it doubles up to four times this.
DRAIN_BACKOFF_S = 1.0
#: Consecutive definite "nothing here" answers (refused, unreachable, no token service) after
#: which the host is taken to have no instance metadata. A busy or garbled IMDS never counts.
ABSENT_AFTER = 3
#: An attempt started at or after the deadline still gets this long: a notice already due may
#: still be drained before the instance goes.
_MIN_ATTEMPT_S = 5.0
#: The longest any of the watcher's intervals and timeouts may be set to (a day).
_MAX_SECONDS = 86400

# AWS writes the time as ISO 8601 UTC to the second; strptime alone also takes "2026-1-1T1:2:3Z".
_NOTICE_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")
_ACTION = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")  # terminate, stop, hibernate
_LIFE_CYCLE = re.compile(r"[a-z][a-z0-9-]{0,63}")  # spot, on-demand, scheduled, ...
_TOKEN = re.compile(r"[\x21-\x7e]{1,1024}")  # sent back as a header value
_NODE_ID = re.compile(r"[0-9a-f]{8,128}")


class Absent(Exception):
    """A definite answer that no instance metadata service is here: the connection refused or
    unreachable, or a token service that does not exist (403, 404, 405)."""


class _Budget(io.RawIOBase):
    """A socket's bytes within a wall-clock deadline and a byte cap. A socket timeout bounds
    each read call alone, so an answer that drips a byte at a time would never end."""

    def __init__(self, sock, deadline: float, timeout_s: float, limit: int) -> None:
        super().__init__()
        self._sock, self._deadline, self._timeout_s, self._limit = sock, deadline, timeout_s, limit
        self._read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no whole answer within {self._timeout_s:g} s")
        self._sock.settimeout(left)
        try:
            size = self._sock.recv_into(buffer, min(len(buffer), self._limit + 1 - self._read))
        except TimeoutError:
            raise TimeoutError(f"no whole answer within {self._timeout_s:g} s") from None
        self._read += size
        if self._read > self._limit:
            raise ValueError(f"an answer over {self._limit} bytes")
        return size


class Metadata:
    """IMDSv2 at ``url``: a session token first (renewed when refused), then the reads. Every
    answer is read whole within ``timeout_s`` and ``MAX_ANSWER_BYTES``, or raises."""

    def __init__(self, url: str = METADATA_URL, timeout_s: float = METADATA_TIMEOUT_S) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.path.strip("/"):
            raise ValueError(f"not an http://HOST[:PORT] address: {url!r}")
        self.url = url.rstrip("/")
        self._host, self._port = parts.hostname, parts.port or 80  # .port raises if not one
        self.timeout_s = timeout_s
        self._token: str | None = None
        self._token_at = 0.0

    def _exchange(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        """The status and body of one request; raises :class:`Absent` when nothing listens."""
        deadline = time.monotonic() + self.timeout_s
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)
        try:
            try:
                connection.connect()
            except OSError as exc:  # refused, unreachable, no route: nothing listens there
                raise Absent(f"{self._host}:{self._port}: {first_line(exc)}") from exc
            connection.request(method, path, headers=headers)
            budget = _Budget(connection.sock, deadline, self.timeout_s, MAX_ANSWER_BYTES)
            reader = io.BufferedReader(budget)
            answer = http.client.HTTPResponse(SimpleNamespace(makefile=lambda mode: reader))
            answer.begin()
            # At most one byte over the cap: http.client reads a declared length (or a chunk's)
            # in one allocation, and a hostile length would be a hostile allocation.
            body = answer.read(MAX_ANSWER_BYTES + 1)
            if len(body) > MAX_ANSWER_BYTES:
                raise ValueError(f"a body over {MAX_ANSWER_BYTES} bytes")
            if answer.length:  # Content-Length promised more than came before the close
                raise http.client.IncompleteRead(body, answer.length)
            return answer.status, body
        finally:
            connection.close()

    def _new_token(self) -> str:
        status, body = self._exchange(
            "PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)}
        )
        if status in (403, 404, 405):  # something answers, but no IMDSv2 token service
            raise Absent(f"the token service answered {status}")
        if status != 200:
            raise http.client.HTTPException(f"the token service answered {status}")
        token = body.decode("ascii").strip()
        if not _TOKEN.fullmatch(token):
            raise ValueError(f"a token that is not one: {_quoted(token)}")
        return token

    def get(self, path: str) -> str | None:
        """The text at ``/latest/meta-data/<path>``; None for a 404 (nothing there)."""
        for attempt in range(2):
            if self._token is None or time.monotonic() - self._token_at > TOKEN_TTL_S / 2:
                self._token, self._token_at = self._new_token(), time.monotonic()
            status, body = self._exchange(
                "GET", f"/latest/meta-data/{path}", {"X-aws-ec2-metadata-token": self._token}
            )
            if status == 200:
                return body.decode("utf-8")
            if status == 404:
                return None
            if status == 401 and attempt == 0:  # the token expired: ask again
                self._token = None
                continue
            raise http.client.HTTPException(f"{path} answered {status}")
        raise http.client.HTTPException(f"{path} answered 401 to a fresh token")


def parse_notice(text: str, now: float | None = None) -> dict:
    """The notice in ``text`` (``action``, ``time`` and ``remaining_s``, whole seconds left,
    never negative); ValueError unless it is an object with a word ``action`` and an ISO
    8601 UTC ``time``. Deep nesting is refused by the byte cap and json's RecursionError."""
    found = json.loads(text)
    if not isinstance(found, dict):
        raise ValueError(f"a notice that is not a JSON object: {_quoted(found)}")
    action, when = found.get("action"), found.get("time")
    if not isinstance(action, str) or not _ACTION.fullmatch(action):
        raise ValueError(f"a notice whose action is not a word: {_quoted(action)}")
    if not isinstance(when, str) or not _NOTICE_TIME.fullmatch(when):
        raise ValueError(f"a notice whose time is not YYYY-MM-DDTHH:MM:SSZ: {_quoted(when)}")
    at = datetime.strptime(when, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    now = time.time() if now is None else now
    return {"action": action, "time": when, "remaining_s": max(int(at.timestamp() - now), 0)}


def notice(metadata: Metadata, now: float | None = None) -> dict | None:
    """The spot interruption notice (:func:`parse_notice`), or None while there is none."""
    text = metadata.get("spot/instance-action")
    return None if text is None else parse_notice(text, now)


def life_cycle(metadata: Metadata) -> str | None:
    """This instance's ``instance-life-cycle`` (``spot``, ``on-demand``, ...); None when the
    metadata has none."""
    text = metadata.get("instance-life-cycle")
    if text is None:
        return None
    if not _LIFE_CYCLE.fullmatch(text.strip()):
        raise ValueError(f"an instance-life-cycle that is not a word: {_quoted(text)}")
    return text.strip()


@dataclass
class Skipped:
    """A look that failed: the reason was logged; ``absent`` when it was a definite answer
    that there is no instance metadata here."""

    absent: bool = False


def attempt(what: str, read: Callable[[], object]) -> object:
    """``read()``, or :class:`Skipped` after one logged line. The one place a metadata
    answer's failure is caught: the watcher outlives any answer (http.client's errors,
    socket errors, timeouts, bad UTF-8, JSON and its recursion, the checks above), and
    what it could not use is one line in its log."""
    try:
        return read()
    except Exception as exc:  # a daemon nothing restarts: no answer may end it
        logger.warning("spot watcher: skipped %s: %s", what, describe(exc))
        return Skipped(absent=isinstance(exc, Absent))


def describe(exc: BaseException) -> str:
    """An exception as one log line, every character one a terminal shows (an answer's bytes
    may be quoted in it)."""
    return _loggable(f"{type(exc).__name__}: {first_line(exc)}")


def _loggable(text: str) -> str:
    # The command layer's printable() lives in _cli, a sibling layer this module may not import.
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _quoted(value: object) -> str:
    return _loggable(repr(value)[:80])


def backoff(first_s: float, failures: int) -> float:
    """The wait after ``failures`` consecutive failures: ``first_s``, doubling, at most four
    times ``first_s`` (a notice gives two minutes: a long wait could miss it)."""
    return first_s * 2 ** min(max(failures - 1, 0), 2)


def probe(metadata: Metadata, retry_s: float = 1.0, sleep=time.sleep) -> str | None:
    """This instance's life cycle, or None where nothing answers as IMDS: only after
    :data:`ABSENT_AFTER` definite answers in a row. A 429, a 5xx, a timeout or a garbled
    answer is something there, busy or broken: it is tried again, without end, backing off."""
    absent = failures = 0
    while True:
        found = attempt("the instance life cycle", lambda: life_cycle(metadata))
        if not isinstance(found, Skipped):
            return found or "unknown"  # answered, with no life cycle: not a spot instance
        failures += 1
        absent = absent + 1 if found.absent else 0
        if absent >= ABSENT_AFTER:
            return None
        sleep(backoff(retry_s, failures))


def run_bounded(what: str, words: list[str], timeout_s: float) -> str:
    """The output of ``words`` (``what`` in the log) run to a zero exit within ``timeout_s``;
    RuntimeError (one line) otherwise. It runs in a process group of its own, killed whole at
    the timeout: ``ray`` starts children of its own."""
    with subprocess.Popen(
        words,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
    ) as child:
        try:
            out, _ = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise RuntimeError(f"{what}: no answer within {timeout_s:g} s, killed") from None
    if child.returncode:
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        said = lines[-1][:MAX_LINE] if lines else "no output"
        raise RuntimeError(f"{what} exited {child.returncode}: {said}")
    return out


# In a child with a timeout: ray.init to an address that does not answer can take minutes.
_NODE_ID_CODE = (
    "import sys, ray\n"
    "ray.init(address=sys.argv[1], logging_level='WARNING', log_to_driver=False)\n"
    "print(ray.get_runtime_context().get_node_id())\n"
)


def this_node_id(address: str, timeout_s: float = DRAIN_TIMEOUT_S) -> str:
    """The id of the Ray node on this machine (a short-lived connection to it, in a child)."""
    out = run_bounded(
        "the node id lookup", [sys.executable, "-c", _NODE_ID_CODE, address], timeout_s
    )
    lines = out.split()
    if not lines or not _NODE_ID.fullmatch(lines[-1]):
        raise RuntimeError(f"no Ray node id in {_quoted(out[-200:])}")
    return lines[-1]


def drain_command(address: str, node_id: str, found: dict) -> list[str]:
    """The ``ray drain-node`` words for notice ``found`` on node ``node_id``."""
    return [
        "ray",
        "drain-node",
        "--address",
        address,
        "--node-id",
        node_id,
        "--reason",
        "DRAIN_NODE_REASON_PREEMPTION",
        "--reason-message",
        f"spot instance-action {found.get('action')} at {found.get('time')}",
        "--deadline-remaining-seconds",
        str(found["remaining_s"]),
    ]


class Drainer:
    """Drains this node for a notice: ``ray drain-node``, each try killed after ``timeout_s``
    and tried again (backing off from ``backoff_s``) until the notice's deadline."""

    def __init__(
        self,
        address: str,
        node_id: str | None = None,
        timeout_s: float = DRAIN_TIMEOUT_S,
        backoff_s: float = DRAIN_BACKOFF_S,
        dry_run: bool = False,
        sleep=time.sleep,
    ) -> None:
        self.address, self.node_id, self.dry_run = address, node_id, dry_run
        self.timeout_s, self.backoff_s, self._sleep = timeout_s, backoff_s, sleep

    def find_node(self, timeout_s: float | None = None) -> str:
        """This node's Ray id, asked of Ray once (``--node-id`` spares it)."""
        if self.node_id is None:
            self.node_id = this_node_id(self.address, timeout_s or self.timeout_s)
        return self.node_id

    def __call__(self, found: dict) -> bool:
        """Whether Ray accepted the drain for ``found`` before its deadline (one try at least)."""
        deadline = time.monotonic() + found["remaining_s"]
        failures = 0
        while True:
            left = deadline - time.monotonic()
            try:
                self._once({**found, "remaining_s": max(int(left), 0)}, left)
                return True
            except Exception as exc:  # ray missing, failing or hung: the next try may pass
                failures += 1
                logger.error("spot watcher: drain try %d failed: %s", failures, describe(exc))
            wait = backoff(self.backoff_s, failures)
            if time.monotonic() + wait >= deadline:
                logger.error(
                    "spot watcher: the notice's deadline came with node %s not drained after "
                    "%d tries; watching on",
                    self.node_id or "(unknown)",
                    failures,
                )
                return False
            self._sleep(wait)

    def _once(self, found: dict, left_s: float) -> None:
        timeout_s = min(self.timeout_s, max(left_s, _MIN_ATTEMPT_S))
        node_id = self.find_node(timeout_s)
        words = drain_command(self.address, node_id, found)
        logger.warning(
            "spot notice: %s at %s (%d s left); draining node %s",
            found["action"],
            found["time"],
            found["remaining_s"],
            node_id,
        )
        if self.dry_run:
            print(" ".join(words), flush=True)
            return
        run_bounded("ray drain-node", words, timeout_s)
        logger.warning("spot watcher: ray accepted the drain of node %s", node_id)


def watch(metadata: Metadata, interval_s: float, once: bool, act, sleep=time.sleep) -> dict | None:
    """Poll until a notice that ``act(notice)`` drains (True), and return it; with ``once``,
    look once and return the notice (None without one; :class:`Skipped` when the look or
    its drain failed). A failed look or drain waits longer before the next (backing off)."""
    failures = 0
    while True:
        found = attempt("the spot notice", lambda: notice(metadata))
        if isinstance(found, dict):
            if act(found):
                return found
            found = Skipped()
        failures = failures + 1 if isinstance(found, Skipped) else 0
        if once:
            return found
        sleep(backoff(interval_s, failures))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raytrain_mnist.spot", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--address", default="auto", help="the Ray head (HOST:PORT)")
    parser.add_argument("--node-id", help="this node's Ray id (default: asked of Ray)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between looks")
    parser.add_argument("--metadata-url", default=METADATA_URL, help="the instance metadata")
    parser.add_argument(
        "--metadata-timeout",
        type=float,
        default=METADATA_TIMEOUT_S,
        help="seconds one whole metadata answer may take",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DRAIN_TIMEOUT_S,
        help="seconds one `ray drain-node` may run before it is killed and tried again",
    )
    parser.add_argument("--once", action="store_true", help="look once, then exit")
    parser.add_argument("--dry-run", action="store_true", help="print the drain, do not run it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for flag in ("interval", "metadata_timeout", "drain_timeout"):
        value = getattr(args, flag)
        # time.sleep and socket timeouts raise on NaN and on what overflows a time_t.
        if not (math.isfinite(value) and 0 < value <= _MAX_SECONDS):
            parser.error(
                f"--{flag.replace('_', '-')} must be > 0 and at most {_MAX_SECONDS}, got {value:g}"
            )
    try:
        metadata = Metadata(args.metadata_url, args.metadata_timeout)
    except ValueError as exc:
        parser.error(f"--metadata-url: {first_line(exc)}")
    drainer = Drainer(args.address, args.node_id, args.drain_timeout, dry_run=args.dry_run)

    cycle = probe(metadata, retry_s=min(args.interval, 1.0))
    if cycle != "spot":
        where = (
            "no EC2 instance metadata here" if cycle is None else f"not a spot instance ({cycle})"
        )
        logger.info("spot watcher: %s, nothing to watch", where)
        return 0
    # Now rather than in the two minutes of a notice.
    attempt("asking Ray for this node's id", drainer.find_node)
    found = watch(metadata, args.interval, args.once, drainer)
    return 1 if isinstance(found, Skipped) else 0


if __name__ == "__main__":
    sys.exit(main())
