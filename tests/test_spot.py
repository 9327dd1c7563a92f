"""The spot watcher against a fake EC2 instance metadata service (IMDSv2) on loopback: a
token first, 404 while there is no notice, then the notice becomes one PREEMPTION drain.
The fake answers anything a hostile or broken service could (bodies that are not a notice,
cut short, garbled status lines, 429s, answers dripped a byte at a time); the watcher logs
one line for each and keeps watching. A fake ``ray`` on PATH fails or hangs to check that
the drain is tried again, each try bounded, until the notice's deadline."""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import stat
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from raytrain_mnist import spot
from tests.conftest import REPO, wait_for

TOKEN = "t0ken"
NOTICE = "/latest/meta-data/spot/instance-action"
LIFE_CYCLE = "/latest/meta-data/instance-life-cycle"
TOKEN_PATH = "/latest/api/token"


def _http(code: int, body: bytes = b"", *headers: str) -> bytes:
    head = [f"HTTP/1.1 {code} X", f"Content-Length: {len(body)}", *headers, "Connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _notice(**fields) -> bytes:
    return _http(200, json.dumps(fields).encode())


def _drip(data: bytes):
    """An answer sent a byte every tenth of a second: each read call gets a byte in time."""

    def answer(out, stop: threading.Event) -> None:
        for byte in data:
            out.write(bytes([byte]))
            out.flush()
            if stop.wait(0.1):
                return

    return answer


def _silence(out, stop: threading.Event) -> None:
    stop.wait()  # the connection open, not a byte sent


_WHEN = "2026-12-01T17:02:00Z"

#: What a hostile or broken metadata service may answer to a look for the notice.
HOSTILE = {
    "a list": _http(200, b"[]"),
    "null": _http(200, b"null"),
    "a number": _http(200, b"1e400"),
    "a string": _http(200, b'"terminate"'),
    "a numeric time": _notice(action="terminate", time=1767200000),
    "a NaN time": _http(200, b'{"action": "terminate", "time": NaN}'),
    "no action": _notice(time=_WHEN),
    "an action that is a list": _notice(action=["terminate"], time=_WHEN),
    "an action with escapes": _notice(action="terminate\x1b]0;pwned\x07", time=_WHEN),
    "a day that is not one": _notice(action="terminate", time="2026-02-30T17:02:00Z"),
    "a time in another format": _notice(action="terminate", time="2026-12-01 17:02:00"),
    "a 5000-digit time": _http(200, b'{"action": "terminate", "time": ' + b"9" * 5000 + b"}"),
    "deep arrays": _http(200, b"[" * 6000 + b"]" * 6000),
    "deep objects": _http(200, b'{"a": ' * 2000 + b"1" + b"}" * 2000),
    "bad UTF-8": _http(200, b'{"action": "\xff\xfe", "time": "x"}'),
    "over the byte cap": _http(200, b" " * 100_000),
    "a header over the byte cap": _http(200, b"{}", "X-Pad: " + "a" * 70_000),
    "too many headers": _http(200, b"{}", *[f"X-{n}: y" for n in range(120)]),
    "cut short": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b'{"action": "term',
    "a huge declared length": b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999\r\n\r\n{}",
    "chunked, cut short": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffff\r\n{",
    "a bad chunk size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}",
    "a garbled status line": b"HTTP/1.1 2OO OK\r\nContent-Length: 2\r\n\r\n{}",
    "not HTTP": b"\x1b]0;pwned\x07\x1b[2J hello\r\n\r\n",
    "no answer at all": b"",
    "429": _http(429, b"Too Many Requests"),
    "503": _http(503),
    "a redirect": _http(301, b"", "Location: http://127.0.0.1:9/"),
    "a status line dripped": _drip(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"),
    "a body dripped": _drip(
        b"HTTP/1.1 200 OK\r\nContent-Length: 80\r\n\r\n"
        + json.dumps({"action": "terminate", "time": _WHEN}).encode().ljust(80)
    ),
    "silence": _silence,
}


class FakeImds:
    """IMDSv2 as AWS answers it (PUT /latest/api/token with a TTL header gives a token; every
    GET needs it, 401 without; spot/instance-action is 404 until ``notice`` is set), except
    that ``script[(method, path)]`` answers first, raw, one entry a request. ``served`` is
    set once every scripted answer went out."""

    def __init__(self) -> None:
        self.notice: dict | None = None
        self.life_cycle = "spot"
        self.token_status = 200
        self.script: dict[tuple[str, str], list] = {}
        self.tokens_asked = self.refused = self.notice_looks = 0
        self.served = threading.Event()
        self.stop = threading.Event()  # ends the dripped and silent answers at teardown
        self._lock = threading.Lock()

    def answer(self, method: str, path: str, headers) -> bytes:
        with self._lock:
            self.notice_looks += method == "GET" and path == NOTICE
            queued = self.script.get((method, path))
            if queued:
                found = queued.pop(0)
                if not any(self.script.values()):
                    self.served.set()
                return found
        if method == "PUT":
            if path != TOKEN_PATH or not headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return _http(400)
            self.tokens_asked += 1
            return _http(self.token_status, TOKEN.encode())
        if headers.get("X-aws-ec2-metadata-token") != TOKEN:
            self.refused += 1
            return _http(401)
        if path == LIFE_CYCLE:
            return _http(200, self.life_cycle.encode())
        if path == NOTICE and self.notice is not None:
            return _http(200, json.dumps(self.notice).encode())
        return _http(404, b"Not Found")


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_PUT(self):
        self._serve("PUT")

    def do_GET(self):
        self._serve("GET")

    def _serve(self, method: str) -> None:
        self.close_connection = True
        fake = self.server.fake
        found = fake.answer(method, self.path, self.headers)
        try:
            if callable(found):
                found(self.wfile, fake.stop)
            else:
                self.wfile.write(found)
        except OSError:  # the watcher gave up on this answer and closed
            pass


@pytest.fixture
def imds():
    fake = FakeImds()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.fake = fake
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    fake.stop.set()
    server.shutdown()
    server.server_close()


def _in(seconds: int) -> str:
    when = datetime.fromtimestamp(time.time() + seconds, tz=timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _watcher(url: str, *flags: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "raytrain_mnist.spot", "--metadata-url", url, *flags],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def _no_sleep(seconds: float) -> None:
    pass


# -- the answers --------------------------------------------------------------------------


def test_no_notice_is_none_and_a_notice_is_its_seconds_left(imds):
    fake, url = imds
    metadata = spot.Metadata(url)
    assert spot.notice(metadata) is None  # 404
    fake.notice = {"action": "terminate", "time": _in(118), "extra": [1, 2]}
    found = spot.notice(metadata)
    assert set(found) == {"action", "time", "remaining_s"}
    assert found["action"] == "terminate" and 115 <= found["remaining_s"] <= 118
    assert fake.tokens_asked == 1 and fake.refused == 0  # one token, reused


def test_an_expired_token_is_asked_again(imds):
    fake, url = imds
    metadata = spot.Metadata(url)
    assert spot.notice(metadata) is None
    metadata._token = "stale"
    assert spot.notice(metadata) is None
    assert fake.refused == 1 and fake.tokens_asked == 2


def test_a_past_notice_drains_with_no_time_left(imds):
    fake, url = imds
    fake.notice = {"action": "stop", "time": _in(-30)}
    assert spot.notice(spot.Metadata(url))["remaining_s"] == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_answer_is_one_logged_line_and_no_notice(imds, caplog, case):
    """Whatever the service answers, a look ends within its time budget with no notice and
    one printable line in the log: nothing raises out of the watcher."""
    fake, url = imds
    fake.notice = {"action": "terminate", "time": _in(100)}  # what comes after
    fake.script[("GET", NOTICE)] = [HOSTILE[case]]
    metadata = spot.Metadata(url, timeout_s=0.5)
    caplog.set_level(logging.WARNING, logger="raytrain_mnist.spot")
    started = time.monotonic()
    found = spot.watch(metadata, 0.01, once=True, act=lambda found: True)
    assert time.monotonic() - started < 2.5  # one bounded answer, dripped or not
    assert not isinstance(found, dict), found
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("spot watcher: skipped the spot notice")
    assert lines[0].isprintable(), lines[0]  # no ESC, BEL or line feed from the answer
    assert spot.notice(metadata)["action"] == "terminate"  # and the next look works


def test_the_watcher_outlives_every_hostile_answer_and_then_drains(imds):
    """The command line as a node runs it (the drain printed, not run) against a service
    that answers each hostile case in turn and then a notice: one line for each, then the
    drain, exit 0."""
    fake, url = imds
    fake.notice = {"action": "terminate", "time": _in(90)}
    fake.script[("GET", NOTICE)] = list(HOSTILE.values())
    watcher = _watcher(
        url, "--interval", "0.02", "--metadata-timeout", "0.5", "--node-id", "abc123",
        "--address", "10.0.0.1:6379", "--dry-run",
    )  # fmt: skip
    try:
        out, err = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, err
    assert fake.served.is_set()
    assert "Traceback" not in err and "\x1b" not in err and "\x07" not in err
    skipped = [line for line in err.splitlines() if "skipped the spot notice" in line]
    assert len(skipped) == len(HOSTILE), err
    words = out.split()
    assert words[:2] == ["ray", "drain-node"]
    assert words[words.index("--node-id") + 1] == "abc123"
    assert words[words.index("--reason") + 1] == "DRAIN_NODE_REASON_PREEMPTION"
    assert words[words.index("--address") + 1] == "10.0.0.1:6379"
    assert 60 <= int(words[words.index("--deadline-remaining-seconds") + 1]) <= 90
    assert "spot notice: terminate" in err


def test_the_watcher_drains_this_node_once_for_preemption(imds):
    """It keeps looking while there is no notice and drains once, with the seconds left,
    when one comes."""
    fake, url = imds
    watcher = _watcher(
        url, "--interval", "0.2", "--node-id", "abc123", "--address", "10.0.0.1:6379",
        "--dry-run",
    )  # fmt: skip
    try:
        wait_for(lambda: fake.notice_looks >= 2 or None, "the watcher looking", timeout=60)
        assert watcher.poll() is None
        fake.notice = {"action": "terminate", "time": _in(90)}
        out, err = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, err
    assert out.count("ray drain-node") == 1
    assert 85 <= int(out.split()[out.split().index("--deadline-remaining-seconds") + 1]) <= 90


# -- the start: spot, on-demand, or nothing here -------------------------------------------


def test_a_busy_or_garbled_service_at_start_is_not_taken_for_no_metadata(imds, caplog):
    """429s, 5xx, garbage and timeouts are a metadata service, busy or broken: tried again
    (more times than a definite "nothing here" needs) until it answers."""
    fake, url = imds
    fake.script[("PUT", TOKEN_PATH)] = [
        _http(429), _http(503), _http(429), _http(500), b"HTTP/1.1 2OO\r\n\r\n",
        _http(200, b"a token\x1b[2J"), _silence,
    ]  # fmt: skip
    fake.script[("GET", LIFE_CYCLE)] = [_http(200, b"\x1b[31mspot"), _http(429)]
    caplog.set_level(logging.WARNING, logger="raytrain_mnist.spot")
    assert spot.probe(spot.Metadata(url, timeout_s=0.5), sleep=_no_sleep) == "spot"
    assert fake.served.is_set()
    assert len(caplog.records) == 9


def test_one_429_at_start_then_a_notice_is_drained(imds):
    """The command line: a 429 for the first token no longer means "no EC2 metadata here"
    (it exited 0, watching nothing)."""
    fake, url = imds
    fake.script[("PUT", TOKEN_PATH)] = [_http(429)]
    fake.notice = {"action": "terminate", "time": _in(90)}
    done = subprocess.run(
        [sys.executable, "-m", "raytrain_mnist.spot", "--metadata-url", url, "--interval",
         "0.05", "--node-id", "abc123", "--dry-run"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("ray drain-node"), done.stderr
    assert "429" in done.stderr and "no EC2" not in done.stderr


def test_nothing_listening_or_no_token_service_is_no_metadata_after_retries(imds):
    fake, url = imds
    fake.token_status = 404  # something answers HTTP, but has no IMDSv2
    for where in (f"http://127.0.0.1:{_closed_port()}", url):
        sleeps = []
        assert spot.probe(spot.Metadata(where), sleep=sleeps.append) is None
        assert len(sleeps) == spot.ABSENT_AFTER - 1
    assert fake.tokens_asked == spot.ABSENT_AFTER


def test_an_on_demand_node_or_no_metadata_exits_at_once(imds):
    fake, url = imds
    fake.life_cycle = "on-demand"
    for where, said in ((url, "not a spot instance (on-demand)"), ("http://127.0.0.1:9", "no EC2")):
        done = subprocess.run(
            [sys.executable, "-m", "raytrain_mnist.spot", "--metadata-url", where,
             "--interval", "0.05"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0 and said in done.stderr, done.stderr


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--interval", "0"], "--interval must be > 0"),
        (["--interval", "nan"], "--interval must be > 0"),
        (["--drain-timeout", "inf"], "--drain-timeout must be > 0"),
        (["--interval", "1e300"], "--interval must be > 0 and at most 86400"),
        (["--metadata-timeout", "-1"], "--metadata-timeout must be > 0"),
        (["--metadata-url", "https://169.254.169.254"], "--metadata-url: not an http://"),
        (["--metadata-url", "http://127.0.0.1:99999"], "--metadata-url: Port out of range"),
    ],
)
def test_a_bad_flag_is_one_line(flags, said):
    done = subprocess.run(
        [sys.executable, "-m", "raytrain_mnist.spot", "--metadata-url", "http://127.0.0.1:9",
         *flags],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


# -- the drain: tried again, bounded, until the deadline ------------------------------------


@pytest.fixture
def fake_ray(tmp_path, monkeypatch):
    """A ``ray`` on PATH that records its words, fails its first ``fails`` calls (or every
    one) and, with ``hang``, never ends (a child of its own holding on too)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls, pids, settings = tmp_path / "calls", tmp_path / "pids", tmp_path / "settings"
    script = bin_dir / "ray"
    script.write_text(
        f"""#!/bin/sh
echo "$*" >> {calls}
. {settings}
n=$(wc -l < {calls})
if [ "$hang" = 1 ]; then sleep 300 & echo $! >> {pids}; wait; fi
if [ "$n" -le "$fails" ]; then echo "The drain request is not accepted: try $n" >&2; exit 1; fi
echo drained
"""
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def configure(fails: int = 0, hang: bool = False) -> None:
        settings.write_text(f"fails={fails}\nhang={int(hang)}\n")

    configure()
    configure.calls = lambda: calls.read_text().splitlines() if calls.exists() else []
    configure.pids = lambda: [int(p) for p in pids.read_text().split()] if pids.exists() else []
    configure.path = os.environ["PATH"]
    return configure


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_failing_drain_is_tried_again_until_ray_accepts_it(fake_ray, caplog):
    fake_ray(fails=2)
    caplog.set_level(logging.WARNING, logger="raytrain_mnist.spot")
    drain = spot.Drainer("10.0.0.1:6379", "abc123", timeout_s=10, backoff_s=0.01)
    assert drain({"action": "terminate", "time": _in(60), "remaining_s": 60})
    calls = fake_ray.calls()
    assert len(calls) == 3 and all("--node-id abc123" in call for call in calls)
    seconds = [int(call.split()[-1]) for call in calls]
    assert seconds == sorted(seconds, reverse=True) and 50 <= seconds[-1] <= 60
    failed = [r.getMessage() for r in caplog.records if "drain try" in r.getMessage()]
    assert len(failed) == 2 and "not accepted: try 2" in failed[1]


def test_a_drain_that_never_passes_gives_up_at_the_deadline(fake_ray):
    fake_ray(fails=10**6)
    drain = spot.Drainer("10.0.0.1:6379", "abc123", timeout_s=10, backoff_s=0.1)
    started = time.monotonic()
    assert not drain({"action": "terminate", "time": _in(1), "remaining_s": 1})
    assert time.monotonic() - started < 3
    assert len(fake_ray.calls()) >= 2


def test_a_hung_drain_is_killed_with_its_children_and_tried_again(fake_ray):
    fake_ray(fails=0, hang=True)
    drain = spot.Drainer("10.0.0.1:6379", "abc123", timeout_s=0.5, backoff_s=0.1)
    started = time.monotonic()
    assert not drain({"action": "terminate", "time": _in(2), "remaining_s": 2})
    assert time.monotonic() - started < 5  # the notice's two seconds and one last try
    assert len(fake_ray.calls()) >= 2
    pids = fake_ray.pids()
    assert pids and wait_for(
        lambda: True if not any(map(_alive, pids)) else None, "the hung children killed", 10, 0.05
    )


def test_a_node_id_lookup_that_cannot_reach_ray_is_bounded():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the node id lookup"):
        spot.this_node_id(f"127.0.0.1:{_closed_port()}", timeout_s=2)
    assert time.monotonic() - started < 10


def test_the_watcher_exits_0_only_after_ray_accepts_the_drain(imds, fake_ray):
    """The command line, draining for real through the fake ``ray``: one refusal, then the
    drain, exit 0."""
    fake, url = imds
    fake_ray(fails=1)
    fake.notice = {"action": "terminate", "time": _in(90)}
    done = subprocess.run(
        [sys.executable, "-m", "raytrain_mnist.spot", "--metadata-url", url, "--interval",
         "0.05", "--node-id", "abc123", "--address", "10.0.0.1:6379"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": fake_ray.path},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(fake_ray.calls()) == 2
    assert "drain try 1 failed" in done.stderr and "ray accepted the drain" in done.stderr


def test_a_watcher_whose_drain_never_passes_keeps_watching(imds, fake_ray):
    """Past the deadline with the node not drained it logs that, watches on and tries again
    while the notice stands: it never exits 0 with the node not drained."""
    fake, url = imds
    fake_ray(fails=10**6)
    fake.notice = {"action": "terminate", "time": _in(1)}
    watcher = _watcher(
        url, "--interval", "0.05", "--node-id", "abc123", "--address", "10.0.0.1:6379",
        env={**os.environ, "PATH": fake_ray.path},
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in watcher.stderr], daemon=True
    ).start()
    try:
        gave_up = 0
        while gave_up < 2:
            line = lines.get(timeout=30)
            assert "Traceback" not in line
            gave_up += "not drained" in line
        assert watcher.poll() is None
    finally:
        watcher.kill()
        watcher.wait()
    assert len(fake_ray.calls()) >= 2
