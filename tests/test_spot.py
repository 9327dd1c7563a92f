"""The spot watcher against a fake EC2 instance metadata service (IMDSv2) on loopback: a
token first, 404 while there is no notice, then the notice becomes one PREEMPTION drain."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from raytrain_mnist import spot
from tests.conftest import REPO

TOKEN = "t0ken"


class _Imds(BaseHTTPRequestHandler):
    """IMDSv2 as AWS answers it: PUT /latest/api/token with a TTL header gives a token;
    every GET needs it (401 without); spot/instance-action is 404 until a notice is set."""

    notice: dict | None = None
    life_cycle = "spot"
    tokens_asked = 0
    refused = 0

    def log_message(self, *args):  # quiet
        pass

    def do_PUT(self):
        if self.path != "/latest/api/token" or not self.headers.get(
            "X-aws-ec2-metadata-token-ttl-seconds"
        ):
            self.send_error(400)
            return
        type(self).tokens_asked += 1
        self._answer(200, TOKEN)

    def do_GET(self):
        if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
            type(self).refused += 1
            self._answer(401, "")
        elif self.path == "/latest/meta-data/instance-life-cycle":
            self._answer(200, self.life_cycle)
        elif self.path != "/latest/meta-data/spot/instance-action" or self.notice is None:
            self._answer(404, "Not Found")
        else:
            self._answer(200, json.dumps(self.notice))

    def _answer(self, code: int, body: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def imds():
    handler = type("Imds", (_Imds,), {"notice": None, "tokens_asked": 0, "refused": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _in(seconds: int) -> str:
    when = datetime.fromtimestamp(time.time() + seconds, tz=timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_no_notice_is_none_and_a_notice_is_its_seconds_left(imds):
    handler, url = imds
    metadata = spot.Metadata(url)
    assert spot.notice(metadata) is None  # 404
    handler.notice = {"action": "terminate", "time": _in(118)}
    found = spot.notice(metadata)
    assert found["action"] == "terminate" and 115 <= found["remaining_s"] <= 118
    assert handler.tokens_asked == 1 and handler.refused == 0  # one token, reused


def test_an_expired_token_is_asked_again(imds):
    handler, url = imds
    metadata = spot.Metadata(url)
    assert spot.notice(metadata) is None
    metadata._token = "stale"
    assert spot.notice(metadata) is None
    assert handler.refused == 1 and handler.tokens_asked == 2


def test_a_past_notice_drains_with_no_time_left(imds):
    handler, url = imds
    handler.notice = {"action": "stop", "time": _in(-30)}
    assert spot.notice(spot.Metadata(url))["remaining_s"] == 0


def test_the_watcher_drains_this_node_once_for_preemption(imds):
    """The command line as a node runs it (the drain printed, not run): it keeps looking
    while there is no notice and drains once, with the seconds left, when one comes."""
    handler, url = imds
    watcher = subprocess.Popen(
        [sys.executable, "-m", "raytrain_mnist.spot", "--metadata-url", url, "--interval",
         "0.2", "--node-id", "abc123", "--address", "10.0.0.1:6379", "--dry-run"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while handler.tokens_asked == 0 or handler.refused:  # it is looking
            assert watcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        handler.notice = {"action": "terminate", "time": _in(90)}
        out, err = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, err
    words = out.split()
    assert words[:2] == ["ray", "drain-node"] and "--node-id" in words
    assert words[words.index("--node-id") + 1] == "abc123"
    assert words[words.index("--reason") + 1] == "DRAIN_NODE_REASON_PREEMPTION"
    assert words[words.index("--address") + 1] == "10.0.0.1:6379"
    assert 85 <= int(words[words.index("--deadline-remaining-seconds") + 1]) <= 90
    assert "spot notice: terminate" in err


def test_an_on_demand_node_or_no_metadata_exits_at_once(imds):
    handler, url = imds
    handler.life_cycle = "on-demand"
    for where, said in ((url, "an on-demand instance"), ("http://127.0.0.1:9", "no EC2")):
        done = subprocess.run(
            [sys.executable, "-m", "raytrain_mnist.spot", "--metadata-url", where],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0 and said in done.stderr, done.stderr


def test_a_bad_interval_is_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "raytrain_mnist.spot", "--interval", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "--interval must be > 0" in done.stderr
    assert "Traceback" not in done.stderr
