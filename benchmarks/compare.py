"""Ray Train against plain PyTorch and torchrun, side by side, in one run.

    python -m benchmarks.compare --data-dir ../shared/data/mnist --out benchmarks/results

Variants (same ConvNet, data, global batch size, optimizer, CPU threads):

    plain         one process, no Ray, no DDP: the floor (all cores as torch threads)
    torchrun      torchrun --nproc_per_node N, DDP over Gloo (1 thread each)
    fit-1         python -m raytrain_mnist.fit --num-workers 1 (all cores as threads)
    fit-N         python -m raytrain_mnist.fit --num-workers N (the default command)
    fit-warm      fit-N with --address 127.0.0.1:PORT of a Ray already running: a
                  `ray start --head` this benchmark starts before the repeats and stops
                  after them (its own temp folder, port and marker; nobody else's Ray)
    fit-preload   fit-warm against a second such head whose worker processes import
                  torch, Ray Train and the worker loop before they take work, and are
                  prestarted when it starts (PRELOAD_HEAD_ENV)
    fit-submit    fit-N as a job: `raytrain-mnist submit -- fit ...` to a third such head
                  with its dashboard (the Jobs API), timed from the submit command's start
                  to its exit, with the job's start and end from the Jobs API
    fit-service   `fit --service` on a warm service (`raytrain-mnist service start`, one
                  worker with every core, the data loaded once) that this benchmark starts
                  before the repeats and stops after them: the run pays for its training
    NAME=VAR=VALUE,...   (--env-variant) fit-N with these variables set in its
                  environment: Ray's knobs side by side, e.g. the controller's poll
                  ``poll-2s=RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=2``
    ray-example   Ray's documented pattern: torchvision dataset, per-sample ToTensor,
                  plain DataLoader, prepare_data_loader (1 worker, all cores as threads)

Every variant is measured at the same end points, from the moment its command starts:
start-up ends at the first optimizer step, time to 99 % at the end of the first evaluation
that reaches 99.0 % test accuracy; wall is the whole command. Also: steady-state images/s
(the last epoch), CPU seconds per training step (user + system of the training process(es)
during the last epoch, summed over ranks: the figure that does not depend on how many cores
the machine has), and the peak memory of the process tree (Ray's processes included).

The repeats are interleaved (plain, torchrun, fit-1, ... then again), so drift hits every
variant alike, and the ratios are *paired*: the median of the per-repeat ratios. A
``--memory`` run of fit-1 (one more, not timed) breaks its peak memory down by process kind.
Writes ``results.json`` and ``results.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

from raytrain_mnist.config import DEFAULT_EPOCHS

REPO = Path(__file__).resolve().parents[1]

#: Process kinds of a fit's process tree, for the memory breakdown.
KINDS = ("driver", "train workers", "other Ray actors", "idle Ray workers", "Ray daemons")


def process_label(cmdline: list[str]) -> str:
    """A short name: Ray's process title (``ray::Class.method``), a Python script or
    module, or a binary's name."""
    if not cmdline:
        return "?"
    first = cmdline[0]
    if first.startswith(("ray::", "ray-")):
        return first.split(" (")[0].strip()
    if "python" in os.path.basename(first):
        for i, arg in enumerate(cmdline[1:], start=1):
            if arg == "-m" and i + 1 < len(cmdline):
                return cmdline[i + 1]
            if arg.endswith(".py"):
                return os.path.basename(arg)
    return os.path.basename(first)


def process_kind(label: str, is_root: bool) -> str:
    """What a process of a fit's tree is, from its label."""
    if is_root:
        return "driver"
    if label.startswith("ray::") and not label.endswith("Agent"):
        if "TrainWorker" in label:
            return "train workers"
        if label.startswith("ray::IDLE"):
            return "idle Ray workers"
        return "other Ray actors"  # the Train controller and its helpers, fit's progress actor
    return "Ray daemons"  # gcs_server, raylet, dashboard and its agents, log monitor


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _tree_rss_mb(pid: int) -> float:
    total = 0
    for proc in _tree(pid):
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def _tree_pss_mb(pid: int) -> list[dict]:
    """Proportional set size of every process of the tree: shared pages (the object store,
    libraries) are split between the processes that map them, so they add up to what the
    tree costs the machine."""
    rows = []
    for proc in _tree(pid):
        try:
            label = process_label(proc.cmdline())
            rows.append(
                {
                    "kind": process_kind(label, proc.pid == pid),
                    "process": label,
                    "pss_mb": _pss_kib(proc) / 1024,
                }
            )
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            pass
    return rows


