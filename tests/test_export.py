"""``raytrain-mnist export``: the checkpoint's model as a torch.export program and as an ONNX
model that, on every test image (all 10,000 of full MNIST where this checkout has it, else the
sample's 1,000), give the checkpoint model's labels and its logits within 1e-4, at any batch
size; the preparation of inputs is written beside them. Uses the session's one fitted run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import full_data_dir, run_cli_here

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def test_images():
    """The test set's images as the model takes them (float N x 1 x 28 x 28, normalised)."""
    import torch

    from raytrain_mnist.data import load_mnist, load_sample
    from raytrain_mnist.nn.model import normalize

    full = full_data_dir()
    data = load_mnist(str(full), "mnist") if full else load_sample()
    return normalize(torch.from_numpy(data.test_images))


@pytest.fixture(scope="module")
def reference(fitted, test_images):
    import torch

    from raytrain_mnist.driver.evaluation import load_checkpoint
    from raytrain_mnist.driver.targets import resolve_target

    _, model = load_checkpoint(resolve_target(fitted["summary"]["run_dir"]).checkpoint)
    with torch.no_grad():
        return model.eval()(test_images).numpy()


@pytest.fixture(scope="module")
def exported(fitted, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("export")
    files = {}
    for fmt in ("pt2", "onnx"):
        path = out / f"mnist.{fmt}"
        result = run_cli_here(
            "export", fitted["summary"]["run_dir"], "--format", fmt, "--output", str(path), "--json"
        )
        assert result.returncode == 0, result.stderr
        files[fmt] = (path, json.loads(result.stdout))
    return files


def _check(logits: np.ndarray, reference: np.ndarray) -> float:
    assert logits.shape == reference.shape
    assert (logits.argmax(1) == reference.argmax(1)).all()
    difference = float(np.abs(logits - reference).max())
    assert difference <= TOLERANCE, difference
    return difference


def test_the_torch_export_program_gives_the_checkpoints_logits(exported, test_images, reference):
    import torch

    path, record = exported["pt2"]
    assert record["format"] == "pt2" and record["max_logit_difference"] <= TOLERANCE
    program = torch.export.load(str(path)).module()
    with torch.no_grad():
        print(f"pt2: max logit difference {_check(program(test_images).numpy(), reference):.2e}")
        _check(program(test_images[:1]).numpy(), reference[:1])  # any batch size


def test_onnxruntime_gives_the_checkpoints_logits(exported, test_images, reference):
    onnx = pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")

    path, record = exported["onnx"]
    model = onnx.load(str(path))
    assert {o.domain: o.version for o in model.opset_import}[""] == 18
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (given,) = session.get_inputs()
    assert given.name == "images" and given.shape[1:] == [1, 28, 28]
    assert not isinstance(given.shape[0], int)  # a dynamic batch
    difference = _check(session.run(None, {"images": test_images.numpy()})[0], reference)
    print(f"onnx: max logit difference {difference:.2e} on {len(reference)} images")
    _check(session.run(None, {"images": test_images[:3].numpy()})[0], reference[:3])


def test_the_preparation_is_written_beside_and_is_the_training_datas(exported, fitted):
    import torch

    from raytrain_mnist.nn.model import normalize

    for fmt, (path, record) in exported.items():
        prep = json.loads(path.with_name(path.name + ".json").read_text())
        assert record["preparation"] == str(path.with_name(path.name + ".json"))
        assert prep["format"] == fmt and prep["input"]["shape"] == ["N", 1, 28, 28]
        pixels = torch.arange(256, dtype=torch.uint8).repeat(4)[: 28 * 28].reshape(1, 28, 28)
        by_hand = (pixels.float() * prep["scale"] - prep["mean"]) / prep["std"]
        assert torch.allclose(by_hand.unsqueeze(1), normalize(pixels), atol=1e-6)
    assert exported["onnx"][0].with_name("mnist.onnx.json").is_file()


def test_an_existing_output_is_kept_without_overwrite(fitted, exported):
    path, _ = exported["pt2"]
    before = path.read_bytes()
    args = ["export", fitted["summary"]["run_dir"], "--format", "pt2", "--output", str(path)]
    result = run_cli_here(*args)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"raytrain-mnist: error: {path} exists; pass --overwrite to replace it"
    )
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["RUN", "--format", "tflite", "--output", "x"], "argument --format: invalid choice"),
        (["RUN", "--format", "pt2"], "the following arguments are required: --output"),
        (["nowhere", "--format", "pt2", "--output", "OUT"], "nowhere does not exist"),
        (["RUN", "--format", "pt2", "--output", "/nonexistent/dir/x.pt2"], "not a file in an"),
    ],
)
def test_bad_arguments_are_one_line(fitted, tmp_path, args, fragment):
    words = [
        fitted["summary"]["run_dir"] if a == "RUN" else str(tmp_path / "m.pt2") if a == "OUT" else a
        for a in args
    ]
    result = run_cli_here("export", *words)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr


