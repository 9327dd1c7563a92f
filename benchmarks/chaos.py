"""Training under repeated faults: the weights of a calm run, whatever is killed on the way.

    python -m benchmarks.chaos [--kills 3] [--preemptions 1] [--notice-s 20] [--seed 0]
        [--epochs 8] [--out benchmarks/results] [--storage DIR]

One multi-node Ray on this machine (``ray.cluster_utils.Cluster``: a head that hosts no
training and three 1-CPU nodes, everything on 127.0.0.1, the head's dashboard on a free
loopback port for Ray's state API). On it, the library's :func:`raytrain_mnist.driver.fit`
(what ``fit --address`` runs) trains the same seeded run twice, 2 workers, on a small MNIST
(2,048 training digits of the bundled sample, as the test suite's ``tiny_mnist``):

* **calm**: nothing happens to it;
* **chaos**: ``--kills`` times a worker process is SIGKILLed, and once a whole node (its
  raylet, its workers) is removed and a fresh one added, at points a seeded RNG draws:
  an epoch and a share of that epoch's images, read from rank 0's progress stream. The
  process to kill is found through Ray's state API (``ray.util.state.list_actors``: the
  ``RayTrainWorker`` actors alive), and only a process whose environment carries this
  script's marker is ever signalled: nothing of another Ray. ``--max-failures`` is the
  number of faults plus one;
* and ``--preemptions`` times a node that hosts a rank is drained for preemption with
  ``--notice-s`` seconds of notice (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``,
  as ``raytrain_mnist.spot`` turns a spot notice into), then removed at the deadline and a
  fresh node added: the run checkpoints just in time and resumes from that step.

The chaos run must end with the calm run's weights (``state.pt`` tensors compared as
``tests/test_resilience.py`` does, and bit for bit); the benchmark reports the faults, the
worker-group restarts the run saw (``summary.json``'s ``worker_restarts``), and the seconds
each fault cost: wall time against the calm run, split per fault into the restart (kill to
the restarted group's first step) and the work trained again (the killed epoch's images
done since its last checkpoint; for a preemption, the steps its summary says were trained
again and the seconds from the node's removal to the restarted group's first step). Writes
``chaos.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
#: Every process of the Ray this script starts carries ``MARKER_VAR=<marker>``.
MARKER_VAR = "RAYTRAIN_MNIST_BENCH_CLUSTER"
WORKER_CLASS = "RayTrainWorker"


def tiny_mnist(root: Path, n_train: int = 2048, n_test: int = 203) -> Path:
    """The test suite's small MNIST: genuine digits of the bundled sample, shuffled."""
    from raytrain_mnist.data import load_sample, write_idx

    data = load_sample()
    order = np.random.default_rng(0).permutation(data.train_size)
    images, labels = data.train_images[order], data.train_labels[order]
    raw = root / "MNIST" / "raw"
    write_idx(raw, images[:n_train], labels[:n_train], "train")
    write_idx(raw, images[n_train : n_train + n_test], labels[n_train : n_train + n_test], "test")
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours(pid: int, marker: str) -> bool:
    """Whether ``pid`` belongs to the Ray this script started (it carries the marker)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{MARKER_VAR}={marker}".encode() in environ


def marked(marker: str) -> list[int]:
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and int(p.name) != os.getpid() and ours(int(p.name), marker)
    ]


class Chaos:
    """Draws the faults and deals them while a run trains.

    ``on_event`` is the run's event sink: it timestamps what the run says and, when rank 0's
    progress passes the next drawn point (an epoch and a share of its images), queues the
    fault (the sink returns at once, as a sink must). :meth:`deal_while` runs on the main
    thread (``Cluster.remove_node`` and ``add_node`` need it): it finds each victim through
    the state API and kills it. The next point is armed once the run has said "workers
    restarted": one fault per worker group."""

    def __init__(
        self, cluster, nodes, api: str, marker: str, plan: list[dict], seed: int, notice_s=20
    ):
        self.cluster, self.nodes, self.api, self.marker = cluster, nodes, api, marker
        self.notice_s = notice_s
        self.plan, self.rng = plan, random.Random(seed + 1)
        self.dealt: list[dict] = []
        self.events: list[tuple[float, str, str]] = []  # (time, kind, text)
        self.steps: list[tuple[float, int, int, int]] = []  # (time, epoch, images, total)
        self._next = 0
        self._armed = True
        self._queue: queue.Queue = queue.Queue()

    def on_event(self, event) -> None:
        from raytrain_mnist.driver.events import Note, StepProgress

        now = time.perf_counter()
        if isinstance(event, StepProgress):
            i = event.item
            self.steps.append((now, i["epoch"], i["images"], i["total"]))
            point = self.plan[self._next] if self._next < len(self.plan) else None
            share = i["images"] / max(i["total"], 1)
            passed = point is not None and (
                i["epoch"] > point["epoch"]
                or (i["epoch"] == point["epoch"] and share >= point["share"])
            )
            if self._armed and passed:
                self._armed = False
                self._next += 1
                self._queue.put((point, now, i["epoch"], i["images"], i["total"]))
            return
        text = getattr(event, "text", str(event))
        self.events.append((now, type(event).__name__, text))
        print(f"  [{type(event).__name__}] {text}", flush=True)
        if isinstance(event, Note) and text.startswith(("workers restarted", "resumed after")):
            self._armed = True
            if self.dealt and "restart_note_at" not in self.dealt[-1]:
                self.dealt[-1].update(restart_note_at=now, restart_note=text)

    def _workers(self) -> list:
        from ray.util.state import list_actors

        return sorted(
            list_actors(
                address=self.api,
                filters=[("class_name", "=", WORKER_CLASS), ("state", "=", "ALIVE")],
                timeout=30,
            ),
            key=lambda a: a.pid,
        )

    def deal_while(self, running: threading.Thread) -> None:
        """Deal the queued faults until ``running`` (the run's thread) ends."""
        while running.is_alive():
            try:
                point, seen_at, epoch, images, total = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            record = {**point, "at_epoch": epoch, "at_images": images, "epoch_images": total}
            record["seen_at"] = seen_at
            self.dealt.append(record)  # before the kill: its restart is noted on this record
            try:
                workers = [w for w in self._workers() if ours(w.pid, self.marker)]
                if not workers:
                    raise RuntimeError("no live worker of ours to hurt")
                victim = self.rng.choice(workers)
                if point["kind"] == "worker":
                    record.update(pid=victim.pid, node_id=victim.node_id)
                    os.kill(victim.pid, signal.SIGKILL)
                    record["dealt_at"] = time.perf_counter()
                elif point["kind"] == "preempt":
                    record.update(self._preempt_node(victim, workers))
                else:
                    record.update(self._remove_node(victim, workers))
            except Exception as exc:  # reported in the results; the run goes on
                record["error"] = f"{exc.__class__.__name__}: {exc}"
            print(f"  [chaos] {json.dumps({k: v for k, v in record.items()})}", flush=True)

    def _training_node(self, victim, workers) -> str:
        """A node that hosts a training worker and nothing else of the run (the controller
        and the driver's own actors live on the head)."""
        import ray
        from ray.util.state import list_actors

        alive = list_actors(address=self.api, filters=[("state", "=", "ALIVE")], timeout=30)
        others = {a.node_id for a in alive if a.class_name != WORKER_CLASS}
        others.add(ray.get_runtime_context().get_node_id())  # the driver's node stays
        candidates = [w for w in [victim, *workers] if w.node_id not in others]
        if not candidates:
            raise RuntimeError("every worker's node also hosts another actor of the run")
        return candidates[0].node_id

    def _preempt_node(self, victim, workers) -> dict:
        """Drain a training node for preemption with ``notice_s`` of notice, as a spot
        reclaim is announced; remove it at the deadline (the cloud takes it) and add a
        fresh one."""
        node_id = self._training_node(victim, workers)
        words = [str(Path(sys.executable).with_name("ray")), "drain-node", "--address",
                 self.cluster.address, "--node-id", node_id, "--reason",
                 "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "chaos",
                 "--deadline-remaining-seconds", str(self.notice_s)]  # fmt: skip
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        done = subprocess.run(words, capture_output=True, text=True, env=env, timeout=120)
        # The CLI set the deadline as it sent the drain, after its own start-up (seconds on
        # a loaded machine): the notice counts from its return, at most that late.
        drained_at = time.perf_counter()
        if done.returncode:
            raise RuntimeError(f"ray drain-node: {done.stderr.strip()[-300:]}")
        time.sleep(self.notice_s)
        node = next(n for n in self.nodes if n.node_id == node_id)
        pids = [w.pid for w in workers if w.node_id == node_id]
        self.cluster.remove_node(node, allow_graceful=False)  # the deadline: the node goes
        removed_at = time.perf_counter()
        self.nodes.remove(node)
        self.nodes.append(self.cluster.add_node(num_cpus=1))
        return {"node_id": node_id, "pids": pids, "dealt_at": drained_at, "removed_at": removed_at}

    def _remove_node(self, victim, workers) -> dict:
        """Remove a node that hosts a training worker and nothing else of the run, then
        add a fresh one."""
        node_id = self._training_node(victim, workers)
        node = next(n for n in self.nodes if n.node_id == node_id)
        pids = [w.pid for w in workers if w.node_id == node_id]
        self.cluster.remove_node(node, allow_graceful=False)  # as a machine dies: SIGKILL
        dealt_at = time.perf_counter()
        self.nodes.remove(node)
        self.nodes.append(self.cluster.add_node(num_cpus=1))
        return {"node_id": node_id, "pids": pids, "dealt_at": dealt_at}


