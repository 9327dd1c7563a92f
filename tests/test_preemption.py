"""Preemption on real Ray: a node drained with a notice (a spot reclaim) costs at most a
step, and the run ends with the weights of a run never interrupted.

The cluster is conftest's ``two_nodes`` (a head that trains nothing, two 1-CPU nodes); the
calm reference is conftest's ``fitted`` (the same training settings, 2 workers on one
node). ``fit`` runs as a subprocess, drains go through the GCS drain API (what ``ray
drain-node`` calls, here in this process), and every wait is on an event: a printed line, a
committed checkpoint.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from raytrain_mnist.driver.runs import Run
from raytrain_mnist.nn import checkpoint as ckpt
from raytrain_mnist.worker.preempt import JustInTime
from tests.conftest import REPO, wait_for

# The tests' Rays run without Ray Train's preemption watcher (conftest: LOCAL_TRAIN_ENV, as
# fit's own one-machine Ray does); these runs turn it on, polling each second instead of 5.
# Ray Train hands its RAY_TRAIN_* variables from the driver to its controller.
ENV = {
    **os.environ,
    "PYTHONUNBUFFERED": "1",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1",
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1",
}
#: A short notice's: Ray's watcher and the ranks' checks (worker/preempt.py) more often.
NOTICE_ENV = {
    **ENV,
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.25",
    "RAYTRAIN_MNIST_PREEMPTION_CHECK_S": "0.1",
}


class _Fit:
    """``python -m raytrain_mnist.fit ARGS``; its lines read on a thread."""

    module = "raytrain_mnist.fit"

    def __init__(self, args: list[str], env: dict | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env=env or ENV,
        )
        self.lines: list[str] = []
        self._new: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._new.put(line)
        self._new.put(None)

    def until(self, prefix: str, timeout: float = 300) -> str:
        """The first line (from now) that starts with ``prefix``."""
        return self._first(lambda line: line.startswith(prefix), prefix, timeout)

    def until_in(self, text: str, timeout: float = 300) -> str:
        """The first line (from now) that holds ``text``."""
        return self._first(lambda line: text in line, text, timeout)

    def _first(self, match, what: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._new.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                line = ""
            if line is None or time.monotonic() > deadline:
                raise AssertionError(f"never printed {what!r}:\n{self.out}")
            if match(line):
                return line

    def wait_for(self, predicate, what: str, timeout: float = 120):
        """conftest's ``wait_for``, with what the command printed when it times out."""
        try:
            return wait_for(predicate, what, timeout)
        except AssertionError as timed_out:
            raise AssertionError(f"{timed_out}; it printed:\n{self.out}") from None

    def wait(self, timeout: float = 400) -> str:
        self.proc.wait(timeout)
        time.sleep(0.2)
        return self.out

    @property
    def out(self) -> str:
        return "".join(self.lines)


def _args(cluster, tiny_mnist, storage, name: str, train, *extra: str) -> list[str]:
    return [
        "--address", cluster.address, "--num-workers", "2", "--cpus-per-worker", "1",
        "--placement-strategy", "STRICT_SPREAD", "--epochs", str(train.epochs),
        "--batch-size", str(train.batch_size), "--lr", str(train.lr), "--seed", str(train.seed),
        "--dataset", "mnist", "--data-dir", str(tiny_mnist), "--storage-path", str(storage),
        "--name", name, "--keep-checkpoints", "2", "--progress", "lines", *extra,
    ]  # fmt: skip


def _notice(run_dir: Path) -> float:
    """A notice given once the second of 8 epochs is committed: one and a half times the
    fastest epoch the run's checkpoints record (at least 3 s), so that the final checkpoint
    comes while the tiny run still trains: its six epochs left would each have to run four
    times faster than its fastest yet to end first. Timed on the time between two printed
    epochs instead, a busy machine that slowed the second epoch to 8.8 s gave a 13 s notice,
    and the next six epochs (1.5-2.3 s each) ended the run before it (2026-12-06 17:15)."""
    times = _epoch_times(run_dir)
    assert len(times) >= 2, times
    return max(3.0, 1.5 * min(times))


def _epoch_times(run_dir: Path) -> list[float]:
    """The training seconds of each epoch behind the run's kept checkpoints."""
    results = _snapshot(run_dir).get("checkpoint_results") or []
    return [r["metrics"]["epoch_time_s"] for r in results if "epoch_time_s" in r["metrics"]]


