"""Checkpoints hold the whole resume state and load safely."""

import os
import pickle
import re
import struct
import zipfile

import pytest
import torch

from raytrain_mnist.config import TrainConfig
from raytrain_mnist.nn import checkpoint as ckpt
from raytrain_mnist.nn.model import ConvNet


def _state(model, optimizer):
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": 3,
        "history": [{"epoch": 1, "val_accuracy": 0.9}],
        "rng": ckpt.rng_state(),
    }


def test_save_then_mutate_then_load_restores_exactly(tmp_path):
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    optimizer.step()  # momentum buffers now exist
    ckpt.save(tmp_path, _state(model, optimizer))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    draws = torch.rand(3)

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state = ckpt.load(tmp_path)
    model.load_state_dict(state["model"])
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    fresh = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fresh.load_state_dict(state["optimizer"])
    assert torch.equal(
        fresh.state_dict()["state"][0]["momentum_buffer"],
        optimizer.state_dict()["state"][0]["momentum_buffer"],
    )
    assert state["epoch"] == 3 and state["history"][0]["val_accuracy"] == 0.9
    ckpt.set_rng_state(state["rng"])
    assert torch.equal(torch.rand(3), draws)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/raytrain_mnist_pwned",))


def test_a_pickle_that_runs_code_is_refused_not_executed(tmp_path):
    marker = "/tmp/raytrain_mnist_pwned"
    if os.path.exists(marker):
        os.remove(marker)
    path = tmp_path / ckpt.STATE_FILE
    with open(path, "wb") as f:
        pickle.dump({"format": ckpt.FORMAT, "model": _Exploit()}, f)
    torch.save({"format": ckpt.FORMAT, "model": _Exploit()}, tmp_path / "zip.pt")
    for candidate in (path, tmp_path / "zip.pt"):
        with pytest.raises(ckpt.CheckpointError, match="refusing to load|corrupt"):
            ckpt.load(candidate)
    assert not os.path.exists(marker)


def test_corrupt_foreign_and_missing_checkpoints(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / ckpt.STATE_FILE).write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ckpt.CheckpointError, match="corrupt"):
        ckpt.load(tmp_path / "bad")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    with pytest.raises(ckpt.CheckpointError, match="not a raytrain_mnist checkpoint"):
        ckpt.load(tmp_path / "foreign.pt")
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint"):
        ckpt.load(tmp_path / "absent")
    ckpt.save(tmp_path, {"model": {"fc.weight": torch.zeros(3, 3)}})
    with pytest.raises(ckpt.CheckpointError, match="different model"):
        ckpt.load_model(tmp_path)


# --------------------------------------------------------------------------- the torch floor


@pytest.mark.parametrize("version", ["2.9.1+cu121", "2.5.0", "1.13.1"])
def test_a_torch_below_the_floor_is_refused_in_one_line(tmp_path, monkeypatch, version):
    ckpt.save(tmp_path, {"model": ConvNet().state_dict()})
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(
        ckpt.CheckpointError,
        match=f"torch {re.escape(version)} cannot load "
        r"checkpoints safely.*torch>=2\.10",
    ) as info:
        ckpt.load(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("version", ["2.10.0", "2.11.0+cu128", "2.14.1", "3.0.0"])
def test_the_floor_and_later_load(tmp_path, monkeypatch, version):
    ckpt.save(tmp_path, {"model": ConvNet().state_dict()})
    monkeypatch.setattr(torch, "__version__", version)
    assert "model" in ckpt.load(tmp_path)


def test_the_installed_torch_and_the_declared_floor_agree():
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    floor = ".".join(map(str, ckpt.MIN_TORCH))
    assert f'"torch>={floor}' in pyproject
    ckpt.check_torch()  # this environment satisfies it


# --------------------------------------------------------------------------- resume state

CFG = TrainConfig(epochs=3, batch_size=32, lr=0.05, optimizer="sgd")  # momentum buffers


def _resume_state(cfg: TrainConfig = CFG) -> dict:
    """What the worker saves after its first epoch, built with the worker's own optimizer."""
    from raytrain_mnist.nn.optim import build_optimizer

    torch.manual_seed(0)
    model = ConvNet()
    optimizer, scheduler = build_optimizer(model, cfg, 3)  # not 4: 1 epoch x 4 x 25 % = 1
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    optimizer.step()
    scheduler.step()
    scaler = torch.amp.GradScaler("cpu", enabled=cfg.amp == "fp16")
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": 1,
        "best_val_accuracy": 0.5,
        "history": [{"epoch": 1, "val_accuracy": 0.5}],
        "rng": ckpt.rng_state(),
        "config": cfg.to_dict(),
        "position": ckpt.boundary_position(cfg.to_dict(), 1, 1),
    }


