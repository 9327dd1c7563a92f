"""fit's start-up and teardown timeline: every moment recorded, in order, on one clock.

One real `fit` command (the bundled sample, 2 workers, its own local Ray) is shared by every
assertion: its ``summary.json`` ``timeline`` and the phase lines it printed. Not timed: the
figures are a benchmark's (benchmarks/compare.py); this checks that they are all there and
make sense.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from raytrain_mnist.driver.events import STARTUP, TEARDOWN
from tests.conftest import run_cli

_PHASE = re.compile(r"^ +(\d+\.\d) s  (.+)$", re.M)


@pytest.fixture(scope="module")
def timed_fit(tmp_path_factory) -> dict:
    storage = tmp_path_factory.mktemp("startup")
    before = time.time()
    result = run_cli(
        "fit",
        "--dataset",
        "sample",
        "--epochs",
        "2",
        "--num-workers",
        "2",
        "--cpus-per-worker",
        "1",
        "--progress",
        "lines",
        "--storage-path",
        str(storage),
        "--name",
        "timed",
        timeout=600,
    )
    after = time.time()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((storage / "timed" / "summary.json").read_text())
    curves = (storage / "timed" / "training_curves.png").read_bytes()
    return {
        "summary": summary,
        "out": result.stdout,
        "before": before,
        "after": after,
        "png": curves,
    }


def test_every_startup_and_teardown_moment_is_recorded_in_order(timed_fit):
    timeline = timed_fit["summary"]["timeline"]
    assert timeline["t0_is"] == "process start"
    assert list(timeline["startup_s"]) == list(STARTUP), timeline
    assert list(timeline["teardown_s"]) == list(TEARDOWN), timeline
    moments = [*timeline["startup_s"].values(), *timeline["teardown_s"].values()]
    assert moments == sorted(moments), timeline
    assert moments[0] > 0
    # Two epochs of training lie between the first step and the last report.
    assert timeline["teardown_s"]["last_report"] > timeline["startup_s"]["first_step"]
    assert "same clock" in timeline["worker_clock"]
    # Ray Train's PlacementGroupCleaner held the worker group's shutdown for 12 s (its State
    # API call); asking the GCS takes milliseconds (compat.lighter_run_callbacks).
    teardown = timeline["teardown_s"]
    assert teardown["worker_group_shut_down"] - teardown["workers_finished"] < 6, teardown
    # The curves were drawn and written before Ray shut down.
    assert timed_fit["png"].startswith(b"\x89PNG")


def test_the_timeline_lies_within_the_commands_wall_time(timed_fit):
    timeline, before, after = (
        timed_fit["summary"]["timeline"],
        timed_fit["before"],
        timed_fit["after"],
    )
    # t0 is the process's start (10 ms ticks), after the test started it.
    assert before - 0.05 <= timeline["t0"] <= before + 5, (before, timeline["t0"])
    last = timeline["t0"] + timeline["teardown_s"]["files_written"]
    assert last <= after, (last, after)
    # What the summary does not cover (Python's exit) is small beside the run.
    assert after - last < 0.5 * (after - before), (after - last, after - before)


def test_phase_lines_show_the_moments_as_recorded(timed_fit):
    out, startup = timed_fit["out"], timed_fit["summary"]["timeline"]["startup_s"]
    lines = {text: float(seconds) for seconds, text in _PHASE.findall(out)}
    expected = {
        "Ray ready": "ray_ready",
        "workers starting": "trainer_started",
        "controller started": "controller_started",
        "2 worker(s) started": "worker_group_started",
        "process group formed (gloo)": "process_group_formed",
        "model prepared": "model_prepared",
        "first step": "first_step",
    }
    for text, key in expected.items():
        assert text in lines, out
        assert abs(lines[text] - startup[key]) <= 0.06, (text, lines[text], startup[key])
    shown = [float(seconds) for seconds, _ in _PHASE.findall(out)]
    assert shown == sorted(shown), out