def _pss_kib(proc: psutil.Process) -> int:
    # smaps_rollup is one line per figure; psutil reads the full smaps, which costs more
    # system time than the processes being measured use.
    try:
        with open(f"/proc/{proc.pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return proc.memory_full_info().pss // 1024


def run_measured(
    command: list[str],
    env: dict,
    breakdown: bool = False,
) -> tuple[subprocess.CompletedProcess, float, float, float, dict | None]:
    """Run ``command``; return (result, start unix time, wall seconds, peak RSS of its
    process tree in MB, and with ``breakdown`` the PSS per process kind at the tree's
    peak)."""
    start = time.time()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**env, "BENCH_T0": repr(start)},
    )
    peak = [0.0]
    peak_rows: list[list[dict] | None] = [None]

    def total(rows):
        return sum(r["pss_mb"] for r in rows or [])

    def sample() -> None:
        while process.poll() is None:
            peak[0] = max(peak[0], _tree_rss_mb(process.pid))
            if breakdown:
                rows = _tree_pss_mb(process.pid)
                if total(rows) > total(peak_rows[0]):
                    peak_rows[0] = rows
            time.sleep(0.5 if breakdown else 0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = process.communicate()
    sampler.join()
    wall = time.time() - start
    result = subprocess.CompletedProcess(command, process.returncode, out, "")
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out[-3000:]}")
    return result, start, wall, peak[0], peak_rows[0]


def _parse_result(out: str) -> dict:
    for line in out.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"no RESULT line in:\n{out[-2000:]}")


def fit_command(args, workers: int, storage: Path, name: str, extra=()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "raytrain_mnist.fit",
        "--num-workers",
        str(workers),
        "--dataset",
        args.dataset,
        "--data-dir",
        args.data_dir,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--storage-path",
        str(storage),
        "--name",
        name,
        *extra,
    ]


def fit_history(summary: dict) -> list[dict]:
    """Every epoch as the loop recorded it (with its timings), from the latest checkpoint;
    summary.json's history keeps only the headline metrics."""
    from raytrain_mnist.nn import checkpoint

    return checkpoint.load(summary["latest_checkpoint"])["history"]


#: Where a command's seconds go, moment to moment: (step, whose, fit's moments it lies
#: between). ``start`` is the benchmark's launch of the command, ``exit`` its end; the others
#: are summary.json's timeline (driver/events.py STARTUP and TEARDOWN). The plain loop's
#: equivalents are in PLAIN_STEPS.
STEPS = [
    ("submit: checks, upload; job accepted", "ours", "submitted", "job_started"),
    ("the job's driver starts (Jobs API)", "Ray", "job_started", "start"),
    ("Python, imports, flags", "ours", "start", "fit_called"),
    ("load the data (fit: torch imported here)", "ours", "fit_called", "data_loaded"),
    ("claim, identity; ray imported", "ours", "data_loaded", "ray_starting"),
    ("ray.init", "Ray", "ray_starting", "ray_ready"),
    ("tracking, channel, data put; Ray Train imported", "ours", "ray_ready", "trainer_started"),
    ("controller actor starts", "Ray", "trainer_started", "controller_started"),
    ("worker actors start", "Ray", "controller_started", "worker_group_started"),
    ("process group", "Ray", "worker_group_started", "process_group_formed"),
    ("data fetch, model, prepare_*", "ours", "process_group_formed", "model_prepared"),
    ("to the first step", "ours", "model_prepared", "first_step"),
    ("training and evaluation", "ours", "first_step", "last_report"),
    ("checkpoint committed", "Ray", "last_report", "checkpoint_committed"),
    ("end seen (controller's poll)", "Ray", "checkpoint_committed", "workers_finished"),
    ("worker group shut down", "Ray", "workers_finished", "worker_group_shut_down"),
    ("controller finishes", "Ray", "worker_group_shut_down", "controller_finished"),
    ("trainer.fit() returns", "Ray", "controller_finished", "fit_returned"),
    ("progress drained, summary", "ours", "fit_returned", "summary_built"),
    ("ray.shutdown (curves, tracking meanwhile)", "Ray", "summary_built", "ray_shut_down"),
    ("curves, tracking: the rest", "ours", "ray_shut_down", "files_written"),
    ("summary.json, print, exit", "ours", "files_written", "exit"),
    ("the job's end seen, submit exits", "Ray", "exit", "submit_exited"),
]
#: The plain loop's steps: the moments its RESULT line gives (benchmarks/variants.py).
PLAIN_STEPS = {
    "Python, imports, flags": ("start", "imported_s"),
    "load the data (fit: torch imported here)": ("imported_s", "data_loaded_s"),
    "data fetch, model, prepare_*": ("data_loaded_s", "model_prepared_s"),
    "to the first step": ("model_prepared_s", "first_step_s"),
    "training and evaluation": ("first_step_s", "last_eval_s"),
    "summary.json, print, exit": ("last_eval_s", "exit"),
}
#: Where start-up ends and teardown begins, in both.
STARTUP_END, TEARDOWN_START = "to the first step", "checkpoint committed"


