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
    return data.test_images, data.test_labels


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


# ------------------------------------------------------------------ hostile files (issue 47)
# An untrained ConvNet's checkpoint is enough for what these check: what is read, what is
# refused, what is written. No Ray, no fit.


def _checkpoint(root, weights=None):
    from raytrain_mnist.nn import checkpoint as ckpt
    from raytrain_mnist.nn.model import ConvNet

    path = root / "checkpoint_000000"
    path.mkdir(parents=True)
    ckpt.save(path, {"model": weights or ConvNet().state_dict(), "epoch": 0})
    return str(path)


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("untrained"))


@pytest.fixture(scope="module")
def a_png(tmp_path_factory):
    from PIL import Image

    path = tmp_path_factory.mktemp("png") / "digit.png"
    pixels = np.zeros((28, 28), dtype=np.uint8)
    pixels[6:22, 12:16] = 255  # a 1
    Image.fromarray(pixels).save(path)
    return path


def _strict_json(text: str):
    """``text`` parsed as JSON proper: NaN and Infinity are not JSON, nor a lone surrogate
    (the record must encode as UTF-8)."""

    def refuse(word):
        raise ValueError(f"{word} is not JSON")

    text.encode("utf-8")  # strict: a lone surrogate raises
    return json.loads(text, parse_constant=refuse)


def _idx(path, count: int, pixels: bytes | None = None):
    """An IDX image file of ``count`` 28x28 images: ``pixels``, or zeros written sparse (a
    file of any declared size costs nothing on disk)."""
    import struct

    with open(path, "wb") as f:
        f.write(struct.pack(">IIII", 0x0803, count, 28, 28))
        if pixels is not None:
            f.write(pixels)
        else:
            f.truncate(16 + count * 28 * 28)
    return path


@pytest.mark.timeout(60)  # its read blocked for good before it was refused
def test_a_fifo_is_one_line_and_never_waited_on(untrained, a_png, tmp_path):
    import os

    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    result, record = _predict_json(untrained, str(fifo), str(a_png))
    assert result.returncode == 1, result.stderr
    assert record["errors"] == [
        {"source": str(fifo), "error": "is a FIFO (named pipe), not a regular file"}
    ]
    assert [p["source"] for p in record["predictions"]] == [str(a_png)]


@pytest.mark.timeout(60)
def test_only_regular_files_are_read_and_the_rest_are_one_line_each(untrained, a_png, tmp_path):
    import gzip
    import socket

    sock = tmp_path / "sock.png"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock))
    zero = tmp_path / "zero.png"
    zero.symlink_to("/dev/zero")  # read without bound before
    dangling = tmp_path / "dangling.png"
    dangling.symlink_to(tmp_path / "nowhere")
    loop = tmp_path / "loop.png"
    loop.symlink_to(loop)
    gz = tmp_path / "cut-idx3-ubyte.gz"
    gz.write_bytes(gzip.compress(_idx(tmp_path / "x", 3, bytes(3 * 784)).read_bytes())[:-20])
    bad = [sock, zero, dangling, loop, gz, "/dev/null", "/proc/self/status"]
    try:
        result, record = _predict_json(untrained, str(a_png), *map(str, bad))
    finally:
        listener.close()
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    assert [p["source"] for p in record["predictions"]] == [str(a_png)]
    reasons = {e["source"]: e["error"] for e in record["errors"]}
    assert list(reasons) == list(map(str, bad))
    assert reasons[str(sock)] == "is a socket, not a regular file"
    assert reasons[str(zero)] == reasons["/dev/null"] == "is a character device, not a regular file"
    assert "No such file" in reasons[str(dangling)]
    assert "symbolic links" in reasons[str(loop)]
    assert "truncated or damaged gzip" in reasons[str(gz)]
    # A kernel's file says 0 bytes and holds more: never read past what fstat said.
    assert reasons["/proc/self/status"].startswith("holds more than its size says")
    lines = [line for line in result.stderr.splitlines() if line.startswith("raytrain-mnist:")]
    assert len(lines) == len(bad)


def test_a_name_that_is_not_utf8_is_escaped_in_text_and_json(untrained, a_png, tmp_path):
    import os

    odd = os.fsdecode(bytes(tmp_path) + b"/d\xffi\x1b]0;t\x07.png")  # not UTF-8, and an OSC
    with open(os.fsencode(odd), "wb") as f:
        f.write(a_png.read_bytes())
    text = run_cli_here("predict", untrained, odd)
    assert text.returncode == 0, text.stderr
    (line,) = text.stdout.encode("utf-8").decode().splitlines()  # a crash on print before
    assert line.startswith(f"{tmp_path}/d\\xffi^[]0;t^G.png: ")
    result = run_cli_here("predict", untrained, odd, "--json")
    assert result.returncode == 0, result.stderr
    (p,) = _strict_json(result.stdout)["predictions"]
    assert p["source"] == f"{tmp_path}/d\\xffi\x1b]0;t\x07.png"  # JSON escapes ESC and BEL
    assert "\x1b" not in result.stdout


def test_a_checkpoint_with_nan_weights_is_refused_in_one_line(a_png, tmp_path):
    from raytrain_mnist.nn.model import ConvNet

    weights = ConvNet().state_dict()
    weights["fc.weight"][0, 0] = float("nan")
    result = run_cli_here("predict", _checkpoint(tmp_path, weights), str(a_png), "--json")
    assert result.returncode == 1
    assert "non-finite weights (NaN or inf)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "NaN" not in result.stdout


def test_logits_that_overflow_are_an_error_and_the_json_stays_strict(a_png, tmp_path):
    """Finite weights whose logits overflow to inf: softmax gives NaN, which is neither a
    prediction nor JSON. The image is an error line; the output is JSON proper."""
    import torch

    from raytrain_mnist.nn.model import ConvNet

    weights = ConvNet().state_dict()
    weights["fc.weight"] = torch.full_like(weights["fc.weight"], 3e38)
    weights["fc.bias"] = torch.full_like(weights["fc.bias"], 3e38)
    result = run_cli_here("predict", _checkpoint(tmp_path, weights), str(a_png), "--json")
    assert result.returncode == 1, result.stderr
    record = _strict_json(result.stdout)
    assert record["predictions"] == []
    assert record["errors"] == [
        {"source": str(a_png), "error": "the model's output for it is not finite (NaN or inf)"}
    ]


def test_what_one_call_reads_is_bounded_before_it_is_read(untrained, a_png, tmp_path):
    """A sparse IDX file declaring more images than one call classifies costs nothing to
    make; it is refused from its header (it took ~1 GB and 12 s before), and so is a file
    that would pass what is left of the budget, while the files before are classified."""
    from raytrain_mnist.driver.predicting import MAX_IMAGES

    huge = _idx(tmp_path / "huge-idx3-ubyte", MAX_IMAGES + 1)
    ten = _idx(tmp_path / "ten-idx3-ubyte", 10, bytes(10 * 784))
    rest = _idx(tmp_path / "rest-idx3-ubyte", MAX_IMAGES - 10)  # 10 + 1 past the budget
    result, record = _predict_json(untrained, str(huge), str(a_png), str(ten), str(rest))
    assert result.returncode == 1, result.stderr
    assert len(record["predictions"]) == 11
    reasons = {e["source"]: e["error"] for e in record["errors"]}
    assert reasons[str(huge)] == (
        f"holds {MAX_IMAGES + 1} images, more than one call's budget of {MAX_IMAGES} images"
    )
    assert reasons[str(rest)].startswith(f"holds {MAX_IMAGES - 10} images, past what is left")
