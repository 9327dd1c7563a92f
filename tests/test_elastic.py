"""Elastic runs on a real multi-node Ray on this machine (CPU, Gloo): ``--num-workers 1-2``
grows when a node joins and shrinks when one is lost, and finishes either way.

One run shows both, on a head that hosts no training and one 1-CPU node: it starts on one
worker, grows to two when a second node joins and shrinks back to one when that node is lost,
then finishes (a Ray Train run per scenario is the suite's unit of cost). ``fit`` runs as a
subprocess (the shared in-process Ray of the ``fitted`` reference stays where it is) and the
test acts on its output and its committed checkpoints, never on time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from raytrain_mnist._cli import EXIT_USAGE
from tests.conftest import REPO, committed_workers, run_cli_here, signal_all


@pytest.fixture(scope="module")
def one_node():
    """A head with no CPUs and one 1-CPU node, on loopback."""
    from ray.cluster_utils import Cluster

    from raytrain_mnist.driver.cluster import loopback_node

    with loopback_node():
        cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={"num_cpus": 0, "include_dashboard": False},
        )
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


class _Fit:
    """``raytrain-mnist fit ARGS`` in a subprocess; its output read line by line on a
    thread, with an event per awaited line."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "raytrain_mnist", "fit", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # Single-node mode, as the cluster's nodes run (loopback_node): else Ray turns the
            # loopback address into this machine's outward one, where nothing listens.
            env={**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        )
        self.lines: list[str] = []
        self.first_epoch = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("epoch "):
                self.first_epoch.set()
        self.first_epoch.set()  # ended without one: the waiter finds out from the output

    def wait(self, timeout: float = 400) -> str:
        self.proc.wait(timeout)
        self._reader.join(10)
        return "".join(self.lines)


def _args(cluster, tiny_mnist, storage, name: str, epochs: int) -> list[str]:
    # The training settings of the shared fixed-size run (conftest `fitted`).
    return [
        "--num-workers",
        "1-2",
        "--resize-check-s",
        "2",
        "--cpus-per-worker",
        "1",
        "--epochs",
        str(epochs),
        "--batch-size",
        "32",
        "--lr",
        "0.05",
        "--data-dir",
        str(tiny_mnist),
        "--dataset",
        "mnist",
        "--address",
        cluster.address,
        "--storage-path",
        str(storage),
        "--name",
        name,
        "--keep-checkpoints",
        "2",
    ]


# Often the first test of its group to ask for `fitted`, whose 8-epoch run then counts
# toward its timeout: with a core busy the two took 602 s (2026-12-02 15:51), the run itself
# healthy (resized at 15:59:07, two epochs more by 16:01:29).
@pytest.mark.timeout(1200)
def test_elastic_run_grows_when_a_node_joins_shrinks_when_it_is_lost_and_matches_a_fixed_run(
    one_node, tiny_mnist, tmp_path, fitted
):
    from raytrain_mnist.driver.cluster import loopback_node

    run = _Fit(*_args(one_node, tiny_mnist, tmp_path, "elastic", epochs=EPOCHS))
    run_dir = tmp_path / "elastic"
    assert run.first_epoch.wait(400)
    # Grow. Once the first epoch is committed, the one worker is held (SIGSTOP) until Ray
    # Train has resized: Ray Train sees the joined node only when its resource reservations
    # refresh (every 20 s, Ray Data's AutoscalingCoordinator ticks) and then at a resize check
    # (every 2 s), and a held worker's run cannot end before that, however slow the machine.
    # The resize kills the held worker (Ray's raylet SIGKILLs one that does not stop) and the
    # run goes on on two from the last committed epoch.
    held = {w["pid"] for w in committed_workers(run_dir)}
    assert len(held) == 1, held
    try:
        signal_all(held, signal.SIGSTOP)
        with loopback_node():
            one_node.add_node(num_cpus=1)
        two = committed_workers(run_dir, after=held, timeout=400)
    finally:
        signal_all(held, signal.SIGCONT)
    assert len(two) == 2, (two, "".join(run.lines))
    # Shrink. The two are held from their first committed epoch (at least five epochs before
    # the run's end) while one of the two nodes goes: the run cannot end first, and on its
    # next step the rank left finds its peer gone and the run restarts on the one node left.
    pair = {w["pid"] for w in two}
    try:
        signal_all(pair, signal.SIGSTOP)
        one_node.remove_node(next(iter(one_node.worker_nodes)))  # either: a rank on each
    finally:
        signal_all(pair, signal.SIGCONT)
    out = run.wait()
    assert run.proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    sizes = [h["world_size"] for h in summary["history"]]
    assert sizes[0] == 1 and 2 in sizes and sizes[-1] == 1, (sizes, out)
    grew, shrank = summary["resizes"]
    assert (grew["from"], grew["to"], shrank["from"], shrank["to"]) == (1, 2, 2, 1), out
    assert f"workers 1 → 2 at epoch {grew['at_epoch']}" in out
    assert f"workers 2 → 1 at epoch {shrank['at_epoch']}" in out
    assert sizes[grew["at_epoch"] - 1] == 2 and sizes[grew["at_epoch"] - 2] == 1
    assert sizes[shrank["at_epoch"] - 2] == 2 and sizes[shrank["at_epoch"] - 1] == 1
    assert summary["num_workers"] == [1, 2] and summary["elastic"] is True
    assert summary["status"] == "finished" and summary["epochs_completed"] == EPOCHS
    assert not (held | pair) & {w["pid"] for w in summary["workers"]}  # all let go
    # The global batch and the schedule do not depend on the world size: every epoch's
    # learning rate is the one-cycle schedule's at that step, across both resizes.
    assert [h["lr"] for h in summary["history"]] == pytest.approx(_schedule(EPOCHS), rel=1e-9)
    # And it learns at least as well as the fixed 2-worker run of as many epochs.
    assert summary["val_accuracy"] >= fitted["summary"]["val_accuracy"] - 0.03


