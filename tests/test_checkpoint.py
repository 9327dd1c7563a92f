"""Checkpoints hold the whole resume state and load safely."""

import os
import pickle

import pytest
import torch

from raytrain_mnist import checkpoint as ckpt
from raytrain_mnist.model import ConvNet


def _state(model, optimizer):
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3,
            "history": [{"epoch": 1, "val_accuracy": 0.9}], "rng": ckpt.rng_state()}


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
    assert torch.equal(fresh.state_dict()["state"][0]["momentum_buffer"],
                       optimizer.state_dict()["state"][0]["momentum_buffer"])
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
