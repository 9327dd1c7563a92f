"""Every benchmark under benchmarks/ still runs against today's code, at the tiniest size, and
every benchmark command the documents show parses with its script's own parser.

A benchmark is measured rarely and by hand, so nothing else notices when a rename in the
package breaks one. What these tests run, and what they leave out:

* What a benchmark reads from a run (``summary.json``, its timeline, the checkpoint's
  history) is read from the suite's shared ``fitted`` run: compare, compile, chaos,
  progress_cost and service_burst build their rows and tables from it, their commands
  parsed with the real parsers instead of started.
* ``variants plain`` (the floor every comparison is paired with) trains in a subprocess on
  tiny data through compare's own ``run_measured``, and compare and compile parse its
  result; ``recipes`` trains one seed in this process; ``serve_load``'s plain server answers
  real requests with the shared run's checkpoint.
* Only their pure parts (tables, result parsing, fault plans): ``chaos`` (its Cluster and
  two seeded runs), ``serve_faults`` and ``service_burst`` (a Serve deployment, a service),
  ``trials`` (a Tune search), ``ray_start`` (a Ray of its own per trial), ``gpu`` (a GPU;
  tests/test_gpu.py runs its CPU dry run). ``process_cpu`` and ``suite_cpu`` have test
  files of their own.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, free_ports
from tests.test_readme import _blocks, _shell_lines
from tests.test_readme import parse as parse_package_command

BENCHMARKS = REPO / "benchmarks"
#: Every document that may show a benchmark command.
DOCS = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    BENCHMARKS / "README.md",
    *sorted((REPO / "docs").rglob("*.md")),
]
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__init__")


# --------------------------------------------------------------------------- helpers


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def parsed(script: str, argv: list[str]) -> argparse.Namespace:
    """``python -m benchmarks.SCRIPT ARGV``'s flags as its ``main`` parses them, without
    running anything after the parse (argparse's errors are its SystemExit(2))."""
    module = importlib.import_module(f"benchmarks.{script}")
    original = argparse.ArgumentParser.parse_args

    def stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    saved_argv = sys.argv
    argparse.ArgumentParser.parse_args = stop
    sys.argv = [script, *argv]  # the scripts whose main takes no argv read it
    try:
        if inspect.signature(module.main).parameters:
            module.main(argv)
        else:
            module.main()
    except _Parsed as done:
        return done.namespace
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = saved_argv
    raise AssertionError(f"benchmarks.{script}'s main returned without parsing its flags")


def _doc_lines(doc: Path) -> list[str]:
    """Shell lines of the code blocks, and the inline code spans (joined across line
    breaks), that run a benchmark module."""
    text = doc.read_text()
    lines = [line for _, body in _blocks(text) for line in _shell_lines(body, prompt=False)]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    lines += [" ".join(span.split()) for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", prose)]
    return [line for line in lines if "-m benchmarks." in line]


def _code_lines(doc: Path) -> list[str]:
    return [line for _, body in _blocks(doc.read_text()) for line in _shell_lines(body, False)]


def benchmark_commands() -> list[tuple[str, str, list[str], str]]:
    """(document, script, its arguments, the line) for every ``... -m benchmarks.SCRIPT``
    the documents show (``python``, ``python3`` or ``torchrun`` first, after any
    ``VAR=value``); ``benchmarks.NAME`` is a placeholder."""
    found = []
    for doc in DOCS:
        for line in _doc_lines(doc):
            words = line.split()
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words = words[1:]
            if not words or words[0] not in ("python", "python3", "torchrun"):
                continue  # prose that names a command inside something else
            words = shlex.split(" ".join(words), comments=True)
            i = words.index("-m")
            while not words[i + 1].startswith("benchmarks."):
                i = words.index("-m", i + 1)
            script = words[i + 1].partition(".")[2]
            if script.isupper():
                continue
            args = words[i + 2 :]
            if not args and line not in _code_lines(doc):
                continue  # prose naming the script, not a command to copy
            for j, word in enumerate(args):
                if word in ("|", "||", "&&", ";", ">", ">>", "&"):
                    args = args[:j]
                    break
            found.append((str(doc.relative_to(REPO)), script, args, line))
    return found


def fake_run_measured(fitted: dict, result_line: dict):
    """A stand-in for compare's ``run_measured`` that starts nothing: a ``fit`` command's
    flags are parsed by fit's own parser and its run is the shared one (its summary.json
    written where the command would have); a ``benchmarks.variants`` command's flags are
    parsed by the script's own parser and it prints ``result_line``. The run is said to
    have started at the shared run's start and ended a second after its last moment."""
    summary = fitted["summary"]
    start = summary["timeline"]["t0"]
    wall = max(summary["timeline"]["teardown_s"].values()) + 1.0
    commands = []

    def run(command: list[str], env: dict, breakdown: bool = False):
        commands.append(command)
        if "raytrain_mnist.fit" in command:
            args = command[command.index("raytrain_mnist.fit") + 1 :]
            parse_package_command("fit", args)
            storage = Path(args[args.index("--storage-path") + 1])
            run_dir = storage / args[args.index("--name") + 1]
            run_dir.mkdir(parents=True)
            (run_dir / "summary.json").write_text(json.dumps(summary))
            out = ""
        else:
            assert "benchmarks.variants" in command, command
            parsed("variants", command[command.index("benchmarks.variants") + 1 :])
            out = "RESULT " + json.dumps(result_line) + "\n"
        done = subprocess.CompletedProcess(command, 0, out, "")
        return done, start, wall, 512.0, None

    run.commands = commands
    return run


def loop_result(epochs: int = 1, accuracy: float = 0.991) -> dict:
    """A RESULT line as ``benchmarks.variants`` prints it (``_emit``)."""
    return {
        "epochs": [
            {
                "images_per_s": 5000.0 + e,
                "train_s": 12.0,
                "first_step_in_epoch_s": 0.05,
                "steps": 468,
                "cpu_s_per_step": 0.047,
                "capture_s": 0,
                "step": "eager",
                "val_accuracy": accuracy,
                "eval_done_s": 16.0 + 13 * e,
            }
            for e in range(epochs)
        ],
        "first_step_s": 4.0,
        "moments": {"imported_s": 2.9, "data_loaded_s": 3.2, "model_prepared_s": 3.9},
    }


# --------------------------------------------------------------------------- the documents


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_is_documented_and_answers_help(script, capsys):
    """Each script is named in benchmarks/README.md, and ``--help`` works."""
    assert f"{script}.py" in (BENCHMARKS / "README.md").read_text() or (
        f"benchmarks.{script}" in (BENCHMARKS / "README.md").read_text()
    ), f"benchmarks/README.md does not name {script}.py"
    module = importlib.import_module(f"benchmarks.{script}")
    saved = sys.argv
    sys.argv = [script, "--help"]
    try:
        with pytest.raises(SystemExit) as done:
            if inspect.signature(module.main).parameters:
                module.main(["--help"])
            else:
                module.main()
    finally:
        sys.argv = saved
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_every_benchmark_command_the_documents_show_parses():
    """What a reader copies from benchmarks/README.md (or any other document) runs: its
    flags are the script's, and a command it runs after ``--`` parses with that command's
    parser."""
    commands = benchmark_commands()
    assert {script for _, script, _, _ in commands} >= set(SCRIPTS) - {"suite_cpu", "variants"}
    failures = []
    for doc, script, args, line in commands:
        try:
            namespace = parsed(script, args)
            inner = getattr(namespace, "command", None)  # process_cpu's, after --
            if script == "process_cpu" and inner:
                inner = inner[1:] if inner[0] == "--" else inner
                if inner[0] == "raytrain-mnist":
                    parse_package_command(inner[1], inner[2:])
                elif inner[:3] == ["python", "-m", "raytrain_mnist.fit"]:
                    parse_package_command("fit", inner[3:])
        except SystemExit as exc:
            if exc.code not in (0, None):
                failures.append(f"{doc}: {line}  -> exit {exc.code}")
        except Exception as exc:
            failures.append(f"{doc}: {line}  -> {exc!r}")
    assert not failures, "benchmark commands that do not parse:\n" + "\n".join(failures)


def test_the_gpu_check_script_is_valid_bash():
    done = subprocess.run(
        ["bash", "-n", str(BENCHMARKS / "gpu_check.sh")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------- compare


def test_compare_names_every_moment_a_fit_records():
    """Every start-up and teardown moment a fit stamps is one end of a step in compare's
    table, so a renamed moment cannot drop a row unnoticed."""
    from benchmarks import compare
    from raytrain_mnist.driver.events import STARTUP, TEARDOWN

    ends = {moment for _, _, a, b in compare.STEPS for moment in (a, b)}
    assert set(STARTUP) | set(TEARDOWN) <= ends


def test_compare_writes_its_tables_from_the_loops_results(tmp_path):
    from benchmarks import compare

    runs = {
        "plain": [compare.loop_row(loop_result(), 18.1, 1100.0)],
        "torchrun": [compare.loop_row(loop_result(accuracy=0.98), 23.7, 2700.0)],
    }
    args = argparse.Namespace(out=str(tmp_path), epochs=1, batch_size=128, cores=2)
    args.dataset = "mnist"
    result = compare.write_results(args, runs, None, 1)
    table = (tmp_path / "results.md").read_text()
    assert "| plain | 5000 | 4.0 | 16.0 | 18.1 |" in table
    assert "| torchrun | 5000 | 4.0 | — |" in table  # never at 99 %
    assert "| Python, imports, flags | ours | 2.90 |" in table
    assert json.loads((tmp_path / "results.json").read_text())["variants"] == json.loads(
        json.dumps(result["variants"])
    )


def test_compare_measures_a_fit_and_the_plain_loop_from_their_records(
    fitted, tmp_path, monkeypatch
):
    """compare's whole run (its variants, rows, step table, ratios) on the shared fit's
    records: every fit moment is in a step, and the history carries what each column reads."""
    from benchmarks import compare

    fake = fake_run_measured(fitted, loop_result())
    monkeypatch.setattr(compare, "run_measured", fake)
    argv = ["--data-dir", "unused", "--out", str(tmp_path), "--repeats", "1", "--no-memory"]
    assert compare.main([*argv, "--variants", "plain,fit-1,fit-N"]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    fit = result["variants"]["fit-N"]
    assert fit["images_per_s"] > 0 and fit["cpu_s_per_step"] > 0
    assert 0 < fit["startup_s"] < fit["wall_s"]
    assert fit["final_val_accuracy"] == fitted["summary"]["val_accuracy"]
    steps = fit["steps"]
    for name in ("ray.init", "controller actor starts", "training and evaluation"):
        assert steps[name] >= 0, name
    # The shared fit ran on the tests' Ray, which it did not start and so never shut down:
    # without that moment, the curves' seconds after its summary are the one gap left.
    teardown = fitted["summary"]["timeline"]["teardown_s"]
    assert "ray_shut_down" not in teardown
    gap = teardown["files_written"] - teardown["summary_built"]
    assert steps["unaccounted"] == pytest.approx(gap, abs=1e-6), steps
    assert result["ratios"]["fit1_vs_plain"] is not None
    assert "| fit-N |" in (tmp_path / "results.md").read_text()
    assert [c[c.index("--num-workers") + 1] for c in fake.commands if "--num-workers" in c] == [
        "1",
        "2",
    ]
    # fit-service: a request to a running service, with the benchmark's training flags.
    args = argparse.Namespace(data_dir="unused", dataset="mnist", epochs=1, batch_size=128)
    args.cores, args.workers, args.env_variants, args.service_env = 2, 2, {}, {}
    service = compare.measure_variant("fit-service", args, {}, tmp_path)
    assert "--service" in fake.commands[-1] and service["startup_s"] == fit["startup_s"]


# --------------------------------------------------------------------------- compile


def test_compile_measures_a_fit_from_its_records_and_renders(fitted, tmp_path, monkeypatch):
    from benchmarks import compile as compile_bench

    monkeypatch.setattr(compile_bench, "run_measured", fake_run_measured(fitted, loop_result()))
    argv = ["--data-dir", "unused", "--out", str(tmp_path), "--repeats", "1"]
    argv += ["--variants", "plain,fit-2", "--no-eval", "--step-blocks", "0"]
    assert compile_bench.main(argv) == 0
    result = json.loads((tmp_path / "compile.json").read_text())
    assert set(result["variants"]) == {"plain", "fit-2"}
    assert result["variants"]["fit-2"]["steady_step_s"] > 0
    assert "| fit-2 |" in compile_bench.render(result)


# --------------------------------------------------------------------------- variants


@pytest.mark.slow
def test_the_plain_loop_trains_and_compare_and_compile_read_its_result(tiny_mnist, tmp_path):
    """``benchmarks.variants plain`` on tiny data, as compare and compile start it (one
    process, the real ``run_measured``): its RESULT line gives every column of their rows."""
    from benchmarks import compare
    from benchmarks import compile as compile_bench

    args = argparse.Namespace(data_dir=str(tiny_mnist), dataset="mnist", epochs=1)
    args.batch_size, args.cores, args.workers, args.env_variants = 256, 1, 1, {}
    real, runs = compare.run_measured, []

    def record(command, env, breakdown=False):
        runs.append(real(command, env, breakdown))
        return runs[-1]

    def replay(command, env, breakdown=False):  # compile's plain run: the same command
        parsed("variants", command[command.index("benchmarks.variants") + 1 :])
        return runs[0]

    env = dict(os.environ)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compare, "run_measured", record)
        row = compare.measure_variant("plain", args, env, tmp_path)
        m.setattr(compile_bench, "run_measured", replay)
        compiled_row = compile_bench.measure("plain", args, env, tmp_path, tmp_path)
    assert len(runs) == 1 and row["images_per_s"] > 0
    assert 0 < row["startup_s"] < row["wall_s"]
    assert row["steps"]["training and evaluation"] > 0
    assert compiled_row["steps"] == 2048 // 256 and compiled_row["steady_step_s"] > 0
    assert 0 < compiled_row["val_accuracy"] <= 1


# --------------------------------------------------------------------------- recipes


def test_a_recipe_trains_one_seed_and_makes_its_table(tiny_mnist):
    """``benchmarks.recipes``' plain loop, one tiny epoch in this process, scored at half an
    epoch and at its end; its summary and its README table."""
    import torch

    from benchmarks import recipes
    from raytrain_mnist.data import load_mnist
    from raytrain_mnist.worker.setup import to_device

    threads = torch.get_num_threads()
    data = to_device(load_mnist(str(tiny_mnist), "mnist"), torch.device("cpu"))
    settings = {**recipes.recipe("fast-1ep"), "batch_size": 256}
    torch.set_num_threads(1)  # as small as it gets; the suite's other worker has the other core
    try:
        run = recipes.run_one(data, settings, seed=0, epochs=1, eval_at=[0.5])
    finally:
        torch.set_num_threads(threads)
    assert [e["share"] for e in run["evals"]] == [0.5, 1.0]
    assert run["steps_per_epoch"] == 2048 // 256 and 0.1 < run["val_accuracy"] <= 1
    summary = recipes.summarize([{"recipe": "fast-1ep", "settings": settings, **run}])
    table = recipes.time_to_99_table(summary, [("fast-1ep / 1 ep", "`one-epoch`")])
    assert table.splitlines()[2].startswith("| `one-epoch` | 1 | ")


# --------------------------------------------------------------------------- progress_cost


def test_progress_cost_runs_fit_as_a_user_would_and_pairs_the_modes(fitted, tmp_path, monkeypatch):
    from benchmarks import progress_cost

    commands = []

    def run(command, cwd=None, capture_output=False, env=None):
        commands.append(command)
        args = command[command.index("fit") + 1 :]
        parse_package_command("fit", args)
        run_dir = Path(args[args.index("--storage-path") + 1]) / args[args.index("--name") + 1]
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps(fitted["summary"]))
        return subprocess.CompletedProcess(command, 0, b"\r epoch 1/1\r", b"")

    monkeypatch.setattr(progress_cost.subprocess, "run", run)
    assert progress_cost.main(["--repeats", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "progress.json").read_text())
    assert report["ratio_bar_over_off"] == 1.0  # the same run on both sides
    modes = [c[c.index("--progress") + 1] for c in commands]
    assert modes == ["bar", "off", "off", "bar"]  # interleaved, alternating


# --------------------------------------------------------------------------- service_burst


def test_service_burst_summarizes_requests_read_from_a_fit(fitted):
    from benchmarks import compare, service_burst

    summary = fitted["summary"]
    start = summary["timeline"]["t0"]
    wall = max(summary["timeline"]["teardown_s"].values()) + 0.5
    request = compare.fit_row(summary, start, wall, 190.0)
    plain = compare.loop_row(loop_result(), 14.0, 1100.0)
    args = argparse.Namespace(dataset="sample")
    result = service_burst._summarize(args, [plain, plain], [request, request])
    assert result["median_teardown_s"] == pytest.approx(request["teardown_s"])
    assert result["min_accuracy"] == summary["val_accuracy"]
    assert "| start-up: command to first step (median) |" in service_burst._markdown(result)


# --------------------------------------------------------------------------- chaos


def test_chaos_draws_its_plan_and_arms_a_fault_from_rank_0s_progress():
    from benchmarks import chaos
    from raytrain_mnist.driver.events import Note, StepProgress

    plan = chaos.draw_plan(random.Random(0), kills=3, epochs=8, preemptions=1)
    assert sorted(p["kind"] for p in plan) == ["node", "preempt", "worker", "worker", "worker"]
    assert plan == sorted(plan, key=lambda p: (p["epoch"], p["share"]))
    assert plan == chaos.draw_plan(random.Random(0), kills=3, epochs=8, preemptions=1)

    point = {"kind": "worker", "epoch": 2, "share": 0.5}
    dealer = chaos.Chaos(None, [], "http://unused", "marker", [point, dict(point, epoch=3)], 0)
    progress = {"epoch": 2, "images": 256, "total": 1024, "seconds": 1.0, "loss": 0.3}
    dealer.on_event(StepProgress(progress, epochs=8))  # a quarter: not yet
    dealer.on_event(StepProgress({**progress, "images": 512}, epochs=8))
    dealer.on_event(StepProgress({**progress, "epoch": 3, "images": 1000}, epochs=8))
    assert dealer._queue.qsize() == 1  # disarmed until the run says it restarted
    dealer.dealt.append({"kind": "worker"})
    dealer.on_event(Note("workers restarted from the checkpoint of epoch 1"))
    dealer.on_event(StepProgress({**progress, "epoch": 3, "images": 1000}, epochs=8))
    assert dealer._queue.qsize() == 2
    assert dealer.dealt[0]["restart_note"].startswith("workers restarted")


def test_chaos_and_serve_faults_call_the_library_as_it_is():
    """What their mains (a Cluster, a Serve deployment: not run here) call, with the
    arguments they pass."""
    from raytrain_mnist.config import FitConfig, RunSettings, TrainConfig
    from raytrain_mnist.driver import fit
    from raytrain_mnist.driver.deployment import serving
    from raytrain_mnist.serving.app import DEPLOYMENT_NAME
    from raytrain_mnist.serving.settings import ServeConfig

    settings = RunSettings.from_flags(
        num_workers=2,
        cpus_per_worker=1,
        data_dir="/tmp/data",
        dataset="mnist",
        keep_checkpoints=2,
        storage_path="/tmp/runs",
        name="calm",
        address="127.0.0.1:6379",
        max_failures=6,
    )
    cfg = FitConfig(TrainConfig(epochs=8, batch_size=32, lr=0.05, seed=0), settings)
    inspect.signature(fit).bind(cfg, print)
    serve_cfg = ServeConfig(host="127.0.0.1", port=8000, replicas=2, ingress="proxy")
    inspect.signature(serving).bind(serve_cfg, "/tmp/ckpt")
    assert serve_cfg.max_batch_size >= 1 and DEPLOYMENT_NAME


def test_chaos_compares_weights_and_costs_faults_from_a_fits_records(fitted):
    from benchmarks import chaos

    summary = fitted["summary"]
    weights = chaos.compare(summary, summary)
    assert weights["bit_for_bit"] and weights["assert_close"] and weights["tensors"] > 0
    assert chaos._check_cost(summary)["checks"] >= 0

    dealer = chaos.Chaos(None, [], "http://unused", "marker", [], 0)
    dealer.dealt = [
        {
            "kind": "worker",
            "at_epoch": 3,
            "at_images": 1024,
            "epoch_images": 2048,
            "seen_at": 10.0,
            "dealt_at": 10.1,
            "restart_note_at": 20.0,
            "restart_note": "workers restarted from the checkpoint of epoch 2",
        }
    ]
    dealer.steps = [(9.0, 3, 1000, 2048), (25.0, 3, 32, 2048)]
    (row,) = chaos._per_fault(dealer, {"result": fitted["result"]})
    assert row["resumed_from"] == 2 and row["to_first_step_s"] == pytest.approx(14.9)
    steps_per_epoch = summary["train_size"] // summary["config"]["train"]["batch_size"]
    assert row["steps_trained_again"] == steps_per_epoch // 2
    assert chaos._per_kind([row])["worker"]["faults"] == 1


# --------------------------------------------------------------------------- serving


def test_every_serve_variant_is_flags_serve_takes():
    from benchmarks import serve_load

    for name, (flags, _, _) in serve_load.VARIANTS.items():
        if name != serve_load.PLAIN_BOUNDED:
            parse_package_command("serve", ["RUN_DIR", "--port", "8031", *flags])


def test_serve_load_pairs_rounds_and_writes_its_table(tmp_path):
    from benchmarks import serve_load

    def round_(rps, p99, cpu):
        return {
            "requests": 100,
            "errors": 0,
            "requests_per_s": rps,
            "p50_ms": p99 / 2,
            "p99_ms": p99,
            "accuracy": 0.99,
            "cpu_ms_per_request": {"replica": cpu, "client": 0.5},
        }

    pair = serve_load._pair(
        [round_(600, 50, 0.9)] * 2, [round_(800, 40, 1.0), round_(820, 45, 1.1)]
    )
    assert pair["throughput_of_plain"] == pytest.approx(1.35, abs=0.01)
    row = {"variant": "default", "what": "direct", "load_average": 1.0, **pair}
    meta = {"date": "now", "concurrency": 16, "requests_per_round": 100, "rounds": 2}
    serve_load.write(tmp_path / "serve", {**meta, "ray": "2.60", "cpus": 2}, [row])
    assert "| default: direct | 810 |" in (tmp_path / "serve.md").read_text()


@pytest.mark.slow
def test_the_plain_server_answers_requests_with_a_fits_checkpoint(fitted, tiny_mnist, tmp_path):
    """serve_load's baseline, the package's handler behind bare uvicorn (a process of its
    own, as the benchmark starts it), under its own load generator: 40 requests."""
    from benchmarks import serve_load
    from raytrain_mnist.data import load_mnist

    checkpoint = fitted["summary"]["latest_checkpoint"]
    data = load_mnist(str(tiny_mnist), "mnist")
    images, labels = data.test_images[:20], data.test_labels[:20]
    bodies = [json.dumps({"images": [image.tolist()]}).encode() for image in images]
    port = free_ports(1)[0]
    mark = f"test-{time.time_ns()}-plain"
    argv = [sys.executable, "-m", "benchmarks.serve_load", str(checkpoint), "--plain-server"]
    server = serve_load.Server(
        [*argv, "--port", str(port)],
        {serve_load._MARK: mark},
        tmp_path / "plain.log",
        "",
        f"http://127.0.0.1:{port}/",
    )
    try:
        server.wait_ready(timeout=180)
        before = serve_load.cpu_seconds(mark)
        result = asyncio.run(
            serve_load.load(server.url, bodies, labels, 40, concurrency=4, warmup=4)
        )
        after = serve_load.cpu_seconds(mark)
    finally:
        assert server.stop(timeout=60) is not None
    assert result["requests"] == 40 and result["errors"] == 0
    assert result["accuracy"] >= 0.5  # the shared run is trained; an untrained net scores ~0.1
    assert after["plain"] > before.get("plain", 0.0)


def test_serve_faults_reads_latency_and_when_answers_were_normal_again():
    from benchmarks.serve_faults import Answer, _growth, _kinds, latency, normal_again

    ok = [Answer(t, t + 0.02, 200, True, "ok") for t in (0.0, 0.5, 1.0, 1.5, 2.5, 3.5)]
    failed = Answer(1.2, 1.3, 500, False, "status 500")
    answers = sorted([*ok, failed], key=lambda a: a.sent)
    assert latency(answers)["failed"] == 1 and latency(answers)["p50_ms"] == pytest.approx(20.0)
    assert _kinds(answers) == {"status 500": 1}
    assert normal_again(answers, kill=1.0, baseline_p99=20.0) == 1.0
    samples = [
        {"requests": 1000, "7": {"rss_mb": 897.0, "pss_mb": 500.0, "uss_mb": 383.0}},
        {"requests": 20000, "7": {"rss_mb": 902.0, "pss_mb": 530.0, "uss_mb": 388.0}},
    ]
    assert _growth(samples, [7])["7"]["rss_mb"] == 5.0


# --------------------------------------------------------------------------- trials, ray_start


def test_trials_runs_tune_as_a_user_would_and_makes_its_table():
    from benchmarks import trials

    args = argparse.Namespace(trials=4, epochs=1, dataset="mnist", data_dir="../shared/data/mnist")
    command = trials.tune_command(args, Path("/tmp/runs"), "search")
    parse_package_command("tune", command[command.index("raytrain_mnist.tune") + 1 :])
    moments = [
        {"started_at": 100.0 + 20 * i, "first_step_at": 105.0 + 20 * i}
        | {"evaluated_at": 115.0 + 20 * i}
        for i in range(3)
    ]
    search = trials.tune_row(moments, start=90.0, wall=80.0)
    assert search["between_trials_s"] == [10.0, 10.0] and not search["overlapping"]
    plain = {"startup_s": 3.0, "training_s": 12.0, "wall_s": 16.0}
    result = {"machine": "here", "searches": [search], "plain": [plain]}
    result["settings"] = {**vars(args), "repeats": 1}
    assert "| **between two trials**" in trials.render(result)


def test_trials_groups_searches_through_services_of_each_size_and_compares_images_per_s():
    from benchmarks import trials

    args = argparse.Namespace(
        trials=8, epochs=2, dataset="mnist", data_dir="../shared/data/mnist", cores=2
    )
    args.search_seed = 0
    command = trials.search_command(args, "127.0.0.1:6379", Path("/tmp/runs"), "asha", True, 2)
    parse_package_command("tune", command[command.index("raytrain_mnist.tune") + 1 :])
    flags = " ".join(command)
    assert "--max-concurrent-trials 2" in flags and "--cpus-per-worker 1" in flags
    assert f"--service {trials.SERVICE}" in flags
    args.groups, args.repeats = 2, 1
    one = {"wall_s": 200.0, "epochs": 12, "images_per_s": 3600.0}
    two = {"wall_s": 150.0, "epochs": 12, "images_per_s": 4800.0}
    result = {"machine": "here", "settings": vars(args)}
    result["sides"] = {"1 group": [one], "2 groups": [two]}
    table = trials.render_groups(result)
    assert "| **images/s** | 3600 | 4800 |" in table
    assert "Images/s ratio (2 groups / 1 group): 1.33." in table


def test_ray_start_tries_what_it_measures_and_writes_its_table(tmp_path, monkeypatch):
    """The trial script's hooks still exist (Ray's ``Node.start_api_server``, our
    ``lean_local_ray`` and ``start_local`` as it calls them); the rest is its table."""
    from ray._private.node import Node

    from benchmarks import ray_start
    from raytrain_mnist import compat
    from raytrain_mnist.driver import cluster

    compile(ray_start._TRIAL, "trial", "exec")
    assert callable(Node.start_api_server)
    assert "log_monitor" in inspect.signature(compat.lean_local_ray).parameters
    inspect.signature(cluster.start_local).bind(
        num_cpus=1, num_gpus=0, dashboard=False, log_to_driver=False
    )
    times = iter(range(100))

    def trial(variant):
        return {"init_s": 1.0 + next(times) / 100, "wall_s": 3.0, "cpu_s": 3.1}

    monkeypatch.setattr(ray_start, "trial", trial)
    assert ray_start.main(["--repeats", "2", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "results.md").read_text()
    assert "| ours | 1.01 | 3.00 | 3.10 |" in table
    assert len(json.loads((tmp_path / "results.json").read_text())["trials"]["ours"]) == 2


def test_no_benchmark_is_left_without_a_smoke_test():
    """A new script gets its smoke test here (or names the test file that has it)."""
    source = Path(__file__).read_text()
    elsewhere = {"process_cpu": "test_process_cpu.py", "suite_cpu": "test_suite_cpu.py"}
    elsewhere["gpu"] = "test_gpu.py"
    for script in SCRIPTS:
        if script in elsewhere:
            assert (REPO / "tests" / elsewhere[script]).is_file()
        else:
            used = rf"from benchmarks import [\w, ]*\b{script}\b|benchmarks\.{script}\b"
            assert re.search(used, source), f"no smoke test of benchmarks/{script}.py"

    assert shutil.which("bash"), "gpu_check.sh is a bash script"
