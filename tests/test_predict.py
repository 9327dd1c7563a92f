"""``raytrain-mnist predict``: image files classified in this process, prepared exactly as
``serve`` prepares its PNGs (the same files give the same labels and probabilities through
both), IDX files read as they are, bad files one line each while the rest are classified.
Uses the session's one fitted run (conftest ``fitted``)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, run_cli_here


def _test_digits(data_dir):
    from raytrain_mnist.data import load_mnist

    data = load_mnist(str(data_dir), "mnist")
    return data.test_images.numpy(), data.test_labels.numpy()


def _variants(digit: np.ndarray) -> dict[str, tuple[bytes, str]]:
    """One test digit as users photograph or draw it: name -> (file bytes, PIL format)."""
    from PIL import Image

    ink = Image.fromarray(digit)
    big = ink.resize((280, 280), Image.Resampling.BILINEAR)
    paper = Image.fromarray(255 - np.asarray(big))  # dark ink on light paper
    colour = Image.merge("RGB", (paper, paper.point(lambda v: v * 0.9), paper))
    shapes = {
        "gray28.png": (ink, "PNG"),
        "paper280.png": (paper, "PNG"),
        "colour_paper.png": (colour, "PNG"),
        "colour_paper.jpg": (colour, "JPEG"),
        "wide_gray.png": (Image.fromarray(np.pad(np.asarray(big), ((0, 0), (200, 40)))), "PNG"),
    }
    out = {}
    for name, (image, fmt) in shapes.items():
        buffer = io.BytesIO()
        image.save(buffer, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
        out[name] = (buffer.getvalue(), fmt)
    return out


@pytest.fixture(scope="module")
def image_files(tiny_mnist, tmp_path_factory):
    """PNG and JPEG files written from the first 12 test digits, in every variant."""
    images, labels = _test_digits(tiny_mnist)
    root = tmp_path_factory.mktemp("digits")
    written = []
    for i in range(12):
        for name, (raw, _) in _variants(images[i]).items():
            path = root / f"{i:02d}_{labels[i]}_{name}"
            path.write_bytes(raw)
            written.append((path, int(labels[i])))
    return root, written


def _predict_json(*args):
    result = run_cli_here("predict", *args, "--json")
    return result, (json.loads(result.stdout) if result.stdout.strip() else None)


def test_png_and_jpeg_files_of_any_shape_are_classified(fitted, image_files):
    root, written = image_files
    result, record = _predict_json(fitted["summary"]["run_dir"], str(root), "--top-k", "2")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    by_file = {p["source"]: p for p in record["predictions"]}
    assert len(by_file) == len(written) and record["errors"] == []
    for p in by_file.values():
        assert len(p["probabilities"]) == 10 and abs(sum(p["probabilities"]) - 1) < 1e-4
        assert [t["label"] for t in p["top_k"]][0] == p["label"] and len(p["top_k"]) == 2
    right = sum(by_file[str(path)]["label"] == label for path, label in written)
    assert right >= 0.8 * len(written), f"{right}/{len(written)} right"
    # Each digit reads the same whatever its size, colour, paper or format.
    for i in range(12):
        labels = {by_file[str(p)]["label"] for p, _ in written if p.name.startswith(f"{i:02d}_")}
        assert len(labels) == 1, (i, labels)


def test_the_text_output_is_a_line_per_image(fitted, image_files):
    root, written = image_files
    result = run_cli_here("predict", fitted["summary"]["run_dir"], str(written[0][0]))
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith(f"{written[0][0]}: ") and "%" in line


def _asgi_post(app, body: bytes) -> tuple[int, dict]:
    """One ``POST /predict`` through the ASGI app, as a loopback client sends it."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/predict",
        "raw_path": b"/predict",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(payload)