def draw_plan(rng: random.Random, kills: int, epochs: int, preemptions: int = 0) -> list[dict]:
    """``kills`` worker kills, one node loss and ``preemptions`` drains at random points,
    in the order they come: an epoch (1..epochs) and a share of its images (0.15-0.85)."""
    kinds = ["worker"] * kills + ["node"] + ["preempt"] * preemptions
    rng.shuffle(kinds)
    points = sorted(
        (rng.randint(1, epochs), round(rng.uniform(0.15, 0.85), 3)) for _ in range(len(kinds))
    )
    return [{"kind": k, "epoch": e, "share": s} for k, (e, s) in zip(kinds, points, strict=True)]


def compare(calm: dict, hurt: dict) -> dict:
    """The chaos run's weights against the calm run's: as tests/test_resilience.py checks
    (assert_close, rtol 1e-5, atol 1e-6), and bit for bit."""
    import torch

    from raytrain_mnist.nn import checkpoint as ckpt

    a, b = ckpt.load(calm["latest_checkpoint"]), ckpt.load(hurt["latest_checkpoint"])
    close, exact, worst = True, True, 0.0
    for key, value in a["model"].items():
        other = b["model"][key]
        exact &= torch.equal(value, other)
        try:
            torch.testing.assert_close(other, value, rtol=1e-5, atol=1e-6)
        except AssertionError:
            close = False
        if value.is_floating_point():
            worst = max(worst, float((value - other).abs().max()))
    return {
        "tensors": len(a["model"]),
        "assert_close": close,
        "bit_for_bit": exact,
        "max_abs_diff": worst,
        "val_accuracy_equal": calm["val_accuracy"] == hurt["val_accuracy"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=3, help="worker processes killed")
    parser.add_argument("--preemptions", type=int, default=1, help="nodes drained, then lost")
    parser.add_argument("--notice-s", type=int, default=20, help="a preemption's notice")
    parser.add_argument("--seed", type=int, default=0, help="seed of the faults (and the run)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--storage", help="where the two runs are kept (default: a temp dir)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)

    # Only the Ray this script starts: no address or API server from the environment.
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        os.environ.pop(var, None)
    marker = uuid.uuid4().hex
    os.environ[MARKER_VAR] = marker  # inherited by every process of the cluster below
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from raytrain_mnist.driver.cluster import LOCAL_TRAIN_ENV, LOOPBACK, loopback_node

    for key, value in LOCAL_TRAIN_ENV.items():
        os.environ.setdefault(key, value)
    if args.preemptions:  # Ray Train's watcher tells the run: fit's own Ray turns it off
        os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "1"

    import logging

    import ray
    from ray.cluster_utils import Cluster

    from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig
    from raytrain_mnist.driver import fit

    logging.getLogger("ray").setLevel(logging.WARNING)
    rng = random.Random(args.seed)
    plan = draw_plan(rng, args.kills, args.epochs, args.preemptions)
    faults = len(plan)
    dashboard_port = free_port()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chaos-")))
        storage = Path(args.storage) if args.storage else tmp / "runs"
        data_dir = tiny_mnist(tmp / "data")
        with loopback_node():
            cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": 0,
                    "include_dashboard": True,
                    "dashboard_host": "127.0.0.1",
                    "dashboard_port": dashboard_port,
                },
            )
            nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
        stack.callback(_stop, cluster, marker)
        cluster.wait_for_nodes()
        api = f"http://127.0.0.1:{dashboard_port}"
        train_cfg = TrainConfig(epochs=args.epochs, batch_size=32, lr=0.05, seed=args.seed)

        def settings(name: str) -> RunSettings:
            return RunSettings.from_flags(
                num_workers=2,
                cpus_per_worker=1,
                data_dir=str(data_dir),
                dataset="mnist",
                keep_checkpoints=2,
                storage_path=str(storage),
                name=name,
                address=cluster.address,
                max_failures=faults + 1,
            )

        # This process joins the cluster once, on the main thread (fit then uses the Ray it
        # finds, as in a notebook), so that fit can train on a thread while the main
        # thread removes and adds nodes.
        with loopback_node():
            ray.init(
                address=cluster.address,
                _node_ip_address=LOOPBACK,
                logging_level="WARNING",
                log_to_driver=False,
            )
        stack.callback(ray.shutdown)
        runs = {}
        for name, chaos_plan in (("calm", []), ("chaos", plan)):
            print(f"{name}: {json.dumps(chaos_plan)}", flush=True)
            chaos = Chaos(cluster, nodes, api, marker, chaos_plan, args.seed, args.notice_s)
            outcome: dict = {}

            def train(name=name, chaos=chaos, outcome=outcome) -> None:
                try:
                    outcome["result"] = fit(FitConfig(train_cfg, settings(name)), chaos.on_event)
                except BaseException as exc:  # handed to the main thread
                    outcome["error"] = exc

            started = time.perf_counter()
            thread = threading.Thread(target=train, name=f"fit {name}")
            thread.start()
            chaos.deal_while(thread)
            thread.join()
            wall = time.perf_counter() - started
            if "error" in outcome:
                raise outcome["error"]
            result = outcome["result"]
            if result.status != "finished":
                raise SystemExit(f"{name} run ended {result.status}: {result.error}")
            runs[name] = {"result": result, "wall": wall, "chaos": chaos}
            print(f"{name}: {wall:.1f} s, {result.summary['worker_restarts']} restart(s)")

        calm, hurt = runs["calm"], runs["chaos"]
        weights = compare(calm["result"].summary, hurt["result"].summary)
        per_fault = _per_fault(hurt["chaos"], calm, hurt["result"].summary)
        lost = hurt["wall"] - calm["wall"]
        report = {
            "meta": {
                "command": "python -m benchmarks.chaos " + " ".join(argv or sys.argv[1:]),
                "seed": args.seed,
                "data": "2048 train / 203 test digits of the bundled sample (tiny_mnist)",
                "train": train_cfg.to_dict(),
                "workers": 2,
                "cluster": "Cluster: head 0 CPUs (+ dashboard), 3 nodes x 1 CPU, 127.0.0.1",
                "max_failures": faults + 1,
                "health_check_interval_s": float(
                    os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", 2.0)
                ),
                "cpus": os.cpu_count(),
                "load_average_start": round(os.getloadavg()[0], 1),
                "python": platform.python_version(),
                "ray": ray.__version__,
                "when": time.strftime("%Y-%m-%d %H:%M"),
            },
            "plan": plan,
            "K_worker_kills": args.kills,
            "node_losses": 1,
            "preemptions": args.preemptions,
            "notice_s": args.notice_s,
            "per_kind": _per_kind(per_fault),
            "check_cost": _check_cost(calm["result"].summary),
            "faults": faults,
            "worker_restarts": hurt["result"].summary["worker_restarts"],
            "calm_wall_s": round(calm["wall"], 1),
            "chaos_wall_s": round(hurt["wall"], 1),
            "seconds_lost": round(lost, 1),
            "seconds_lost_per_fault": round(lost / faults, 1),
            "per_fault": per_fault,
            "weights": weights,
            "val_accuracy": hurt["result"].summary["val_accuracy"],
        }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "per_fault"}, indent=2))
    print(f"wrote {out / 'chaos.json'}")
    return 0 if weights["assert_close"] else 1