EPOCHS = 8  # the shared fixed run's (conftest `fitted`)


def _schedule(epochs: int) -> list[float]:
    """The learning rate after each epoch of a run of these settings, on any world size."""
    import torch

    from raytrain_mnist.config import TrainConfig
    from raytrain_mnist.nn.optim import build_optimizer

    steps = 2048 // 32  # tiny_mnist's training digits over the global batch
    optimizer, scheduler = build_optimizer(
        torch.nn.Linear(1, 1), TrainConfig(epochs=epochs, batch_size=32, lr=0.05), steps
    )
    rates = []
    for _ in range(epochs):
        for _ in range(steps):
            optimizer.step()
            scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    return rates


@pytest.mark.parametrize(
    "workers, message",
    [
        ("4-2", "--num-workers 4-2: a range needs 1 <= MIN <= MAX"),
        ("0-2", "--num-workers 0-2: a range needs 1 <= MIN <= MAX"),
        ("2-x", "--num-workers must be a count >= 1 (e.g. 2) or a range MIN-MAX"),
        (
            "2-5",
            "--batch-size 128 does not split evenly over 3, 5 worker(s), which "
            "--num-workers 2-5 may run on; sizes that work: 2, 4",
        ),
    ],
)
def test_a_bad_worker_range_is_one_line_before_ray_starts(workers, message):
    done = run_cli_here("fit", "--num-workers", workers, "--dataset", "sample")
    assert done.returncode == EXIT_USAGE
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_a_range_is_a_range_in_names_flags_and_the_trainer():
    from raytrain_mnist._cli import flags_of
    from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig, parse_workers
    from raytrain_mnist.driver import runs
    from raytrain_mnist.driver.trainer import build_trainer

    run = RunSettings.from_flags(num_workers=parse_workers("1-3"), resize_check_s=5.0)
    cfg = FitConfig(TrainConfig(batch_size=96), run)
    assert runs.default_name(cfg).startswith("mnist-1-3w-")
    assert flags_of(run)[:2] == ["--num-workers", "1-3"]
    assert RunSettings.from_flags(num_workers=parse_workers("2-2")).scaling.num_workers == 2
    trainer = build_trainer(run, lambda config: None, {}, 1, "/tmp", "x")
    scaling = trainer.scaling_config
    assert scaling.num_workers == (1, 3) and scaling.elastic_resize_monitor_interval_s == 5.0
    from raytrain_mnist.driver.cluster import Request

    assert Request.for_run(run, 1).num_workers == 1  # preflight: the minimum must fit