def _momentum_of_wrong_shape(state):
    state["optimizer"]["state"][0]["momentum_buffer"] = torch.zeros(3)


@pytest.mark.parametrize(
    "cfg", [CFG, TrainConfig(schedule="constant", momentum=0.0), TrainConfig(amp="fp16")]
)
def test_a_checkpoint_the_worker_wrote_is_resumable(tmp_path, cfg):
    ckpt.save(tmp_path, _resume_state(cfg))
    assert ckpt.resumable_state(tmp_path, cfg.to_dict())["epoch"] == 1


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda s: s.update(model=[1, 2]), "holds no model weights"),
        (lambda s: s["model"].update({"conv1.weight": "w"}), "holds no model weights"),
        (lambda s: s.update(optimizer="sgd"), "its optimizer state does not fit"),
        (lambda s: s["optimizer"].update(param_groups=[]), "its optimizer state does not fit"),
        (_momentum_of_wrong_shape, "its optimizer state does not fit"),
        (lambda s: s.update(scheduler=[0]), "its scheduler state does not fit"),
        (lambda s: s["scheduler"].update(total_steps="many"), "its scheduler state does not fit"),
        (lambda s: s.update(scaler=3), "its scaler state does not fit"),
        (lambda s: s.update(epoch="1"), "its epoch '1' is not a completed epoch"),
        (lambda s: s.update(epoch=7), "its epoch 7 is not a completed epoch of a 3-epoch run"),
        (lambda s: s.update(best_val_accuracy="high"), "is not an accuracy"),
        (lambda s: s.update(history={"epoch": 1}), "its history is not a list"),
        (lambda s: s.update(rng={"torch": torch.zeros(3)}), "its RNG state is unusable"),
        (lambda s: s.update(rng=None), "its RNG state is unusable"),
        (lambda s: s.update(config={**CFG.to_dict(), "lr": 0.1}), "other training settings"),
        (lambda s: s.pop("best_val_accuracy"), "lacks best_val_accuracy"),
    ],
)
def test_any_mistyped_content_is_one_checkpoint_error(tmp_path, mutate, fragment):
    state = _resume_state()
    mutate(state)
    ckpt.save(tmp_path, state)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(fragment)) as info:
        ckpt.resumable_state(tmp_path, CFG.to_dict())
    assert "\n" not in str(info.value)


def test_a_bad_scaler_state_is_caught_for_fp16(tmp_path):
    cfg = TrainConfig(amp="fp16")
    state = _resume_state(cfg)
    state["scaler"] = {"scale": "big"}
    ckpt.save(tmp_path, state)
    with pytest.raises(ckpt.CheckpointError, match="its scaler state does not fit"):
        ckpt.resumable_state(tmp_path, cfg.to_dict())


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x02}q\x00(X\x05\x00\x00\x00modelq\x01",  # a pickle stream cut short
        b"\x80\x02cbuiltins\nlen\n",  # a global, then nothing
        b"\x80\x05\x95\xff\xff\xff\xff\xff\xff\xff\x7f",  # a frame that claims 2**63 bytes
        b"PK\x03\x04" + bytes(60),  # the start of a zip and zeros
        # An allowed global called with the wrong arguments: torch raises TypeError.
        b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nq\x00(X\x01\x00\x00\x00aX\x01\x00\x00\x00btR.",
        b"",
    ],
)
def test_malformed_streams_are_one_checkpoint_error(tmp_path, payload):
    (tmp_path / ckpt.STATE_FILE).write_bytes(payload)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.resumable_state(tmp_path, CFG.to_dict())
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- the loop's own checkpoint

