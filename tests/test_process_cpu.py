"""benchmarks/process_cpu.py: a command's CPU, its children's included, by process kind."""

from __future__ import annotations

import sys

import pytest

from benchmarks import process_cpu

_CHILD = "x = 0\nfor i in range(5 * 10**6):\n    x += i\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_child_process_is_counted_under_its_own_kind():
    spawn = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {_CHILD!r}])"
    result = process_cpu.measure([sys.executable, "-c", spawn])
    assert result["returncode"] == 0, result
    assert result["processes"] == 2, result
    python = next(iter(result["by_kind"].values()))
    assert python["processes"] == 2 and python["cpu_s"] >= 0.1, result  # the child's loop
    assert result["cpu_s"] <= result["wall_s"] * 2 + 0.5  # two cores at most


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_kinds_cpu_splits_by_thread_and_the_busy_thread_holds_it():
    burn = f"import threading\nt = threading.Thread(target=exec, args=({_CHILD * 3!r},))\n"
    burn += "t.start(); t.join()"
    kind = process_cpu._kind([sys.executable.encode(), b"-c"])
    result = process_cpu.measure([sys.executable, "-c", burn], threads_of=(kind,))
    assert result["returncode"] == 0, result
    threads = result["threads"][kind]
    total = result["by_kind"][kind]["cpu_s"]
    # Two threads (main and the burner; Python 3.11 names neither) under one name: their CPU
    # is the process's, less at most the burner's last quarter-second between samples.
    assert total >= 0.3 and total - 0.25 <= sum(threads.values()) <= total + 0.01, result


def test_a_command_is_required():
    with pytest.raises(SystemExit):
        process_cpu.main([])
