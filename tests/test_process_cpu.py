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


def test_a_command_is_required():
    with pytest.raises(SystemExit):
        process_cpu.main([])