CPU = torch.device("cpu")


def _training(cfg: TrainConfig, images, labels, seed: int):
    """One worker's training as the loop prepares it, on one process without Ray, its
    weights initialised from ``seed``."""
    import dataclasses

    from raytrain_mnist.data import MnistData
    from raytrain_mnist.worker.training import as_is, prepare_training

    data = MnistData(images, labels, images[:0], labels[:0], "sample", "test")
    cfg = dataclasses.replace(cfg, seed=seed)
    return prepare_training(cfg, data, CPU, prepare_model=as_is, prepare_data_loader=as_is)


def test_the_loops_checkpoint_passes_the_resume_check_and_resumes_the_uninterrupted_run(
    tmp_path, sample_digits
):
    from raytrain_mnist.worker.loop import checkpoint_state, restore, set_epoch

    cfg = TrainConfig(epochs=2, batch_size=16, lr=0.05)
    images, labels = (torch.from_numpy(a[:64].copy()) for a in sample_digits)
    run = _training(cfg, images, labels, cfg.seed)
    set_epoch(run.loader, 0, cfg.seed)
    run.train_one_epoch()
    history = [{"epoch": 1, "val_accuracy": 0.5}]
    ckpt.save(tmp_path, checkpoint_state(run, cfg, 1, 0.5, history))
    set_epoch(run.loader, 1, cfg.seed)  # the uninterrupted second epoch
    run.train_one_epoch()
    draws = torch.rand(3)

    # The driver's check accepts it (it builds a model, so it draws: after the draws above).
    state = ckpt.resumable_state(tmp_path, cfg.to_dict())
    assert set(state) == {"format", *ckpt.RESUME_KEYS}

    # New objects, initialised from another seed: only what restore loads can match.
    resumed = _training(cfg, images, labels, cfg.seed + 1)
    assert restore(resumed, state) == (1, history, 0.5)
    set_epoch(resumed.loader, 1, cfg.seed)
    resumed.train_one_epoch()
    assert torch.equal(torch.rand(3), draws)
    assert resumed.lr == run.lr
    expected, got = run.module.state_dict(), resumed.module.state_dict()
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


# --------------------------------------------------------------------------- bounded loading


def _zip_sizes(path) -> tuple[int, int]:
    """How many records a zip archive lists, and what they unpack to."""
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
    return len(infos), sum(i.file_size for i in infos)


def _recompressed(source, target, compression=None):
    """``source`` (a torch.save archive) written again with its records compressed: an
    archive torch itself loads, but one whose records inflate."""
    compression = zipfile.ZIP_DEFLATED if compression is None else compression
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", compression) as new:
        for info in old.infolist():
            new.writestr(info.filename, old.read(info.filename))
    return target


def test_a_checkpoint_with_compressed_records_is_refused_before_torch_reads_it(tmp_path):
    ckpt.save(tmp_path, {"model": ConvNet().state_dict()})
    planted = _recompressed(tmp_path / ckpt.STATE_FILE, tmp_path / "planted.pt")
    assert "model" in torch.load(planted, weights_only=True)  # torch would inflate it
    with pytest.raises(ckpt.CheckpointError, match="is compressed") as info:
        ckpt.load(planted)
    assert str(info.value).startswith(f"refusing to load {planted}: its record ")
    assert "\n" not in str(info.value)


