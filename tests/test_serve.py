"""`serve`: request parsing (`serving.images`), the CLI's refusals and config file (no Ray);
then the shared fit's run served in the tests' Ray by `driver.deployment.serving` for the
HTTP tests (the accuracy through POST /predict,
bad requests, the page in a headless Chromium); and one real `python -m raytrain_mnist
serve` from start to Ctrl-C.

Tests run in any order (pytest-randomly): none depends on another having run.
"""

from __future__ import annotations

import asyncio
import base64
import http.client as http_client
import importlib
import io
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
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
from tests.conftest import MARKER_VAR, REPO, free_ports, kill_marked, marked, run_cli_here

CHROMIUM = "/usr/bin/chromium"


# --------------------------------------------------------------------------- helpers


def http(
    url: str, body: bytes | dict | None = None, method: str | None = None, timeout: float = 60
) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one request; 4xx/5xx are answers, not exceptions."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def predict(url: str, images) -> dict:
    status, _, body = http(url + "predict", {"images": images})
    assert status == 200, body
    return json.loads(body)


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
    from raytrain_mnist.model import ConvNet
    from raytrain_mnist.worker import checkpoint as ckpt

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
    ],
)
def test_cli_refuses_bad_flags_before_ray(checkpoint_dir, flags, words):
    import ray

    result = run_cli_here("serve", str(checkpoint_dir), *flags)
    assert result.returncode == 2, result
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not ray.is_initialized()


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


def test_write_config_is_a_valid_serve_deploy_config(checkpoint_dir, tmp_path):
    """The file validates against Ray's own schema, and its import path builds the app
    from its args (as `serve deploy` would, on the cluster); so does the import path that
    configs written before the serving split name."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

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
    (app,) = config.applications
    assert app.import_path == "raytrain_mnist.driver.deployment:build_app"
    for import_path in (app.import_path, "raytrain_mnist.serve:build_app"):
        module, _, attr = import_path.partition(":")
        built = getattr(importlib.import_module(module), attr)(app.args)
        deployment = built._bound_deployment
        assert deployment.num_replicas == 2, import_path
        assert deployment.ray_actor_options["num_cpus"] == 1, import_path
        assert deployment.max_ongoing_requests == 32, import_path
    assert app.args["checkpoint"] == str(checkpoint_dir.resolve())


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


@pytest.fixture(scope="module")
def server(fitted):
    """The shared fit's best checkpoint served in the tests' own Ray (`serving`, as the
    command runs it, minus the Ray start): one Serve application for the HTTP tests."""
    from raytrain_mnist.driver.deployment import serving
    from raytrain_mnist.serving.settings import ServeConfig

    run_dir = Path(fitted["summary"]["run_dir"])
    cfg = ServeConfig(port=free_ports(1)[0])
    with serving(cfg, best_checkpoint(run_dir)) as url:
        yield {"url": url, "run_dir": run_dir}


def test_predictions_give_evaluates_accuracy(server, fitted, tiny_mnist, tmp_path):
    """The test set through POST /predict scores exactly what `evaluate` reports; the same
    images one per request from 8 clients at once (batched together) get the same answers."""
    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.driver.evaluation import evaluate_checkpoint

    # out= keeps the report out of the run directory (serve must never write there).
    report = evaluate_checkpoint(server["run_dir"], out=tmp_path / "evaluation").to_dict()
    data = load_mnist(tiny_mnist, "mnist")
    images, labels = data.test_images.numpy(), data.test_labels.numpy()
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
    url = server["url"]
    good = {"images": [[[0] * 28] * 28]}
    cases = {
        "not JSON": (url + "predict", b"{oops", "POST", 400),
        "wrong shape": (url + "predict", {"images": [[[0] * 28] * 14]}, "POST", 422),
        "values outside 0-255": (url + "predict", {"images": [[[300] * 28] * 28]}, "POST", 422),
        "floats": (url + "predict", {"images": [[[0.5] * 28] * 28]}, "POST", 422),
        "too many images": (url + "predict", {"images": [[[0] * 28] * 28] * 1025}, "POST", 413),
        "not a PNG": (url + "predict", {"images": ["aGVsbG8="]}, "POST", 422),
        "unknown path": (url + "admin", None, "GET", 404),
        "wrong method": (url + "predict", None, "GET", 405),
    }
    for name, (target, body, method, expected) in cases.items():
        status, headers, answer = http(target, body, method)
        assert status == expected, (name, answer)
        error = json.loads(answer)["error"]
        assert error and "\n" not in error, name
        status, _, answer = http(url + "predict", good)
        assert status == 200 and len(json.loads(answer)["predictions"]) == 1, name

    # A body over the limit is refused on its declared length, before any of it is read.
    connection = http_client.HTTPConnection(
        "127.0.0.1", int(url.split(":")[-1].strip("/")), timeout=60
    )
    connection.putrequest("POST", "/predict")
    connection.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413 and "over" in json.loads(response.read())["error"]
    connection.close()
    status, _, answer = http(url + "predict", good)
    assert status == 200


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


def test_health_and_page(server):
    status, _, body = http(server["url"] + "health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok"
    assert health["checkpoint"] == best_checkpoint(server["run_dir"])
    status, headers, page = http(server["url"])
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in headers["content-security-policy"]
    text = page.decode()
    assert 'aria-live="polite"' in text and "<button" in text and "http" not in text
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
    images, labels = data.test_images.numpy(), data.test_labels.numpy()
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


def test_cli_serves_until_ctrl_c_and_leaves_nothing(fitted, tmp_path):
    """`python -m raytrain_mnist serve RUN_DIR` as a user runs it: its own local Ray, the
    URL line, answers, then Ctrl-C ends it with status 0, no process it started outlives
    it, and nothing in the run directory was written."""
    run_dir = Path(fitted["summary"]["run_dir"])
    port, marker = free_ports(1)[0], f"serve-{os.getpid()}"
    url = f"http://127.0.0.1:{port}/"
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    before = _snapshot(run_dir)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "raytrain_mnist", "serve", str(run_dir), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**env, MARKER_VAR: marker},
        )
    try:
        deadline = time.monotonic() + 180
        while "serving " not in log.read_text():  # printed once the application is running
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert f"at {url} " in log.read_text()
        status, _, body = http(url + "health")
        assert status == 200 and json.loads(body)["status"] == "ok"
        assert http(url + "predict", b"[")[0] == 400
        assert len(predict(url, [[[0] * 28] * 28])["predictions"]) == 1

        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0, log.read_text()
        output = log.read_text()
        assert output.rstrip().endswith("stopped") and "Traceback" not in output, output
        deadline = time.monotonic() + 30
        while marked(marker) and time.monotonic() < deadline:
            time.sleep(0.2)  # the raylet's children exit right after it
        assert not marked(marker), "processes outlived serve"
        assert _snapshot(run_dir) == before
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_marked(marker)