# ------------------------------------------------- never clobber, never pass NaN (issue 47)
# An untrained ConvNet's checkpoint is enough for what these check: what is written where,
# and what the fidelity check lets through. No Ray, no fit.


def _checkpoint(root, weights=None) -> str:
    from raytrain_mnist.nn import checkpoint as ckpt
    from raytrain_mnist.nn.model import ConvNet

    path = root / "checkpoint_000000"
    path.mkdir(parents=True)
    ckpt.save(path, {"model": weights or ConvNet().state_dict(), "epoch": 0})
    return str(path)


@pytest.fixture(scope="module")
def untrained(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory.mktemp("untrained"))


def _export(checkpoint: str, output) -> object:
    return run_cli_here("export", checkpoint, "--format", "pt2", "--output", str(output))


@pytest.mark.parametrize("name", ["m.pt2", "m.pt2.json"])
def test_a_dangling_symlink_at_an_output_name_is_kept(untrained, tmp_path, name):
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(tmp_path / "elsewhere")
    result = _export(untrained, out / "m.pt2")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"raytrain-mnist: error: {out / name} exists; pass --overwrite to replace it"
    )
    assert sorted(p.name for p in out.iterdir()) == [name]
    assert (out / name).readlink() == tmp_path / "elsewhere"
    assert not (tmp_path / "elsewhere").exists()
    # --overwrite replaces the link itself, never writes through it.
    result = run_cli_here(
        "export", untrained, "--format", "pt2", "--output", str(out / "m.pt2"), "--overwrite"
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["m.pt2", "m.pt2.json"]
    assert not (out / name).is_symlink() and not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("name", ["m.pt2", "m.pt2.json"])
def test_an_output_that_appears_while_exporting_is_kept(untrained, tmp_path, monkeypatch, name):
    """The name is free when export looks, and taken by the time it publishes: the other
    writer's file stays, and neither of export's is left (the model is taken back when its
    FILE.json cannot be published). The file appears from the fidelity check, the step
    between writing the temporary file and publishing it: no timing involved."""
    from raytrain_mnist.driver import exporting

    out = tmp_path / "out"
    out.mkdir()
    check = exporting.check_export

    def check_then_someone_writes(*args, **kwargs):
        difference = check(*args, **kwargs)
        (out / name).write_text("theirs")
        return difference

    monkeypatch.setattr(exporting, "check_export", check_then_someone_writes)
    result = _export(untrained, out / "m.pt2")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"raytrain-mnist: error: {out / name} exists (it appeared while exporting); "
        "pass --overwrite to replace it"
    )
    assert sorted(p.name for p in out.iterdir()) == [name]  # no temporary file left either
    assert (out / name).read_text() == "theirs"


def test_logits_that_are_not_finite_fail_the_check(tmp_path):
    """Finite weights whose logits overflow: the difference between the exported model's
    and the checkpoint's is NaN, which compares false with the tolerance (it passed as
    'logits within nan', exit 0)."""
    import torch

    from raytrain_mnist.nn.model import ConvNet

    weights = ConvNet().state_dict()
    weights["fc.weight"] = torch.full_like(weights["fc.weight"], 3e38)
    result = _export(_checkpoint(tmp_path / "ckpt", weights), tmp_path / "m.pt2")
    assert result.returncode == 1, result.stdout
    assert "not finite (NaN or inf)" in result.stderr and "nothing was written" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_checkpoint_with_nan_weights_is_not_exported(tmp_path):
    from raytrain_mnist.nn.model import ConvNet

    weights = ConvNet().state_dict()
    weights["fc.weight"][3, 7] = float("nan")
    result = _export(_checkpoint(tmp_path / "ckpt", weights), tmp_path / "m.pt2")
    assert result.returncode == 1, result.stdout
    assert "non-finite weights (NaN or inf)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
