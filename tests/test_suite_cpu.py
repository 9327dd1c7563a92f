"""benchmarks/suite_cpu.py: each test's processes go to a cgroup of its own, and the report
sums them by test and by file. Here on plain folders (the cgroup files written by hand)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from benchmarks import suite_cpu


def test_a_test_moves_its_process_to_a_cgroup_of_its_own_and_the_report_sums_by_file(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("RAYTRAIN_MNIST_SUITE_CPU", str(tmp_path))
    monkeypatch.setattr(suite_cpu, "_EARLIER", {})
    suite_cpu.pytest_runtest_setup(SimpleNamespace(nodeid="tests/test_a.py::test_x[s3]@group"))
    group = tmp_path / "tests_test_a.py__test_x_s3_"
    assert (group / "cgroup.procs").read_text() == str(os.getpid())
    (group / "cpuacct.usage").write_text("2500000000")  # what the kernel counts: ns
    for name, ns in (("tests_test_a.py__test_y", "500000000"), ("tests_test_b.py__t", "1")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cpuacct.usage").write_text(ns)
    seconds = suite_cpu.usage(tmp_path)
    assert seconds["tests_test_a.py__test_x_s3_"] == 2.5
    assert suite_cpu.by_file(seconds) == {"tests_test_a.py": 3.0, "tests_test_b.py": 1e-9}
    assert suite_cpu.main(["--top", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("3 CPU-seconds in 3 tests")
    assert "     3.0  tests_test_a.py\n" in out and "tests_test_b.py" not in out


def test_where_it_cannot_make_a_cgroup_the_test_runs_on_and_says_why(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("RAYTRAIN_MNIST_SUITE_CPU", str(tmp_path / "file"))
    suite_cpu.pytest_runtest_setup(SimpleNamespace(nodeid="tests/test_a.py::test_x"))
    assert capsys.readouterr().err.startswith(f"suite_cpu: {tmp_path / 'file'}")


def test_a_shared_rays_work_during_a_test_is_charged_to_that_test(tmp_path, monkeypatch, capsys):
    root, log = tmp_path / "suite", tmp_path / "moves.tsv"
    monkeypatch.setenv("RAYTRAIN_MNIST_SUITE_CPU", str(root))
    monkeypatch.setenv("RAYTRAIN_MNIST_SUITE_CPU_LOG", str(log))
    monkeypatch.setattr(suite_cpu, "_EARLIER", {})
    first, second = (SimpleNamespace(nodeid=f"tests/test_a.py::{n}") for n in ("starts", "uses"))
    suite_cpu.pytest_runtest_setup(first)  # starts a shared Ray: its processes are charged here
    starter = root / "tests_test_a.py__starts"
    (starter / "cpuacct.usage").write_text("4000000000")
    suite_cpu.pytest_runtest_teardown(first, second)
    suite_cpu.pytest_runtest_setup(second)
    (starter / "cpuacct.usage").write_text("7000000000")  # the shared Ray works for `uses`
    (root / "tests_test_a.py__uses" / "cpuacct.usage").write_text("1000000000")
    suite_cpu.pytest_runtest_teardown(second, None)
    assert log.read_text() == "tests_test_a.py__starts\ttests_test_a.py__uses\t3000000000\n"
    moved = suite_cpu.charged(suite_cpu.usage(root), log)
    assert moved == {"tests_test_a.py__starts": 4.0, "tests_test_a.py__uses": 4.0}
    assert suite_cpu.main(["--root", str(root)]) == 0
    assert "charged to the test it ran for:\n     4.0" in capsys.readouterr().out
    # A test skipped by its marker has a teardown and no setup of ours: charged nothing again.
    suite_cpu.pytest_runtest_teardown(SimpleNamespace(nodeid="tests/test_a.py::skipped"), None)
    assert log.read_text() == "tests_test_a.py__starts\ttests_test_a.py__uses\t3000000000\n"
    (starter / "cgroup.procs").write_text("")  # the shared Ray stopped: read no more
    suite_cpu.pytest_runtest_setup(SimpleNamespace(nodeid="tests/test_a.py::later"))
    assert (
        starter not in suite_cpu._EARLIER and root / "tests_test_a.py__uses" in suite_cpu._EARLIER
    )