def _steps(at: dict[str, float], pairs) -> dict[str, float]:
    """Each step's seconds between its two moments, for the steps whose moments are known;
    "unaccounted": the command's wall minus their sum (moments not reached, rounding)."""
    steps = {name: at[b] - at[a] for name, (a, b) in pairs if a in at and b in at}
    wall = at.get("submit_exited", at["exit"]) - at.get("submitted", at["start"])
    steps["unaccounted"] = wall - sum(steps.values())
    return steps


def fit_steps(
    summary: dict, start: float, wall: float, job: dict | None = None
) -> dict[str, float]:
    """A fit's seconds by step (:data:`STEPS`), from its summary's timeline. A submitted
    fit's (``job``: the Jobs API's ``job_started`` and ``job_ended``) runs from the submit
    command's start to its exit, its fit from the job's process start to the job's end."""
    timeline = summary.get("timeline") or {}
    at = {"start": start, "exit": start + wall}
    if job is not None:
        at = {"submitted": start, "submit_exited": start + wall, "start": timeline["t0"]}
        at.update(job_started=job["job_started"], exit=job["job_ended"])
    for part in ("startup_s", "teardown_s"):
        at.update({k: timeline["t0"] + v for k, v in timeline.get(part, {}).items()})
    return _steps(at, [(name, (a, b)) for name, _, a, b in STEPS])


def loop_steps(data: dict, wall: float) -> dict[str, float]:
    """The plain loop's seconds by the same steps (:data:`PLAIN_STEPS`)."""
    at = {"start": 0.0, "exit": wall, **data.get("moments", {})}
    at["first_step_s"], at["last_eval_s"] = data["first_step_s"], data["epochs"][-1]["eval_done_s"]
    return _steps(at, PLAIN_STEPS.items())


def _shares(steps: dict[str, float], teardown_s: float) -> dict:
    """``steps``, the seconds outside training that are ours and Ray's, and the teardown
    (the last evaluation to the command's exit)."""
    whose = {name: who for name, who, _, _ in STEPS}
    outside = {
        n: v for n, v in steps.items() if n not in ("training and evaluation", "unaccounted")
    }
    return {
        "steps": steps,
        "ours_s": sum(v for n, v in outside.items() if whose.get(n) == "ours"),
        "ray_s": sum(v for n, v in outside.items() if whose.get(n) == "Ray"),
        "teardown_s": teardown_s,
    }


def fit_row(summary: dict, start: float, wall: float, peak: float, job: dict | None = None) -> dict:
    """A fit's figures at the benchmark's end points, from the history its loop records
    (``job``: a submitted fit's, :func:`fit_steps`)."""
    history = fit_history(summary)
    hit = next((h for h in history if h["val_accuracy"] >= 0.99), None)
    return {
        "images_per_s": history[-1]["images_per_s"],
        "startup_s": history[0]["first_step_at"] - start,
        "time_to_99_s": None if hit is None else hit["evaluated_at"] - start,
        "train_s_to_99": None
        if hit is None
        else sum(h["train_s"] for h in history if h["epoch"] <= hit["epoch"]),
        "wall_s": wall,
        "cpu_s_per_step": history[-1]["cpu_s_per_step"],
        "final_val_accuracy": summary["val_accuracy"],
        "val_total": summary["val_total"],
        "peak_rss_mb": peak,
        **_shares(
            fit_steps(summary, start, wall, job), wall - (history[-1]["evaluated_at"] - start)
        ),
    }


def loop_row(data: dict, wall: float, peak: float) -> dict:
    """A plain/torchrun/ray-example process's figures at the same end points."""
    epochs = data["epochs"]
    hit = next((i for i, e in enumerate(epochs) if e["val_accuracy"] >= 0.99), None)
    return {
        "images_per_s": epochs[-1]["images_per_s"],
        "startup_s": data["first_step_s"],
        "time_to_99_s": None if hit is None else epochs[hit]["eval_done_s"],
        "train_s_to_99": None if hit is None else sum(e["train_s"] for e in epochs[: hit + 1]),
        "wall_s": wall,
        "cpu_s_per_step": epochs[-1].get("cpu_s_per_step"),
        "final_val_accuracy": epochs[-1]["val_accuracy"],
        "peak_rss_mb": peak,
        **_shares(
            loop_steps(data, wall) if "moments" in data else {}, wall - epochs[-1]["eval_done_s"]
        ),
    }


