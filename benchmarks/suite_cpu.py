"""The test suite's CPU-seconds, by test and by file: where a suite's time goes.

    make test ARGS='-p benchmarks.suite_cpu'             # as root, on Linux's cgroup v1
    python -m benchmarks.suite_cpu                        # the report, heaviest first

A pytest plugin and its report. Before each test, the process running it (pytest's or an
xdist worker's) moves into a cpuacct cgroup of that test's own, so everything it starts from
then on, the processes of a command, a Ray's raylet and every worker that raylet forks, is
charged to that test. A process that outlives its test stays charged to it: a shared Ray's
work all lands on the test that started it, a module fixture's on the module's first test,
so the plugin also notes what each of its process's earlier cgroups (a shared Ray's) used
while a test ran, and the report's last list charges that work to the test that caused it
(and the idle ticking of a shared Ray to whichever test was running). Wall time says little
on two busy cores; this counts the CPU that sets it. ``RAYTRAIN_MNIST_SUITE_CPU`` names the
folder of cgroups (``/sys/fs/cgroup/cpuacct/raytrain-suite`` by default) and
``RAYTRAIN_MNIST_SUITE_CPU_LOG`` the file of those moves (``/tmp/<that folder's
name>.shared.tsv`` by default); both add up over runs, so give each run names of its own.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

_DEFAULT = "/sys/fs/cgroup/cpuacct/raytrain-suite"


def _root() -> Path:
    return Path(os.environ.get("RAYTRAIN_MNIST_SUITE_CPU", _DEFAULT))


def cgroup_name(nodeid: str) -> str:
    """A test's node id (its xdist group suffix dropped) as a folder name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", nodeid.split("@")[0])[-200:]


#: This process's cgroups -> their usage at the last setup or teardown.
_EARLIER: dict[Path, int] = {}


def _ns(group: Path) -> int:
    try:
        return int((group / "cpuacct.usage").read_text())
    except (OSError, ValueError):
        return 0


def _shared_log(root: Path | None = None) -> Path:
    """Where the moves of the cgroups under ``root`` are written: a file (cgroupfs takes
    none of ours)."""
    default = f"/tmp/{(root or _root()).name}.shared.tsv"
    return Path(os.environ.get("RAYTRAIN_MNIST_SUITE_CPU_LOG", default))


def _empty(group: Path) -> bool:
    try:
        return not (group / "cgroup.procs").read_text().strip()
    except OSError:
        return True


def pytest_runtest_setup(item) -> None:
    group = _root() / cgroup_name(item.nodeid)
    for earlier in list(_EARLIER):
        if _empty(earlier):  # no process is left in it, and none can join: it uses no more
            del _EARLIER[earlier]
        else:
            _EARLIER[earlier] = _ns(earlier)
    try:
        group.mkdir(parents=True, exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:  # not root, no cgroup v1: the suite runs on, uncounted
        print(f"suite_cpu: {group}: {exc}", file=sys.stderr)
        return
    _EARLIER.setdefault(group, _ns(group))


@pytest.hookimpl(trylast=True)  # after pytest's own: the test's fixtures are torn down
def pytest_runtest_teardown(item, nextitem) -> None:
    name = cgroup_name(item.nodeid)
    now = {group: _ns(group) for group in _EARLIER}
    used = {g: now[g] - before for g, before in _EARLIER.items() if g.name != name}
    # A test skipped by its marker never reached this plugin's setup (pytest's skipping
    # runs first): what the earlier cgroups used is counted from here on, not twice.
    _EARLIER.update(now)
    lines = [f"{earlier.name}\t{name}\t{ns}\n" for earlier, ns in used.items() if ns > 0]
    if lines:
        with _shared_log().open("a") as log:  # one short append per test: whole lines
            log.write("".join(lines))


def charged(seconds: dict[str, float], log: Path) -> dict[str, float]:
    """``seconds`` with each shared Ray's work during a test moved from the test that
    started it to the test that ran then (the lines of ``log``: from, to, nanoseconds)."""
    moved = dict(seconds)
    if log.is_file():
        for line in log.read_text().splitlines():
            source, target, ns = line.split("\t")
            moved[source] = moved.get(source, 0.0) - int(ns) / 1e9
            moved[target] = moved.get(target, 0.0) + int(ns) / 1e9
    return moved


def usage(root: Path) -> dict[str, float]:
    """CPU-seconds by cgroup (test) under ``root``."""
    seconds = {}
    for group in root.iterdir():
        counter = group / "cpuacct.usage"
        if counter.is_file():
            seconds[group.name] = int(counter.read_text()) / 1e9
    return seconds


def by_file(seconds: dict[str, float]) -> dict[str, float]:
    files: dict[str, float] = defaultdict(float)
    for name, value in seconds.items():
        files[name.split("__", 1)[0]] += value  # "tests_test_x.py__test_y" -> its file
    return dict(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=_root())
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"no cgroups under {args.root}: run the suite with -p benchmarks.suite_cpu")
    seconds = usage(args.root)
    print(f"{sum(seconds.values()):.0f} CPU-seconds in {len(seconds)} tests\n\nby file:")
    for name, value in sorted(by_file(seconds).items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{value:8.1f}  {name}")
    print("\nby test:")
    for name, value in sorted(seconds.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{value:8.1f}  {name}")
    log = _shared_log(args.root)
    if log.is_file():
        print("\nby test, a shared Ray's work charged to the test it ran for:")
        moved = charged(seconds, log)
        for name, value in sorted(moved.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"{value:8.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