def _per_kind(rows: list[dict]) -> dict:
    """Steps and seconds lost per fault, by kind: the mean over that kind's faults of the
    steps trained again and of the seconds from the fault (a preemption: the node's
    removal) to the restarted group's first step, and of those plus the work trained again."""
    kinds: dict = {}
    for row in rows:
        kinds.setdefault(row["kind"], []).append(row)
    out = {}
    for kind, found in kinds.items():
        restart = [r["to_first_step_s"] for r in found if r["to_first_step_s"] is not None]
        out[kind] = {
            "faults": len(found),
            "steps_trained_again": _mean([r["steps_trained_again"] for r in found], 2),
            "restart_s": round(float(np.mean(restart)), 1) if restart else None,
            "work_trained_again_s": _mean([r["work_trained_again_s"] for r in found], 1),
        }
    return out


def _mean(values: list, digits: int) -> float | None:
    known = [v for v in values if v is not None]
    return round(float(np.mean(known)), digits) if known else None


def _check_cost(summary: dict) -> dict:
    """What the preemption checks cost the calm run (rank 0's seconds in them against its
    training seconds, over every epoch)."""
    history = summary["history"]
    checks = sum(h.get("preemption_checks", 0) for h in history)
    check_s = sum(h.get("preemption_check_s", 0.0) for h in history)
    train_s = sum(h["train_s"] for h in history)
    return {
        "checks": checks,
        "check_s_total": round(check_s, 3),
        "ms_per_check": round(1000 * check_s / checks, 2) if checks else None,
        "share_of_training": round(check_s / train_s, 5) if train_s else None,
    }


