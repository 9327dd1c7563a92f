"""The layer contract (CONTRIBUTING.md, "Lint, format and layers") holds, and breaking it
fails here.

Import rules are import-linter contracts in pyproject.toml, run with ``lint-imports``; each is
shown to fail on a copy of the package with a violation planted. The rules an import graph
cannot express are AST checks below, each also shown to catch a planted line: only worker/
uses the worker-side ``ray.train`` API (the driver imports ``ray.train`` too, for its
exceptions and configs), only compat/ names private Ray or torch attributes, and only the
command layer prints (ruff's T20, configured for the same modules). ruff's lint and format
checks run here as well, so the README's test command is the whole CI gate.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

BIN = Path(sys.executable).parent
PACKAGE = REPO / "raytrain_mnist"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CONTRACTS = {c["id"]: c for c in PYPROJECT["tool"]["importlinter"]["contracts"]}

#: The worker-side Ray Train API: what only code running in a Train worker may call.
WORKER_API = {
    "ray.train.get_context",
    "ray.train.report",
    "ray.train.get_checkpoint",
    "ray.train.get_dataset_shard",
    "ray.train.torch.prepare_model",
    "ray.train.torch.prepare_data_loader",
    "ray.train.torch.prepare_optimizer",
    "ray.train.torch.get_device",
    "ray.train.torch.get_devices",
    "ray.train.torch.backward",
}


def _command_layer() -> set[str]:
    """The modules of the top layer of the layers contract (``__main__ : _cli : ...``)."""
    top = CONTRACTS["layers"]["layers"][0]
    return {name.strip() for name in re.split(r"[:|]", top)}


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "lint-imports"), "--config", "pyproject.toml", "--no-cache"],
        cwd=cwd,
        env={"PYTHONPATH": str(cwd), "PATH": f"{BIN}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


# --------------------------------------------------------------------------- import-linter


def test_the_import_contracts_hold():
    proc = _lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    kept = re.search(r"Contracts: (\d+) kept, 0 broken", proc.stdout)
    assert kept and int(kept[1]) == len(CONTRACTS), proc.stdout[-3000:]


@pytest.mark.parametrize(
    "path, line, contract",
    [
        # worker/ imports neither driver/ nor serving/
        ("worker/loop.py", "import raytrain_mnist.driver.cluster", "layers"),
        ("worker/feed.py", "from raytrain_mnist.serving import static", "layers"),
        # nn/ (torch shared by every process) imports neither the worker nor Ray
        ("nn/checkpoint.py", "from raytrain_mnist.worker import feed", "layers"),
        ("nn/score.py", "import ray.train", "no-ray-in-nn-config"),
        # nothing below the commands imports them, _cli or console
        ("driver/__init__.py", "from raytrain_mnist._cli import ArgumentParser", "layers"),
        ("errors.py", "import raytrain_mnist.console", "layers"),
        ("driver/trainer.py", "from raytrain_mnist import fit", "layers"),
        # Serve replicas never reach driver code (the driver deploys them: it may import serving)
        ("serving/__init__.py", "from raytrain_mnist.driver import cluster", "layers"),
        # pure modules stay below the worker
        ("data.py", "from raytrain_mnist.nn import optim", "layers"),
        # no cycles (here inside nn/: optim is imported by the checkpoint module)
        ("nn/optim.py", "import raytrain_mnist.nn.checkpoint", "acyclic"),
        # the model and config import no Ray, not even through another module
        ("nn/model.py", "import ray", "no-ray-in-nn-config"),
        ("config.py", "from ray import tune", "no-ray-in-nn-config"),
        # Ray's private modules only in compat/
        ("driver/cluster.py", "from ray._private import ray_constants", "private-ray-in-compat"),
        (
            "driver/trainer.py",
            "from ray.train.v2._internal.execution import context",
            "private-ray-in-compat",
        ),
        ("serve.py", "import ray.serve._private.constants", "private-ray-in-compat"),
    ],
)
def test_a_planted_import_breaks_its_contract(tmp_path, path, line, contract):
    shutil.copytree(PACKAGE, tmp_path / "raytrain_mnist", ignore=shutil.ignore_patterns("__py*"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    planted = tmp_path / "raytrain_mnist" / path
    planted.write_text(planted.read_text() + f"\n{line}  # planted by tests/test_layers.py\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    name = CONTRACTS[contract]["name"]
    assert f"{name} BROKEN" in proc.stdout, proc.stdout[-4000:]


def test_every_module_has_a_layer():
    """The layers contract is exhaustive: a new module of raytrain_mnist must be placed."""
    layers = CONTRACTS["layers"]
    assert layers.get("exhaustive") is True
    placed = {name.strip() for layer in layers["layers"] for name in re.split(r"[:|]", layer)}
    children = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"} | {
        p.parent.name for p in PACKAGE.glob("*/__init__.py")
    }
    assert children == placed


# --------------------------------------------------------------------------- AST rules


def _references(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every dotted name a module names, resolved through its imports (at any depth): the
    modules and names it imports (``from ray.train import report`` -> ``ray.train.report``)
    and each attribute chain on an imported name (``import ray.train.torch as rt``;
    ``rt.get_device`` -> ``ray.train.torch.get_device``), each chain whole."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.partition(".")[0]
                aliases[alias.asname or top] = alias.name if alias.asname else top
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                yield node.lineno, f"{node.module}.{alias.name}"
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue  # the whole chain once: `a.b.c`, not also `a.b`
        parts, base = [node.attr], node.value
        while isinstance(base, ast.Attribute):
            parts.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in aliases:
            yield node.lineno, ".".join([aliases[base.id], *reversed(parts)])


def _is_private(name: str) -> bool:
    """A name inside Ray or torch with a private part (``ray._private.x``, ``torch._C``,
    ``ray.train.v2._internal``); dunders such as ``torch.__version__`` are public."""
    head, *parts = name.split(".")
    return head in ("ray", "torch", "torchvision") and any(
        p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts
    )


def worker_api_uses(source: str) -> list[str]:
    return [
        f"{line}: {name}"
        for line, name in _references(ast.parse(source))
        if name in WORKER_API or any(name.startswith(f"{api}.") for api in WORKER_API)
    ]


def private_names(source: str) -> list[str]:
    return [f"{line}: {name}" for line, name in _references(ast.parse(source)) if _is_private(name)]


def print_calls(source: str) -> list[str]:
    return [
        f"{node.lineno}: print(...)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "print"
    ]


def _modules() -> Iterator[tuple[str, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(REPO)), path.read_text()


def _findings(check, where) -> list[str]:
    return [f"{name}:{hit}" for name, text in _modules() if where(name) for hit in check(text)]


def _in_command_layer(name: str) -> bool:
    return name.count("/") == 1 and Path(name).stem in _command_layer()


def test_only_worker_code_uses_the_worker_side_ray_train_api():
    found = _findings(worker_api_uses, lambda name: not name.startswith("raytrain_mnist/worker/"))
    assert not found, "the worker-side ray.train API outside worker/:\n" + "\n".join(found)


def test_only_compat_names_private_ray_and_torch_attributes():
    found = _findings(private_names, lambda name: not name.startswith("raytrain_mnist/compat/"))
    assert not found, "private Ray/torch names outside compat/:\n" + "\n".join(found)


def test_only_the_command_layer_prints():
    found = _findings(print_calls, lambda name: not _in_command_layer(name))
    assert not found, "print below the command layer (log, or return it):\n" + "\n".join(found)


def test_ruffs_print_rule_exempts_exactly_the_command_layer():
    ignores = PYPROJECT["tool"]["ruff"]["lint"]["per-file-ignores"]
    exempt = [
        set(m[1].split(","))
        for pattern, rules in ignores.items()
        if "T20" in rules and (m := re.fullmatch(r"raytrain_mnist/\{(.*)\}\.py", pattern))
    ]
    assert exempt == [_command_layer()], ignores
    others = [
        p
        for p, rules in ignores.items()
        if "T20" in rules and not p.startswith(("tests", "benchmarks"))
    ]
    assert len(others) == 1, others


@pytest.mark.parametrize(
    "check, source, expected",
    [
        (worker_api_uses, "import ray.train\nray.train.report({})", ["2: ray.train.report"]),
        (
            worker_api_uses,
            "from ray import train\ntrain.get_context()",
            ["2: ray.train.get_context"],
        ),
        (worker_api_uses, "from ray.train import get_checkpoint", ["1: ray.train.get_checkpoint"]),
        (
            worker_api_uses,
            "def f():\n    import ray.train.torch as rt\n    return rt.prepare_model(m)",
            ["3: ray.train.torch.prepare_model"],
        ),
        (
            worker_api_uses,
            "from ray.train import torch as t\nt.get_device()",
            ["2: ray.train.torch.get_device"],
        ),
        (worker_api_uses, "import ray.train\nraise ray.train.TrainingFailedError", []),
        (worker_api_uses, "from ray import tune\ntune.get_context().get_trial_id()", []),
        (
            private_names,
            "import ray\nray._private.worker.global_worker",
            ["2: ray._private.worker.global_worker"],
        ),
        (
            private_names,
            "import torch\ntorch._C._get_tracing_state()",
            ["2: torch._C._get_tracing_state"],
        ),
        (
            private_names,
            "from ray.serve import context\ncontext._get_global_client()",
            ["2: ray.serve.context._get_global_client"],
        ),
        (private_names, "import torch\ntorch.__version__", []),
        (print_calls, "def f():\n    print('hi')", ["2: print(...)"]),
        (print_calls, "import logging\nlogging.getLogger(__name__).info('hi')", []),
    ],
)
def test_the_ast_checks_catch_what_they_name(check, source, expected):
    assert check(source) == expected


# --------------------------------------------------------------------------- ruff


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=" ".join)
def test_ruff_is_clean(command):
    proc = subprocess.run(
        [str(BIN / "ruff"), *command, "raytrain_mnist", "tests", "benchmarks"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