#: fit-preload's head: every worker process its raylet starts imports these before it takes
#: work (Ray's ``preload_python_modules``), and it prestarts one per CPU when it starts
#: (``enable_worker_prestart``), so a run's controller and workers could begin with torch and
#: Ray Train loaded. Measured, not adopted: benchmarks/README.md says why.
PRELOAD_HEAD_ENV = {
    "RAY_preload_python_modules": "torch,ray.train.torch,raytrain_mnist.worker.loop",
    "RAY_enable_worker_prestart": "1",
}

#: Marks every process of fit-warm's Ray head, so that it alone is stopped.
HEAD_MARKER = "RAYTRAIN_BENCH_WARM_HEAD"


@contextlib.contextmanager
def warm_head(args, env: dict, preload: bool = False, gpus: int = 0, dashboard: bool = False):
    """A ``ray start --head`` as a user starts one (no dashboard: fit needs none), sized
    like fit's own Ray (``args.cores`` CPUs, ``gpus`` GPUs; with ``preload``:
    :data:`PRELOAD_HEAD_ENV`); yields ``127.0.0.1:PORT``, or with ``dashboard`` its Jobs
    API's ``http://127.0.0.1:PORT`` once it answers (a job's ``python`` is this one). Stopped
    by its marker afterwards (never ``ray stop``: that stops every Ray on the machine)."""
    import shutil
    import signal

    marker, tmp = uuid.uuid4().hex, Path(tempfile.mkdtemp(prefix="rtbw", dir="/tmp"))
    head_env = {**env, HEAD_MARKER: marker, "RAY_TMPDIR": str(tmp)}
    head_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if preload:
        head_env.update(PRELOAD_HEAD_ENV)
    # Ray's CLI through this Python: a bundle installed with pip --target has no `ray` script.
    ray = [sys.executable, "-m", "ray.scripts.scripts"]

    def stop() -> None:
        needle = f"{HEAD_MARKER}={marker}".encode()
        # Swept until none is left: a process started while the last sweep killed (seen: a
        # dashboard agent, orphaned, spinning at half a core for 90 s) carries it too.
        for _ in range(20):
            found = set()
            for pid in psutil.pids():
                with contextlib.suppress(psutil.Error, OSError):
                    if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                        found.add(pid)
                        found.update(c.pid for c in psutil.Process(pid).children(recursive=True))
            if not found:
                return
            for pid in found:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.25)

    try:
        for _ in range(3):  # Ray gives its raylet 30 s to register: a loaded machine misses it
            port, dashboard_port = _free_ports(2)  # new ports each try: the last ones may linger
            shown = [f"--include-dashboard={str(dashboard).lower()}"]
            if dashboard:  # its Jobs API needs its agent: Ray's fixed port may be fit-warm's
                shown += ["--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
                shown += ["--dashboard-agent-listen-port=0"]
            started = subprocess.run(
                [*ray, "start", "--head", f"--port={port}", f"--num-cpus={args.cores}"]
                + [f"--num-gpus={gpus}", *shown, "--disable-usage-stats"],
                env=head_env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if started.returncode == 0:
                break
            stop()
        else:
            raise RuntimeError(f"ray start --head failed:\n{started.stderr[-2000:]}")
        if not dashboard:
            yield f"127.0.0.1:{port}"
        else:
            url = f"http://127.0.0.1:{dashboard_port}"
            _wait_for_jobs_api(url)
            yield url
    finally:
        stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _free_ports(count: int) -> list[int]:
    import socket

    with contextlib.ExitStack() as held:  # held together: never the same port twice
        probes = [held.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


def _wait_for_jobs_api(url: str, timeout_s: float = 120) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/jobs/", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Jobs API at {url} did not answer in {timeout_s} s"
                ) from None
        time.sleep(0.5)


def measure_variant(name: str, args, env: dict, storage: Path) -> dict:
    py = sys.executable
    common = [
        "--data-dir",
        args.data_dir,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--dataset",
        args.dataset,
    ]
    cores, n = args.cores, args.workers
    if name in args.env_variants:
        env = {**env, **args.env_variants[name]}
    if name.startswith("fit") or name in args.env_variants:
        workers = 1 if name == "fit-1" else n
        run_name = f"{name}-{time.time_ns()}"
        extra = ["--cpus-per-worker", str(max(1, cores // workers))]
        if name == "fit-submit":
            return measure_submit(args, env, storage, run_name, extra)
        if name == "fit-service":
            return measure_service(args, env, storage, run_name)
        if name in WARM_VARIANTS:
            extra += ["--address", args.warm_addresses[name]]
        command = fit_command(args, workers, storage, run_name, extra)
        _, start, wall, peak, _ = run_measured(command, env)
        summary = json.loads((storage / run_name / "summary.json").read_text())
        return fit_row(summary, start, wall, peak)
    if name == "plain":
        command = [py, "-m", "benchmarks.variants", "plain", "--threads", str(cores), *common]
    elif name == "torchrun":
        command = [
            py,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={n}",
            "-m",
            "benchmarks.variants",
            "torchrun",
            "--threads",
            str(max(1, cores // n)),
            *common,
        ]
    else:
        command = [
            py,
            "-m",
            "benchmarks.variants",
            "ray_example",
            "--workers",
            "1",
            "--threads",
            str(cores),
            "--storage",
            str(storage),
            *common,
        ]
    result, _, wall, peak, _ = run_measured(command, env)
    return loop_row(_parse_result(result.stdout), wall, peak)


SERVICE = "bench"


@contextlib.contextmanager
def warm_service(args, env: dict, storage: Path):
    """``raytrain-mnist service start`` (one worker, every core, its own local Ray), as a
    user starts one, ready before the repeats; stopped with ``service stop`` after them (and
    by its marker, whatever is left). Yields the environment its requests run in."""
    import shutil
    import signal

    marker, tmp = uuid.uuid4().hex, Path(tempfile.mkdtemp(prefix="rtbs", dir="/tmp"))
    service_env = {**env, HEAD_MARKER: marker, "RAY_TMPDIR": str(tmp),
                   "RAYTRAIN_MNIST_CACHE": str(tmp / "cache")}  # fmt: skip
    command = [sys.executable, "-m", "raytrain_mnist", "service", "start", "--name", SERVICE,
               "--num-workers", "1", "--cpus-per-worker", str(args.cores), "--dataset",
               args.dataset, "--data-dir", args.data_dir, "--storage-path", str(storage)]  # fmt: skip
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=service_env, start_new_session=True)  # fmt: skip
    try:
        for line in driver.stdout:
            if f"service '{SERVICE}' ready" in line:
                break
        else:
            raise RuntimeError("the benchmark's service ended before it was ready")
        yield service_env
        subprocess.run([sys.executable, "-m", "raytrain_mnist", "service", "stop", "--name",
                        SERVICE], env=service_env, capture_output=True, timeout=300)  # fmt: skip
        driver.wait(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        needle = f"{HEAD_MARKER}={marker}".encode()
        for pid in psutil.pids():
            with contextlib.suppress(psutil.Error, OSError):
                if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def measure_service(args, env: dict, storage: Path, run_name: str) -> dict:
    """``fit --service`` with the benchmark's training flags (the data, workers and threads
    are the service's), timed from its command's start to its exit."""
    command = [sys.executable, "-m", "raytrain_mnist.fit", "--service", SERVICE, "--epochs",
               str(args.epochs), "--batch-size", str(args.batch_size), "--storage-path",
               str(storage), "--name", run_name]  # fmt: skip
    _, start, wall, peak, _ = run_measured(command, args.service_env)
    summary = json.loads((storage / run_name / "summary.json").read_text())
    return fit_row(summary, start, wall, peak)


def measure_submit(args, env: dict, storage: Path, run_name: str, extra: list[str]) -> dict:
    """fit-N submitted as a job to fit-submit's head and followed to its end; the job's
    start and end (the Jobs API's) join its fit's timeline. Its paths are absolute: the job
    runs in a directory of Ray's."""
    from ray.job_submission import JobSubmissionClient

    url = args.warm_addresses["fit-submit"]
    job_args = copy.copy(args)
    job_args.data_dir = str(Path(args.data_dir).resolve())
    fit = fit_command(job_args, args.workers, storage.resolve(), run_name, extra)
    command = [sys.executable, "-m", "raytrain_mnist.submit", "--address", url, "--", "fit"]
    result, start, wall, peak, _ = run_measured([*command, *fit[3:]], env)
    job_id = re.search(r"submitted (\S+)", result.stdout).group(1)
    job = JobSubmissionClient(url).get_job_info(job_id)
    summary = json.loads((storage / run_name / "summary.json").read_text())
    job_moments = {"job_started": job.start_time / 1000, "job_ended": job.end_time / 1000}
    return fit_row(summary, start, wall, peak, job_moments)


def memory_breakdown(args, env: dict, storage: Path) -> dict:
    """Peak memory (PSS) of a 1-worker fit by process kind, and of each process, sampled
    when the tree's total peaked."""
    run_name = f"memory-{time.time_ns()}"
    command = fit_command(
        args, 1, storage, run_name, ["--cpus-per-worker", str(max(1, args.cores))]
    )
    _, _, wall, peak_rss, rows = run_measured(command, env, breakdown=True)
    rows = sorted(rows or [], key=lambda r: -r["pss_mb"])
    kinds = dict.fromkeys(KINDS, 0.0)
    for row in rows:
        kinds[row["kind"]] += row["pss_mb"]
    return {
        "pss_mb_by_kind": kinds,
        "pss_mb_total": sum(kinds.values()),
        "processes": rows,
        "peak_rss_mb": peak_rss,
        "wall_s": wall,
    }


VARIANTS = [
    "plain", "torchrun", "fit-1", "fit-N", "fit-warm", "fit-preload", "fit-submit",
    "fit-service", "ray-example",
]  # fmt: skip
#: The variants that run against a head of their own, and how it is started (warm_head).
WARM_VARIANTS = {
    "fit-warm": {},
    "fit-preload": {"preload": True},
    "fit-submit": {"dashboard": True},
}
#: Paired ratios: (name, numerator variant, denominator variant, metric).
RATIOS = [
    ("fit1_vs_plain", "fit-1", "plain", "images_per_s"),
    ("fit2_vs_torchrun", "fit-N", "torchrun", "images_per_s"),
    ("data_path_vs_ray_example", "fit-1", "ray-example", "images_per_s"),
    ("fit1_vs_plain_cpu_s_per_step", "fit-1", "plain", "cpu_s_per_step"),
    ("fit2_vs_torchrun_cpu_s_per_step", "fit-N", "torchrun", "cpu_s_per_step"),
    ("fit1_vs_plain_time_to_99", "fit-1", "plain", "time_to_99_s"),
    ("fit_vs_plain_time_to_99", "fit-N", "plain", "time_to_99_s"),
    ("fit_vs_plain_wall", "fit-N", "plain", "wall_s"),
    ("fit_warm_vs_plain_wall", "fit-warm", "plain", "wall_s"),
    ("fit_warm_vs_plain_time_to_99", "fit-warm", "plain", "time_to_99_s"),
    ("fit_preload_vs_plain_wall", "fit-preload", "plain", "wall_s"),
    ("fit_preload_vs_fit_warm_startup", "fit-preload", "fit-warm", "startup_s"),
    ("fit_submit_vs_plain_wall", "fit-submit", "plain", "wall_s"),
    ("fit_submit_vs_fit_warm_startup", "fit-submit", "fit-warm", "startup_s"),
    ("fit_service_vs_plain_wall", "fit-service", "plain", "wall_s"),
    ("fit_service_vs_plain_time_to_99", "fit-service", "plain", "time_to_99_s"),
    ("fit_service_vs_plain_images_per_s", "fit-service", "plain", "images_per_s"),
    ("fit_service_vs_fit_warm_startup", "fit-service", "fit-warm", "startup_s"),
]


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _spread(values):
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / statistics.median(values)


def median_steps(rows: list[dict]) -> dict[str, float]:
    """Each step's median over the repeats (the medians need not add up to the median wall)."""
    names = list(dict.fromkeys(name for r in rows for name in r.get("steps", {})))
    return {n: _median([r["steps"].get(n) for r in rows]) for n in names}


def paired_ratio(runs: dict[str, list[dict]], a: str, b: str, key: str):
    """Median over repeats of (a / b) within each repeat; the runs of one repeat were
    measured back to back, so they share the machine's state of the moment."""
    if a not in runs or b not in runs:
        return None
    pairs = [
        x[key] / y[key] for x, y in zip(runs[a], runs[b], strict=False) if x.get(key) and y.get(key)
    ]
    return statistics.median(pairs) if pairs else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True, help="folder with MNIST/raw/*-ubyte")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2, help="N for torchrun and fit-N")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="CPU threads in all")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--dataset",
        default="mnist",
        choices=["mnist", "sample"],
        help="sample: the bundled 5,000 digits, to try the benchmark quickly "
        "(never reaches 99 %%; ray-example needs full MNIST)",
    )
    parser.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one more fit-1, untimed, for the memory breakdown by process kind",
    )
    parser.add_argument(
        "--env-variant",
        action="append",
        default=[],
        metavar="NAME=VAR=VALUE[,VAR=VALUE]",
        help="one more variant: fit-N with these environment variables (repeatable)",
    )
    args = parser.parse_args(argv)
    args.env_variants = {}
    for spec in args.env_variant:
        name, _, assignments = spec.partition("=")
        pairs = [a.partition("=") for a in assignments.split(",") if a]
        if not name or not pairs or any(not var or not eq for var, eq, _ in pairs):
            parser.error(f"--env-variant {spec!r}: expected NAME=VAR=VALUE[,VAR=VALUE]")
        args.env_variants[name] = {var: value for var, _, value in pairs}
    variants = [v for v in args.variants.split(",") if v] + list(args.env_variants)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
        "PYTHONUNBUFFERED": "1",
    }

    runs: dict[str, list[dict]] = {v: [] for v in variants}
    memory = None
    with (
        tempfile.TemporaryDirectory(prefix="raytrain_bench_") as storage,
        contextlib.ExitStack() as heads,
    ):
        args.warm_addresses = {
            name: heads.enter_context(warm_head(args, env, **options))
            for name, options in WARM_VARIANTS.items()
            if name in variants
        }
        if "fit-service" in variants:
            args.service_env = heads.enter_context(warm_service(args, env, Path(storage)))
        for repeat in range(args.repeats):
            for variant in variants:  # interleaved, so drift hits every variant alike
                load = os.getloadavg()[0]  # the machine's state: shared machines drift
                row = measure_variant(variant, args, env, Path(storage))
                row["load_1min"] = (load + os.getloadavg()[0]) / 2
                runs[variant].append(row)
                print(
                    f"[{repeat + 1}/{args.repeats}] {variant:<12} "
                    f"{row['images_per_s']:7.0f} img/s  start-up {row['startup_s']:5.1f} s  "
                    f"to 99% {_fmt(row['time_to_99_s'], '6.1f')} s  "
                    f"CPU/step {_fmt(row['cpu_s_per_step'], '.4f')} s  "
                    f"wall {row['wall_s']:5.1f} s  peak {row['peak_rss_mb']:6.0f} MB  "
                    f"load {row['load_1min']:.1f}",
                    flush=True,
                )
            # After every repeat: a run cut short still leaves the repeats it finished.
            write_results(args, runs, memory, repeat + 1)
        if args.memory:
            memory = memory_breakdown(args, env, Path(storage))
            print(
                "memory of fit-1 (PSS at peak, MB): "
                + ", ".join(f"{k} {v:.0f}" for k, v in memory["pss_mb_by_kind"].items()),
                flush=True,
            )
    result = write_results(args, runs, memory, args.repeats)
    print(render_markdown(result))
    return 0


def machine() -> str:
    """The machine a result was measured on, as its results say it."""
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, Python "
        f"{platform.python_version()}"
    )


