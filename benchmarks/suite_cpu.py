"""The test suite's CPU-seconds, by test and by file: where a suite's time goes.

    make test ARGS='-p benchmarks.suite_cpu'             # as root, on Linux's cgroup v1
    python -m benchmarks.suite_cpu                        # the report, heaviest first

A pytest plugin and its report. Before each test, the process running it (pytest's or an
xdist worker's) moves into a cpuacct cgroup of that test's own, so everything it starts from
then on, the processes of a command, a Ray's raylet and every worker that raylet forks, is
charged to that test. A process that outlives its test stays charged to it: a shared Ray's
work all lands on the test that started it, a module fixture's on the module's first test,
so read shared fixtures by file. Wall time says little on two busy cores; this counts the
CPU that sets it. ``RAYTRAIN_MNIST_SUITE_CPU`` names the folder of cgroups
(``/sys/fs/cgroup/cpuacct/raytrain-suite`` by default); the counts add up over runs, so give
each run a folder of its own.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

_DEFAULT = "/sys/fs/cgroup/cpuacct/raytrain-suite"


def _root() -> Path:
    return Path(os.environ.get("RAYTRAIN_MNIST_SUITE_CPU", _DEFAULT))


def cgroup_name(nodeid: str) -> str:
    """A test's node id (its xdist group suffix dropped) as a folder name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", nodeid.split("@")[0])[-200:]


def pytest_runtest_setup(item) -> None:
    group = _root() / cgroup_name(item.nodeid)
    try:
        group.mkdir(parents=True, exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:  # not root, no cgroup v1: the suite runs on, uncounted
        print(f"suite_cpu: {group}: {exc}", file=sys.stderr)


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
