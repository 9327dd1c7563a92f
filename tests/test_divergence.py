"""A loss that is not a number ends the run: one behaviour for ``fit``, ``tune`` and a
service (issue 60). Every rank raises :class:`~raytrain_mnist.errors.Diverged` at the same
epoch, before that epoch is reported, so the run's last checkpoint is its last good one; the
user reads one line. The service's own case is tests/test_service.py's."""

from __future__ import annotations

import io
import math

import pytest
import torch

from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig
from raytrain_mnist.data import MnistData
from raytrain_mnist.errors import Diverged, UserError, diverged_line
from raytrain_mnist.worker.batches import set_epoch
from raytrain_mnist.worker.loop import check_finite
from raytrain_mnist.worker.training import as_is, prepare_training

CPU = torch.device("cpu")
#: A learning rate no model survives: the first epoch's loss is not a number.
DIVERGING = TrainConfig(epochs=2, batch_size=16, lr=1e6, optimizer="sgd", schedule="constant")


def test_the_loops_own_epoch_at_a_diverging_rate_is_refused_in_one_line(sample_digits):
    images, labels = (torch.from_numpy(a[:128].copy()) for a in sample_digits)
    data = MnistData(images, labels, images[:0], labels[:0], "sample", "test")
    training = prepare_training(
        DIVERGING, data, CPU, prepare_model=as_is, prepare_data_loader=as_is
    )
    set_epoch(training.loader, 0, DIVERGING.seed)
    train = training.train_one_epoch()
    assert not math.isfinite(train["train_loss"])
    with pytest.raises(Diverged) as info:
        check_finite(train, 1, DIVERGING)
    message = str(info.value)
    assert message.startswith("training diverged: the loss of epoch 1 is ") and "\n" not in message
    assert "lower --lr" in message
    check_finite({**train, "train_loss": 0.5}, 1, DIVERGING)  # a number goes on


def test_the_line_of_a_divergence_is_read_through_rays_wrapping():
    from ray.train import WorkerGroupError

    line = "training diverged: the loss of epoch 3 is nan (lr 1e+06); lower --lr"
    snippet = "Traceback (most recent call last):\n  File ...\n"
    wrapped = WorkerGroupError(f"[Rank 0]:\n{snippet}raytrain_mnist.errors.Diverged: {line}", {})
    assert diverged_line(wrapped) == line
    other = WorkerGroupError(f"[Rank 1]:\n{snippet}RuntimeError: Connection closed by peer", {})
    assert diverged_line(other) is None
    assert diverged_line(Diverged(line)) is None  # only a worker's, through Ray's text


def test_a_diverging_fit_ends_in_one_line_with_exit_1(ray_local, tiny_mnist, tmp_path):
    """Through the command's own path (fit's run, as the CLI calls it): the line a
    service's diverged request ends in, and the run recorded as failed."""
    from raytrain_mnist.driver.runs import Run
    from raytrain_mnist.fit import run

    settings = RunSettings.from_flags(
        num_workers=2,
        cpus_per_worker=1,
        data_dir=str(tiny_mnist),
        dataset="mnist",
        max_failures=0,  # a divergence is deterministic: a retry diverges again
        storage_path=str(tmp_path),
        name="diverges",
    )
    with pytest.raises(UserError) as info, _quiet():
        run(FitConfig(DIVERGING, settings))
    line = str(info.value)
    assert info.value.exit_code == 1 and "\n" not in line
    assert line.startswith("training failed: training diverged: the loss of epoch 1 is "), line
    summary = Run(str(tmp_path), "diverges").read_json("summary.json")
    assert summary["status"] == "failed" and summary["epochs_completed"] == 0
    assert summary["error"].startswith("training diverged"), summary["error"]


def _quiet():
    import contextlib

    return contextlib.redirect_stdout(io.StringIO())