def write_results(args, runs: dict[str, list[dict]], memory, repeats_done: int) -> dict:
    """``results.json`` and ``results.md`` in ``--out`` from the repeats done so far."""
    table = {
        v: {k: _median([r[k] for r in rows]) for k in rows[0] if k != "steps"}
        | {"throughput_spread": _spread([r["images_per_s"] for r in rows])}
        | {"steps": median_steps(rows)}
        for v, rows in runs.items()
        if rows
    }
    ratios = {name: paired_ratio(runs, a, b, key) for name, a, b, key in RATIOS}
    ratios["fit_time_to_99_s"] = table.get("fit-N", {}).get("time_to_99_s")
    ratios["fit1_time_to_99_s"] = table.get("fit-1", {}).get("time_to_99_s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": machine(),
        "settings": {**vars(args), "repeats": repeats_done},
        "variants": table,
        "ratios": ratios,
        "memory_fit1": memory,
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(render_markdown(result))
    return result


def _fmt(value, spec):
    return "—" if value is None else format(value, spec)


def render_markdown(result: dict) -> str:
    t = result["variants"]
    s = result["settings"]
    data = "Full MNIST" if s.get("dataset", "mnist") == "mnist" else "The 5,000-digit sample"
    lines = [
        f"Machine: {result['machine']}. {data}, {s['epochs']} epoch(s), global batch "
        f"{s['batch_size']}, {s['cores']} CPU threads per variant, median of "
        f"{s['repeats']} interleaved run(s). Times from command start: start-up to the "
        "first optimizer step, time to 99 % to the end of the first evaluation at "
        "≥ 99 %.",
        "",
        "| variant | images/s | start-up s | time to 99 % s | wall s | CPU s / step "
        "| final acc | peak MB | noise |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in t.items():
        lines.append(
            f"| {name} | {row['images_per_s']:.0f} | {row['startup_s']:.1f} | "
            f"{_fmt(row['time_to_99_s'], '.1f')} | {row['wall_s']:.1f} | "
            f"{_fmt(row['cpu_s_per_step'], '.4f')} | "
            f"{100 * row['final_val_accuracy']:.2f} % | {row['peak_rss_mb']:.0f} | "
            f"{_fmt(row['throughput_spread'], '.1%')} |"
        )
    r = result["ratios"]
    targets = {
        "fit1_vs_plain": "≥ 0.97",
        "fit2_vs_torchrun": "≥ 0.97",
        "data_path_vs_ray_example": "≥ 1.5",
        "fit1_vs_plain_cpu_s_per_step": "≤ 1.03",
        "fit2_vs_torchrun_cpu_s_per_step": "",
        "fit1_vs_plain_time_to_99": "≤ 1.15 (Ray's release gate)",
        "fit_vs_plain_time_to_99": "≤ 1.15 (Ray's release gate)",
        "fit_vs_plain_wall": "≤ 2.0",
        "fit_warm_vs_plain_wall": "≤ 1.4",
        "fit_warm_vs_plain_time_to_99": "",
        "fit_preload_vs_plain_wall": "",
        "fit_preload_vs_fit_warm_startup": "",
        "fit_submit_vs_plain_wall": "",
        "fit_submit_vs_fit_warm_startup": "",
        "fit_service_vs_plain_wall": "≤ 1.05",
        "fit_service_vs_plain_time_to_99": "",
        "fit_service_vs_plain_images_per_s": "",
        "fit_service_vs_fit_warm_startup": "",
    }
    lines += [
        "",
        "Paired ratios (median of the per-repeat ratios):",
        "",
        "| ratio | value | target |",
        "|---|---:|---|",
    ]
    lines += [
        f"| {name} | {_fmt(r.get(name), '.3f')} | {target} |" for name, target in targets.items()
    ]
    lines += [
        f"| fit_time_to_99_s (default command) | {_fmt(r['fit_time_to_99_s'], '.1f')} | ≤ 45 |",
        "",
        "Noise: the spread (max − min) / median of throughput across repeats.",
    ]
    lines += render_steps(t)
    memory = result.get("memory_fit1")
    if memory:
        lines += [
            "",
            "Peak memory of a 1-worker fit by process kind (PSS: shared pages split "
            "between the processes that map them), at the moment the total peaked:",
            "",
            "| process kind | MB |",
            "|---|---:|",
        ]
        lines += [f"| {kind} | {mb:.0f} |" for kind, mb in memory["pss_mb_by_kind"].items()]
        lines += [
            f"| **total** | **{memory['pss_mb_total']:.0f}** |",
            "",
            "| process | kind | MB |",
            "|---|---|---:|",
        ]
        lines += [
            f"| `{row['process']}` | {row['kind']} | {row['pss_mb']:.0f} |"
            for row in memory["processes"]
            if row["pss_mb"] >= 20
        ]
    return "\n".join(lines) + "\n"


def render_steps(t: dict, variants=None) -> list[str]:
    """Where each command's seconds go, step by step (median of each step over the repeats;
    the medians need not add up to the median wall exactly): ``variants``, by default the
    plain loop and every fit."""
    if variants is None:
        variants = [v for v in t if v not in ("torchrun", "ray-example")]
    shown = [v for v in variants if t.get(v, {}).get("steps")]
    if not shown:
        return []
    lines = [
        "",
        "Where the seconds go, from the command's start to its exit (seconds per step, "
        "median over the repeats; fit's moments from its summary.json `timeline`, the "
        "plain loop's from its RESULT line):",
        "",
        "| step | whose | " + " | ".join(shown) + " |",
        "|---|---|" + "---:|" * len(shown),
    ]
    for name, who, _, _ in STEPS:
        cells = [_fmt(t[v]["steps"].get(name), ".2f") for v in shown]
        if any(c != "—" for c in cells):
            lines.append(f"| {name} | {who} | " + " | ".join(cells) + " |")
    lines.append(
        "| unaccounted | | "
        + " | ".join(_fmt(t[v]["steps"].get("unaccounted"), ".2f") for v in shown)
        + " |"
    )
    for label, key in (
        ("start-up (to the first step)", "startup_s"),
        ("teardown (last evaluation to exit)", "teardown_s"),
        ("outside training: ours", "ours_s"),
        ("outside training: Ray's", "ray_s"),
        ("wall", "wall_s"),
        ("time to 99 %", "time_to_99_s"),
    ):
        lines.append(
            f"| **{label}** | | " + " | ".join(_fmt(t[v].get(key), ".1f") for v in shown) + " |"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