def test_a_zip_bomb_is_refused_without_inflating_it(tmp_path):
    """One record that deflates 64 MiB of zeros into a few KiB: refused from the central
    directory, with no memory spent on it."""
    import tracemalloc

    bomb = tmp_path / ckpt.STATE_FILE
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("archive/data.pkl", "w") as f:
            chunk = bytes(1 << 20)
            for _ in range(64):
                f.write(chunk)
    assert bomb.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(ckpt.CheckpointError, match="is compressed"):
            ckpt.load(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_the_size_and_record_bounds(tmp_path, monkeypatch):
    path = ckpt.save(tmp_path, {"model": ConvNet().state_dict()})
    ckpt.load(path)  # the package's own checkpoint is within every bound
    records, total = _zip_sizes(path)
    monkeypatch.setattr(ckpt, "MAX_RECORDS", records - 1)
    with pytest.raises(ckpt.CheckpointError, match=f"its archive lists {records} records"):
        ckpt.load(path)
    monkeypatch.setattr(ckpt, "MAX_RECORDS", records)
    monkeypatch.setattr(ckpt, "MAX_CHECKPOINT_BYTES", total - 1)
    # The file itself is larger than what its records unpack to: the file's size first.
    with pytest.raises(ckpt.CheckpointError, match=r"bytes, more than a checkpoint holds"):
        ckpt.load(path)


def test_a_stored_archive_whose_records_unpack_past_the_bound_is_refused(tmp_path, monkeypatch):
    """Stored records that all point at the same bytes (a non-recursive zip bomb needs no
    compression): the sum of their sizes is bounded, whatever the file's size."""
    path = ckpt.save(tmp_path, {"model": ConvNet().state_dict()})
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
    records = len(infos)
    # Point every central directory entry at the largest record's data and size.
    first = max(infos, key=lambda i: i.file_size)
    at = raw.find(b"PK\x01\x02")
    while at >= 0:
        raw[at + 20 : at + 28] = struct.pack("<LL", first.compress_size, first.file_size)
        raw[at + 42 : at + 46] = struct.pack("<L", first.header_offset)
        at = raw.find(b"PK\x01\x02", at + 4)
    planted = tmp_path / "overlapping.pt"
    planted.write_bytes(bytes(raw))
    expected = first.file_size * records
    monkeypatch.setattr(ckpt, "MAX_CHECKPOINT_BYTES", max(len(raw), expected - 1))
    with pytest.raises(ckpt.CheckpointError, match=f"its records unpack to {expected} bytes"):
        ckpt.load(planted)


def test_a_sparse_giant_state_file_is_refused_by_its_size(tmp_path):
    path = ckpt.save(tmp_path, {"model": ConvNet().state_dict()})
    with path.open("r+b") as f:
        f.truncate(ckpt.MAX_CHECKPOINT_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(
        ckpt.CheckpointError, match=f"{ckpt.MAX_CHECKPOINT_BYTES + 1} bytes, more than"
    ):
        ckpt.load(tmp_path)


# --------------------------------------------------------------------------- mid-epoch


def test_a_mid_epoch_checkpoint_resumes_the_uninterrupted_run_bit_for_bit(tmp_path, sample_digits):
    """A checkpoint at step 3 of epoch 2 (what a preemption writes, just in time): a resume
    skips exactly those 3 batches, draws the shifts the uninterrupted run drew from there,
    and ends the epoch with its weights, schedule and metrics."""
    from raytrain_mnist.worker.batches import set_epoch
    from raytrain_mnist.worker.resume import checkpoint_state, restore, resume_point

    cfg = TrainConfig(epochs=3, batch_size=16, lr=0.05, max_shift=2)
    images, labels = (torch.from_numpy(a[:96].copy()) for a in sample_digits)

    def training(seed):  # the recipe is the config's: max_shift 2
        return _training(cfg, images, labels, seed)

    run = training(cfg.seed)
    set_epoch(run.loader, 0, cfg.seed)
    run.train_one_epoch()
    history = [{"epoch": 1, "val_accuracy": 0.5}]
    saved = []

    def at_step_3(steps, sums):
        if steps == 3:
            position = {
                "step": 3,
                "sums": [*sums.tolist(), 0.25],
                "sampler_seed": cfg.seed,
                "sampler_epoch": 1,
                "world_size": 1,
                "kind": "preemption",
            }
            ckpt.save(tmp_path, checkpoint_state(run, cfg, 1, 0.5, history, position))
            saved.append(True)

    set_epoch(run.loader, 1, cfg.seed)
    uninterrupted = run.train_one_epoch(on_step=at_step_3)
    assert saved

    state = ckpt.resumable_state(tmp_path, cfg.to_dict())
    assert state["position"]["step"] == 3 and state["epoch"] == 1
    resumed = training(cfg.seed + 1)
    assert restore(resumed, state) == (1, history, 0.5)
    start, told = resume_point(state, rank=0)
    assert told == {"resumed_from_epoch": 1, "resumed_from_step": 3, "resumed_world_size": 1}
    torch.rand(5)  # whatever the process drew meanwhile: the RNG comes back at step 3
    set_epoch(resumed.loader, 1, cfg.seed)
    finished = resumed.train_one_epoch(start=start)
    assert finished["train_steps"] == uninterrupted["train_steps"] == 6
    assert finished["skipped_steps"] == 3
    assert finished["train_loss"] == pytest.approx(uninterrupted["train_loss"], rel=1e-12)
    assert finished["train_accuracy"] == uninterrupted["train_accuracy"]
    assert resumed.lr == run.lr
    for name, value in run.module.state_dict().items():
        assert torch.equal(resumed.module.state_dict()[name], value), name


def _format_1(state: dict) -> dict:
    """A checkpoint as the format before positions wrote it."""
    return {k: v for k, v in state.items() if k != "position"}


def test_a_format_1_checkpoint_loads_as_an_epoch_boundary(tmp_path):
    state = _format_1(_resume_state())
    torch.save({"format": "raytrain_mnist/1", **state}, tmp_path / ckpt.STATE_FILE)
    loaded = ckpt.resumable_state(tmp_path, CFG.to_dict())
    assert loaded["format"] == ckpt.FORMAT
    assert loaded["position"] == ckpt.boundary_position(CFG.to_dict(), 1)


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"step": -1}, "step -1 of epoch 2 is not a step"),
        ({"step": True}, "step True of epoch 2 is not a step"),
        ({"sums": [0, 0, float("nan"), 0]}, "are not 4 sums"),
        ({"sums": [1, 2]}, "are not 4 sums"),
        ({"sampler_seed": 7}, "its sampler's seed and epoch are not this run's"),
        ({"sampler_epoch": 0}, "its sampler's seed and epoch are not this run's"),
        ({"world_size": 0}, "its world size or kind is not valid"),
        ({"kind": "whim"}, "its world size or kind is not valid"),
        ({"extra": 1}, "is not a position within an epoch"),
    ],
)
def test_a_bad_position_is_one_checkpoint_error(tmp_path, change, fragment):
    state = _resume_state()
    state["position"] = {**state["position"], "step": 2, **change}
    ckpt.save(tmp_path, state)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(fragment)) as info:
        ckpt.resumable_state(tmp_path, CFG.to_dict())
    assert "\n" not in str(info.value)


def test_mid_epoch_only_inside_the_runs_epochs(tmp_path):
    state = _resume_state()
    state.update(epoch=0, position={**state["position"], "step": 2, "sampler_epoch": 0})
    ckpt.save(tmp_path, state)
    assert ckpt.resumable_state(tmp_path, CFG.to_dict())["epoch"] == 0  # step 2 of epoch 1
    state.update(epoch=3, position={**state["position"], "step": 2, "sampler_epoch": 3})
    ckpt.save(tmp_path, state)
    with pytest.raises(ckpt.CheckpointError, match="step 2 of epoch 4 is not a step of a 3-epoch"):
        ckpt.resumable_state(tmp_path, CFG.to_dict())
    state.update(epoch=0, position={**state["position"], "step": 0, "sampler_epoch": 0})
    ckpt.save(tmp_path, state)
    with pytest.raises(ckpt.CheckpointError, match="step 0 of epoch 1 is not a step"):
        ckpt.resumable_state(tmp_path, CFG.to_dict())