def _short_notice(run: _Fit, run_dir: Path) -> float:
    """:func:`_notice`, once the run has committed its second epoch."""
    run.wait_for(lambda: _reached(run_dir, 2), "the second epoch", timeout=300)
    return _notice(run_dir)


def _drain(cluster, node_id: str, reason: str, deadline_s: float | None = None) -> tuple[bool, str]:
    """Drain ``node_id`` through the GCS drain API, as ``ray drain-node`` does (in this
    process: the CLI's own start-up would take seconds of a run that lasts few)."""
    import ray._raylet
    from ray.core.generated import autoscaler_pb2

    deadline_ms = 0 if deadline_s is None else time.time_ns() // 1_000_000 + int(deadline_s * 1000)
    client = ray._raylet.GcsClient(address=cluster.address)
    accepted, rejection = client.drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value(reason), "test", deadline_ms
    )
    return accepted, rejection


def _ranks_by_node(run_dir: Path, timeout: float = 120) -> dict[int, str]:
    """Rank -> node id of the workers behind the latest committed checkpoint."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        latest = _latest(run_dir)
        if latest and latest.get("workers"):
            return {w["rank"]: w["node_id"] for w in latest["workers"]}
        time.sleep(0.2)
    raise AssertionError(f"no committed epoch in {run_dir}")


def _snapshot(run_dir: Path) -> dict:
    """Ray Train's record of the run's committed checkpoints ({} before the first)."""
    try:
        return json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return {}


def _latest(run_dir: Path) -> dict | None:
    """The metrics of the latest committed checkpoint (None until there is one)."""
    latest = _snapshot(run_dir).get("latest_checkpoint_result")
    return latest["metrics"] if latest else None


def _final_checkpoint(run_dir: Path) -> dict | None:
    """The metrics of the final just-in-time checkpoint, once committed (None before)."""
    m = _latest(run_dir)
    return m if m and m.get("progress") == "checkpoint" and m["final"] else None


def _replace(cluster, nodes, node_id: str) -> None:
    """Remove the node ``node_id`` (its raylet and workers), add a fresh 1-CPU one."""
    from raytrain_mnist.driver.cluster import loopback_node

    node = next(n for n in nodes if n.node_id == node_id)
    cluster.remove_node(node)
    nodes.remove(node)
    with loopback_node():
        nodes.append(cluster.add_node(num_cpus=1))
    cluster.wait_for_nodes()


def test_a_preempted_node_costs_at_most_a_step_and_the_run_ends_as_a_calm_one(
    two_nodes, fitted, tiny_mnist, tmp_path
):
    """After the second epoch, the node of rank 1 is drained for idle termination (refused:
    it runs a rank; nothing happens), then for preemption, and removed once the final
    just-in-time checkpoint is committed. The run resumes from that very step and ends with
    the weights of ``fitted``, bit for bit.

    The notice is short, so that the final checkpoint comes while the tiny run still
    trains however fast this machine is (:func:`_notice`; ranks check every 0.1 s of
    training here, Ray's watcher polls every 0.25 s). Once rank 0 holds at the final
    checkpoint, nothing more happens until the node goes: the rest waits on events."""
    cluster, nodes = two_nodes
    train, calm = fitted["cfg"].train, fitted["summary"]
    run = _Fit(_args(cluster, tiny_mnist, tmp_path, "spot", train), NOTICE_ENV)
    run_dir = tmp_path / "spot"
    notice_s = _short_notice(run, run_dir)
    node = _ranks_by_node(run_dir)[1]

    # Ray refuses the idle drain of a node running a rank; the summary's one preemption
    # below shows it checkpointed nothing.
    accepted, rejection = _drain(cluster, node, "DRAIN_NODE_REASON_IDLE_TERMINATION")
    assert not accepted and rejection, "an idle drain of a node running a rank is refused"
    accepted, rejection = _drain(cluster, node, "DRAIN_NODE_REASON_PREEMPTION", notice_s)
    assert accepted, rejection
    seen = run.until("preemption: node ")
    assert node[:12] in seen and "rank(s) 1" in seen

    final = run.wait_for(lambda: _final_checkpoint(run_dir), "the final just-in-time checkpoint")
    _replace(cluster, nodes, node)
    resumed = run.until("resumed after the preemption from ")
    out = run.wait()
    assert run.proc.returncode == 0, out
    assert "Traceback" not in out

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["epochs_completed"] == 8
    print(json.dumps(summary["preemptions"]), out)  # shown when an assertion fails
    [event] = summary["preemptions"]
    assert event["node"] == node and event["ranks"] == [1]
    assert 0 < event["deadline_s"] <= notice_s
    assert (event["epoch"], event["step"]) == (final["epoch"] + 1, final["step"])
    assert event["resumed_from"] == {"epoch": event["epoch"], "step": event["step"]}
    assert event["checkpoint"] and event["lost_steps"] <= 1
    assert f"step {event['step']} of epoch {event['epoch']}" in resumed
    assert summary["worker_restarts"] == 1
    assert [h["epoch"] for h in summary["history"]] == list(range(1, 9))

    # Bit for bit the calm run's: model, optimizer, schedule, sampler and RNG came back at
    # that step, and Gloo sums two ranks' gradients the same way whichever nodes hold them.
    hurt_state = ckpt.load(summary["latest_checkpoint"])
    calm_state = ckpt.load(calm["latest_checkpoint"])
    for key, value in calm_state["model"].items():
        assert torch.equal(hurt_state["model"][key], value), key
    assert summary["val_accuracy"] == calm["val_accuracy"]


def test_a_tune_trial_on_a_preempted_node_resumes_from_its_just_in_time_checkpoint(
    two_nodes, fitted, tiny_mnist, tmp_path
):
    """One trial with the calm run's settings, its two workers on two 1-CPU nodes; a third
    holds the trial actor (0.01 CPU: no room left there for a worker). After the trial's
    second epoch rank 1's node is preempted: the trial's Train run checkpoints just in time,
    Ray Train resumes it from that step inside the trial, and the trial ends with the
    weights of ``fitted``, bit for bit: Tune charged it nothing."""
    from raytrain_mnist.driver.cluster import loopback_node

    cluster, nodes = two_nodes
    with loopback_node():
        nodes.append(cluster.add_node(num_cpus=1))
    cluster.wait_for_nodes()
    train, calm = fitted["cfg"].train, fitted["summary"]
    flags = _args(cluster, tiny_mnist, tmp_path, "spot-tune", train)
    epochs = flags.index("--epochs")
    flags[epochs : epochs + 2] = ["--max-epochs", str(train.epochs)]
    fixed = ["--momentum", str(train.momentum), "--weight-decay", str(train.weight_decay)]
    search = _Tune([*flags, *fixed, "--num-samples", "1", "--scheduler", "fifo"], NOTICE_ENV)
    try:
        trial = search.until_in(" started: ").split()[1]
        run_dir = tmp_path / "spot-tune" / "runs" / trial
        search.wait_for(lambda: _reached(run_dir, 2), "the trial's second epoch", timeout=300)
        notice_s = _notice(run_dir)
        node = _ranks_by_node(run_dir)[1]
        accepted, rejection = _drain(cluster, node, "DRAIN_NODE_REASON_PREEMPTION", notice_s)
        assert accepted, rejection

        final = search.wait_for(
            lambda: _final_checkpoint(run_dir), "the trial's final just-in-time checkpoint"
        )
        _replace(cluster, nodes, node)
        out = search.wait()
    finally:
        search.proc.kill()
    assert search.proc.returncode == 0, out
    assert f"trial {trial} finished" in out, out
    record = json.loads((run_dir / "trial.json").read_text())
    assert [h["epoch"] for h in record["history"]] == list(range(1, train.epochs + 1)), record
    # Resumed at the checkpoint's step: an epoch-start resume would train that epoch's first
    # steps twice and end elsewhere.
    assert final["step"] > 0, final
    hurt_state = ckpt.load(Run(run_dir.parent, trial).latest_checkpoint())
    calm_state = ckpt.load(calm["latest_checkpoint"])
    for key, value in calm_state["model"].items():
        assert torch.equal(hurt_state["model"][key], value), key


def test_an_elastic_run_preempted_goes_on_on_the_workers_left_and_says_so(
    two_nodes, fitted, tiny_mnist, tmp_path
):
    """A 1-2 worker run on two nodes: rank 1's node is preempted and not replaced. The run
    checkpoints just in time, resumes at that step on the one worker left, says the run is
    no longer the uninterrupted one's, and ends about as accurate."""
    cluster, nodes = two_nodes
    train, calm = fitted["cfg"].train, fitted["summary"]
    flags = _args(cluster, tiny_mnist, tmp_path, "spot-elastic", train, "--resize-check-s", "2")
    flags[flags.index("--num-workers") + 1] = "1-2"
    run = _Fit(flags, NOTICE_ENV)
    run_dir = tmp_path / "spot-elastic"
    notice_s = _short_notice(run, run_dir)
    node = _ranks_by_node(run_dir)[1]
    try:
        accepted, rejection = _drain(cluster, node, "DRAIN_NODE_REASON_PREEMPTION", notice_s)
        assert accepted, rejection

        final = run.wait_for(
            lambda: _final_checkpoint(run_dir), "the final just-in-time checkpoint"
        )
        gone = next(n for n in nodes if n.node_id == node)
        cluster.remove_node(gone)
        nodes.remove(gone)
        resumed = run.until("resumed after the preemption from ")
        out = run.wait()
    finally:
        run.proc.kill()
    assert run.proc.returncode == 0, out
    assert "(written by 2 worker(s), resumed on 1: not bit-identical)" in resumed, resumed
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["epochs_completed"] == 8, out
    [event] = summary["preemptions"]
    assert event["node"] == node and event["lost_steps"] <= 1, event
    assert (event["epoch"], event["step"]) == (final["epoch"] + 1, final["step"])
    assert event["resumed_from"] == {"epoch": event["epoch"], "step": event["step"]}
    sizes = [h["world_size"] for h in summary["history"]]
    assert sizes[0] == 2 and sizes[-1] == 1, (sizes, out)
    assert [(r["from"], r["to"]) for r in summary["resizes"]] == [(2, 1)], summary["resizes"]
    assert summary["val_accuracy"] >= calm["val_accuracy"] - 0.03, (summary, calm)


class _Tune(_Fit):
    """``python -m raytrain_mnist.tune ARGS``, read as :class:`_Fit` reads a fit."""

    module = "raytrain_mnist.tune"


def _reached(run_dir: Path, epoch: int) -> bool | None:
    """True once the Train run at ``run_dir`` committed ``epoch`` (None before: wait_for)."""
    m = _latest(run_dir)
    return True if m and m.get("progress") != "checkpoint" and m["epoch"] >= epoch else None


def test_with_max_preemptions_0_a_preemption_fails_the_run_in_one_line(
    two_nodes, tiny_mnist, tmp_path
):
    from raytrain_mnist.config import TrainConfig

    cluster, _ = two_nodes
    train = TrainConfig(epochs=30, batch_size=32, lr=0.05)
    run = _Fit(_args(cluster, tiny_mnist, tmp_path, "budget", train, "--max-preemptions", "0"))
    run.until("epoch   1/30")
    node = _ranks_by_node(tmp_path / "budget")[1]
    assert _drain(cluster, node, "DRAIN_NODE_REASON_PREEMPTION", deadline_s=4)[0]
    out = run.wait()
    assert run.proc.returncode == 1, out
    errors = [line for line in out.splitlines() if line.startswith("raytrain-mnist: error:")]
    assert len(errors) == 1 and "preemption" in errors[0], out
    assert "Traceback" not in out


# --------------------------------------------------------------------------- without Ray


class _Info:
    def __init__(self, deadline_s: float, now: float) -> None:
        self.deadline_ms = (now + deadline_s) * 1000
        self.preempted_node_to_ranks = {"n1": [1]}


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Held(Exception):
    pass


def test_checks_come_at_about_the_cadence_and_a_notice_checkpoints_then_holds(monkeypatch):
    """One rank, a fake clock: a check every ~every_s of steps; a notice with 30 s left
    checkpoints at that step, the final one lands when the margin reaches the deadline,
    and then the rank holds."""
    import raytrain_mnist.worker.preempt as preempt

    clock, checks, saves, sent = _Clock(), [], [], []
    answer: list = [None]

    def check():
        checks.append(jit.steps)
        return answer[0]

    def hold(self, step):
        raise _Held(step)

    monkeypatch.setattr(preempt.JustInTime, "_hold", hold)
    # Steps of exactly 5 ms on the cadence's own timer, however loaded the machine is.
    timer = [0.0]
    monkeypatch.setattr(
        preempt, "time", types.SimpleNamespace(perf_counter=lambda: timer[0], time=time.time)
    )
    jit = JustInTime(0, 1, lambda step, sums, final: saves.append((step, final)), check,
                     lambda kind, **item: sent.append(kind), every_s=0.05, clock=clock)  # fmt: skip
    sums = torch.zeros(3)
    for step in range(1, 40):
        timer[0] += 0.005
        jit.after_step(step, sums)
    assert checks[0] == 1 and 3 <= len(checks) <= 20, checks  # ~one per 10 steps of 5 ms
    answer[0] = _Info(30, clock.now)
    step = 40
    while jit.info is None:
        jit.after_step(step, sums)
        step += 1
    assert saves == [(step - 1, False)] and sent[0] == "preemption"
    with pytest.raises(_Held) as held:
        while True:
            clock.now += 1.0  # a step of a second
            jit.after_step(step, sums)
            step += 1
    assert saves[-1] == (held.value.args[0], True)
    assert clock.now + jit._margin_s >= jit.deadline > clock.now - 1.0
    assert sent.count("preempt_step") == step - saves[0][0]  # every step of the notice


def test_a_notice_too_close_to_the_deadline_is_the_final_checkpoint(monkeypatch):
    import raytrain_mnist.worker.preempt as preempt

    clock, saves = _Clock(), []
    monkeypatch.setattr(
        preempt.JustInTime, "_hold", lambda self, step: (_ for _ in ()).throw(_Held())
    )
    jit = JustInTime(0, 1, lambda step, sums, final: saves.append((step, final)),
                     lambda: _Info(0.5, clock.now), clock=clock)  # fmt: skip
    with pytest.raises(_Held):
        jit.after_step(1, torch.zeros(3))
    assert saves == [(1, True)]


def test_the_driver_records_one_entry_per_preemption_and_its_lost_steps():
    from raytrain_mnist.driver.preemptions import PreemptionLog, resume_text

    log = PreemptionLog()
    seen = log.handle(
        {"progress": "preemption", "nodes": {"abcdef0123456789": [1]}, "deadline_s": 14.6,
         "epoch": 3, "step": 12, "steps_per_epoch": 64}
    )  # fmt: skip
    assert seen == (
        "preemption: node abcdef012345 (rank(s) 1) goes in 15 s; checkpoint at step 12 "
        "of epoch 3, training goes on"
    )
    for step in range(13, 41):
        log.handle({"progress": "preempt_step", "epoch": 3, "step": step})
    log.handle({"progress": "checkpoint", "epoch": 2, "step": 40, "checkpoint": "/c"})
    log.handle({"progress": "holding", "epoch": 3, "step": 40})
    line = log.resumed({"progress": "ready", "resumed_from_epoch": 2, "resumed_from_step": 40})
    assert line == "resumed after the preemption from step 40 of epoch 3: 0 step(s) trained again"
    [entry] = log.entries
    assert entry["node"] == "abcdef0123456789" and entry["ranks"] == [1]
    assert (entry["epoch"], entry["step"], entry["checkpoint"]) == (3, 40, "/c")
    assert entry["lost_steps"] == 0 and entry["resumed_from"] == {"epoch": 3, "step": 40}
    # A restart with no preemption open is not one.
    assert log.resumed({"progress": "ready", "resumed_from_epoch": 3}) is None
    # A node gone before the final checkpoint: what was trained since the last one is lost.
    log.handle({"progress": "preemption", "nodes": {"n2": [0]}, "deadline_s": 9,
                "epoch": 5, "step": 60, "steps_per_epoch": 64})  # fmt: skip
    log.handle({"progress": "preempt_step", "epoch": 6, "step": 3})
    log.resumed({"progress": "ready", "resumed_from_epoch": 4, "resumed_from_step": 60})
    assert log.entries[-1]["lost_steps"] == 7
    # An elastic run that resumes on the workers left says it is no longer the same run.
    log.handle({"progress": "preemption", "nodes": {"n3": [1]}, "deadline_s": 9,
                "epoch": 6, "step": 8, "steps_per_epoch": 64})  # fmt: skip
    line = log.resumed({"progress": "ready", "resumed_from_epoch": 5, "resumed_from_step": 8,
                        "resumed_world_size": 2, "world_size": 1})  # fmt: skip
    assert line.endswith("(written by 2 worker(s), resumed on 1: not bit-identical)"), line
    assert resume_text({"resumed_from_epoch": 2, "resumed_from_step": 0}) == (
        "resumed from the checkpoint of epoch 2"
    )
    assert resume_text(
        {"resumed_from_epoch": 2, "resumed_from_step": 5, "resumed_world_size": 2, "world_size": 1}
    ) == (
        "resumed from the checkpoint at step 5 of epoch 3 (written by 2 worker(s), resumed "
        "on 1: not bit-identical)"
    )
    assert resume_text({"resumed_from_epoch": None}) is None