def _per_fault(chaos: Chaos, calm: dict, hurt: dict | None = None) -> list[dict]:
    """Each fault: when it was dealt (epoch, share of its images), how long until the run
    said it restarted and until the restarted group's first step, and the steps it trains
    again (in seconds: at the calm run's median step). A kill trains again the epoch's images
    since the last committed checkpoint; a preemption what its summary entry's
    ``lost_steps`` says, its restart counted from the node's removal (the deadline)."""
    summary = calm["result"].summary
    steps_per_epoch = summary["train_size"] // summary["config"]["train"]["batch_size"]
    step_s = float(np.median([h["train_s"] for h in summary["history"]])) / steps_per_epoch
    preemptions = iter((hurt or {}).get("preemptions", []))
    rows = []
    for record in chaos.dealt:
        dealt = record.get("removed_at") or record.get("dealt_at") or record["seen_at"]
        restart = record.get("restart_note_at")
        after = [t for t, *_ in chaos.steps if t > (restart or dealt)]
        first = after[0] if restart is not None and after else None
        share = record["at_images"] / max(record["epoch_images"], 1)
        note = record.get("restart_note", "")
        if record["kind"] == "preempt":
            entry = next(preemptions, {})
            again_steps = entry.get("lost_steps")
            resumed = entry.get("resumed_from")
        else:
            # "workers restarted from the checkpoint of epoch N": epochs N+1 .. the killed
            # one are trained again (N can lag by one: Ray commits an epoch's checkpoint only
            # once its controller has polled every rank, every 2 s); "... at step S of epoch
            # E": from that step (a preemption's checkpoint was the latest).
            mid = re.search(r"at step (\d+) of epoch (\d+)$", note)
            resumed = (
                int(note.rsplit(" ", 1)[-1]) if note[-1:].isdigit() else record["at_epoch"] - 1
            )
            done_at = (record["at_epoch"] - 1 + share) * steps_per_epoch
            if mid:
                resumed = {"epoch": int(mid[2]), "step": int(mid[1])}
                again_steps = round(done_at - (int(mid[2]) - 1) * steps_per_epoch - int(mid[1]))
            else:
                again_steps = round(done_at - resumed * steps_per_epoch)
        rows.append(
            {
                "kind": record["kind"],
                "epoch": record["at_epoch"],
                "share_of_epoch": round(share, 3),
                "pid": record.get("pid") or record.get("pids"),
                "error": record.get("error"),
                "restart_note_s": None if restart is None else round(restart - dealt, 1),
                "to_first_step_s": None if first is None else round(first - dealt, 1),
                "resumed_from": resumed,
                "steps_trained_again": again_steps,
                "work_trained_again_s": None
                if again_steps is None
                else round(again_steps * step_s, 1),
            }
        )
    return rows


def _stop(cluster, marker: str) -> None:
    """Shut the cluster down, then SIGKILL anything of it that outlived that (ours only)."""
    with contextlib.suppress(Exception):
        cluster.shutdown()
    for pid in marked(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
