"""`fit` across Ray nodes: ranks on different nodes, the same result as on one node.

The cluster (``ray.cluster_utils.Cluster``: several raylets on this machine) lives in a
subprocess of its own, with ``RAY_TMPDIR`` pointing at a private directory: Cluster records
its address in ``$RAY_TMPDIR/ray/ray_current_cluster``, where a plain ``ray.init()`` anywhere
else on the machine would otherwise find it and join it. Every process of that cluster carries
a marker in its environment; the test kills what outlives the subprocess, and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from .conftest import REPO, write_tiny_mnist
from .test_submit import MARKER_VAR, free_ports, kill_marked

_RUN = ("import json, sys; from tests.test_multinode import runs_on_two_nodes; "
        "print('RESULT', json.dumps(runs_on_two_nodes(json.loads(sys.argv[1]))))")


def runs_on_two_nodes(spec: dict) -> dict:
    """In the subprocess: a 2-CPU head and a 1-CPU node; the same fit spread, then packed."""
    import ray
    from ray.cluster_utils import Cluster

    from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig
    from raytrain_mnist.fit import fit

    head_args = {"num_cpus": 2, "include_dashboard": False,
                 "dashboard_agent_listen_port": spec["agent_port"]}
    try:
        cluster = Cluster(initialize_head=True, head_node_args=head_args)
    except Exception:  # Ray gives a head 30 s to register; a loaded machine can miss that
        from tests.test_submit import free_ports

        head_args["dashboard_agent_listen_port"] = free_ports(1)[0]
        cluster = Cluster(initialize_head=True, head_node_args=head_args)
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        results = {"nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])}
        for name, strategy in (("spread", "STRICT_SPREAD"), ("packed", "PACK")):
            cfg = FitConfig(
                TrainConfig(epochs=1, batch_size=32, lr=0.05, seed=3),
                RunSettings(num_workers=2, cpus_per_worker=1, data_dir=spec["data"],
                            dataset="mnist", storage_path=spec["storage"], name=name,
                            placement_strategy=strategy))
            results[name] = fit(cfg)
        return results
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_two_workers_on_two_nodes_match_two_workers_on_one(sample_digits):
    root = Path(tempfile.mkdtemp(prefix="rtmn", dir="/tmp"))  # short: Ray's socket paths
    marker = uuid.uuid4().hex
    spec = {"data": str(write_tiny_mnist(root / "data", sample_digits)),
            "storage": str(root / "runs"), "agent_port": free_ports(1)[0]}
    env = {**os.environ, MARKER_VAR: marker, "RAY_TMPDIR": str(root)}
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run([sys.executable, "-c", _RUN, json.dumps(spec)], env=env,
                              cwd=REPO, capture_output=True, text=True, timeout=400)
    finally:
        kill_marked(marker)
        leftover = (root / "ray" / "ray_current_cluster").exists()
        shutil.rmtree(root, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert not leftover, "the cluster's address file outlived it"
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    results = json.loads(line[len("RESULT "):])
    spread, packed = results["spread"], results["packed"]
    assert len(results["nodes"]) == 2

    # Where each rank ran, as summary.json says.
    spread_nodes = {w["rank"]: w["node_id"] for w in spread["workers"]}
    packed_nodes = {w["rank"]: w["node_id"] for w in packed["workers"]}
    assert set(spread_nodes) == set(packed_nodes) == {0, 1}
    assert len(set(spread_nodes.values())) == 2, spread["workers"]
    assert set(spread_nodes.values()) == set(results["nodes"])
    assert len(set(packed_nodes.values())) == 1, packed["workers"]
    assert all(w["node_ip"] for w in spread["workers"])

    # Same seed, same world size, same data: the nodes make no difference (Gloo sums two
    # gradients the same way whichever hosts them).
    assert spread["status"] == packed["status"] == "finished"
    assert spread["val_total"] == packed["val_total"] == 203
    assert abs(spread["val_accuracy"] - packed["val_accuracy"]) <= 1e-6
    for a, b in zip(spread["history"], packed["history"]):
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-6 * max(1.0, abs(b["train_loss"]))
        assert abs(a["val_loss"] - b["val_loss"]) <= 1e-6 * max(1.0, abs(b["val_loss"]))
