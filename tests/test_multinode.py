"""`fit` across Ray nodes: ranks on different nodes, the same result as on one node."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import REPO


def test_two_workers_on_two_nodes_match_two_workers_on_one(three_nodes, fitted, tiny_mnist,
                                                           tmp_path):
    cluster, nodes = three_nodes
    train, packed = fitted["cfg"].train, fitted["summary"]  # 2 workers on one local node
    spread_run = subprocess.run(
        [sys.executable, "-m", "raytrain_mnist.fit", "--address", cluster.address,
         "--num-workers", "2", "--cpus-per-worker", "1", "--placement-strategy",
         "STRICT_SPREAD", "--epochs", str(train.epochs), "--batch-size", str(train.batch_size),
         "--lr", str(train.lr), "--seed", str(train.seed), "--dataset", "mnist",
         "--data-dir", str(tiny_mnist), "--storage-path", str(tmp_path), "--name", "spread"],
        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert spread_run.returncode == 0, spread_run.stdout[-3000:] + spread_run.stderr[-3000:]
    spread = json.loads((tmp_path / "spread" / "summary.json").read_text())
    assert spread["config"]["train"] == packed["config"]["train"]

    # Where each rank ran, as summary.json says.
    spread_nodes = {w["rank"]: w["node_id"] for w in spread["workers"]}
    packed_nodes = {w["rank"]: w["node_id"] for w in packed["workers"]}
    assert set(spread_nodes) == set(packed_nodes) == {0, 1}
    assert len(set(spread_nodes.values())) == 2, spread["workers"]
    assert set(spread_nodes.values()) <= {node.node_id for node in nodes}
    assert len(set(packed_nodes.values())) == 1, packed["workers"]
    assert all(w["node_ip"] for w in spread["workers"])

    # Same seed, same world size, same data: the nodes make no difference (Gloo sums two
    # gradients the same way whichever hosts them).
    assert spread["status"] == packed["status"] == "finished"
    assert spread["val_total"] == packed["val_total"] == 203
    assert abs(spread["val_accuracy"] - packed["val_accuracy"]) <= 1e-6
    for a, b in zip(spread["history"], packed["history"], strict=True):
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-6 * max(1.0, abs(b["train_loss"]))
        assert abs(a["val_loss"] - b["val_loss"]) <= 1e-6 * max(1.0, abs(b["val_loss"]))