def test_predict_and_serve_give_the_same_labels_and_probabilities(fitted, image_files):
    """serve's application, run in this process as its replicas run it (no Ray: one image
    per forward pass, the replica's own request handling through ``serving.app.asgi``)."""
    from raytrain_mnist.driver.evaluation import load_checkpoint
    from raytrain_mnist.driver.targets import resolve_target
    from raytrain_mnist.serving.app import Access, DigitClassifier, asgi

    _, written = image_files
    pngs = [p for p, _ in written if p.suffix == ".png"]
    state, model = load_checkpoint(resolve_target(fitted["summary"]["run_dir"]).checkpoint)
    amp = (state.get("config") or {}).get("amp", "off")
    app = asgi(DigitClassifier(model.state_dict(), amp, {}, 1, False, Access()))
    body = json.dumps({"images": [base64.b64encode(p.read_bytes()).decode() for p in pngs]})
    status, served = _asgi_post(app, body.encode())
    assert status == 200, served

    result, record = _predict_json(fitted["summary"]["run_dir"], *map(str, pngs))
    assert result.returncode == 0, result.stderr
    assert [p["source"] for p in record["predictions"]] == list(map(str, pngs))
    assert [p["label"] for p in record["predictions"]] == served["predictions"]
    got = np.array([p["probabilities"] for p in record["predictions"]])
    # Both are rounded to 6 decimals; a batch of one and a batch of many may round the last
    # one apart.
    assert np.abs(got - np.array(served["probabilities"])).max() <= 1.5e-6


def test_idx_files_are_read_as_they_are(fitted, tiny_mnist):
    """MNIST's own test file: the labels are the checkpoint model's on those pixels, and the
    accuracy is the one the run reported."""
    raw = f"{tiny_mnist}/MNIST/raw/"
    result, record = _predict_json(fitted["summary"]["run_dir"], raw + "t10k-images-idx3-ubyte")
    assert result.returncode == 0, result.stderr
    images, labels = _test_digits(tiny_mnist)
    predicted = np.array([p["label"] for p in record["predictions"]])
    assert len(predicted) == len(labels)
    assert record["predictions"][3]["source"].endswith("t10k-images-idx3-ubyte[3]")
    accuracy = float((predicted == labels).mean())
    assert accuracy == pytest.approx(fitted["summary"]["best_val_accuracy"], abs=1 / len(labels))


def test_bad_files_are_one_line_each_and_the_rest_are_classified(
    fitted, image_files, tiny_mnist, tmp_path
):
    _, written = image_files
    good = written[0][0]
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "cut.png").write_bytes(good.read_bytes()[:60])
    labels_idx = f"{tiny_mnist}/MNIST/raw/t10k-labels-idx1-ubyte"
    bad = [str(tmp_path / "notes.txt"), str(tmp_path / "cut.png"), labels_idx]
    result, record = _predict_json(fitted["summary"]["run_dir"], str(good), *bad)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("raytrain-mnist:")]
    assert len(errors) == 3, result.stderr
    assert [e["source"] for e in record["errors"]] == bad
    assert "labels, not of images" in record["errors"][2]["error"]
    assert [p["source"] for p in record["predictions"]] == [str(good)]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["nowhere", "x.png"], "does not exist"),
        (["RUN", "/nonexistent.png"], "/nonexistent.png does not exist"),
        (["RUN", "x.png", "--top-k", "11"], "--top-k must be from 1 to 10"),
        (["RUN", "x.png", "--top"], "unrecognized arguments: --top; did you mean --top-k?"),
    ],
)
def test_bad_arguments_are_one_line(fitted, args, fragment):
    args = [fitted["summary"]["run_dir"] if a == "RUN" else a for a in args]
    result = run_cli_here("predict", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr


def test_predict_imports_no_ray(fitted, image_files):
    """In-process means no Ray at all: not started, not even imported."""
    _, written = image_files
    script = (
        "import sys\n"
        "from raytrain_mnist.__main__ import main\n"
        f"code = main(['predict', {fitted['summary']['run_dir']!r}, {str(written[0][0])!r}])\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{written[0][0]}: ")
