"""The house rules of issue 28 hold, and each check is shown to catch a planted breach: no
module of the package over 600 lines and no function over 60, and no line kept from the
formatter (``fmt: skip``, issue 60); outside ``worker/``, code takes
from ``raytrain_mnist.worker`` only the functions it hands Ray to run in workers, and from the
package itself, which imports no torch;
``RunSettings`` keeps at most 8 direct fields (its sections hold the rest). ruff's C901 and
PLR0913 limits live in pyproject.toml and run in tests/test_layers.py."""

from __future__ import annotations

import ast
import dataclasses
import io
import tokenize

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "raytrain_mnist"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
#: What code outside worker/ may import from it: the functions Ray runs in Train workers.
HANDED_TO_RAY = {"train_func_per_worker", "score_per_worker", "serve_requests"}


def too_long(source: str, name: str) -> list[str]:
    found = []
    if source.count("\n") > MAX_MODULE_LINES:
        found.append(f"{name}: {source.count(chr(10))} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


def worker_imports(source: str, name: str) -> list[str]:
    """What is imported from raytrain_mnist.worker(.*) beyond the functions handed to Ray,
    and those from anywhere but the package itself (its modules import torch; the package
    imports nothing)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "raytrain_mnist.worker" or node.module.startswith(
                "raytrain_mnist.worker."
            ):
                found += [
                    f"{name}:{node.lineno} {node.module}.{a.name}"
                    for a in node.names
                    if a.name not in HANDED_TO_RAY or node.module != "raytrain_mnist.worker"
                ]
        elif isinstance(node, ast.Import):
            found += [
                f"{name}:{node.lineno} import {a.name}"
                for a in node.names
                if a.name.startswith("raytrain_mnist.worker")
            ]
    return found


def formatter_opt_outs(source: str, name: str) -> list[str]:
    """Comments that keep a line out of ruff's formatter (``fmt: skip``): the formatter
    lays the code out, and a statement crammed by hand under the 60-line rule is a function
    that wants splitting."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [
        f"{name}:{token.start[0]} fmt: skip"
        for token in tokens
        if token.type == tokenize.COMMENT and "fmt: skip" in token.string
    ]


def _modules(outside_worker: bool = False):
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if outside_worker and relative.parts[0] == "worker":
            continue
        yield str(relative), path.read_text()


def test_no_module_over_600_lines_and_no_function_over_60():
    found = [f for name, source in _modules() for f in too_long(source, name)]
    assert not found, "\n".join(found)


def test_no_line_is_kept_from_the_formatter():
    found = [f for name, source in _modules() for f in formatter_opt_outs(source, name)]
    assert not found, "\n".join(found)


def test_outside_worker_only_the_functions_handed_to_ray_come_from_it():
    found = [
        f for name, source in _modules(outside_worker=True) for f in worker_imports(source, name)
    ]
    assert not found, "\n".join(found)


def test_run_settings_has_at_most_eight_direct_fields():
    from raytrain_mnist.config import RunSettings

    assert len(dataclasses.fields(RunSettings)) <= 8, [
        f.name for f in dataclasses.fields(RunSettings)
    ]


@pytest.mark.parametrize(
    "check, source, expected",
    [
        (too_long, "def f():\n" + "    x = 1\n" * 60, ["m.py:1 f: 61 lines"]),
        (too_long, "x = 1\n" * 601, ["m.py: 601 lines"]),
        (too_long, "def f():\n" + "    x = 1\n" * 59, []),
        (
            worker_imports,
            "from raytrain_mnist.worker.feed import ProgressFeed",
            ["m.py:1 raytrain_mnist.worker.feed.ProgressFeed"],
        ),
        (
            worker_imports,
            "import raytrain_mnist.worker.loop",
            ["m.py:1 import raytrain_mnist.worker.loop"],
        ),
        (
            worker_imports,
            "from raytrain_mnist.worker.loop import train_func_per_worker",
            ["m.py:1 raytrain_mnist.worker.loop.train_func_per_worker"],
        ),
        (worker_imports, "from raytrain_mnist.worker import train_func_per_worker", []),
        (formatter_opt_outs, "x = [1,\n     2]  # fmt: skip\n", ["m.py:2 fmt: skip"]),
        (formatter_opt_outs, 'x = "# fmt: skip"  # a string, not a comment\n', []),
    ],
)
def test_each_house_check_catches_a_planted_breach(check, source, expected):
    assert check(source, "m.py") == expected
