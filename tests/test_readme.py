"""The README's flag tables say what the real CLIs' --help says: no flag missing, none stale."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO, run_cli

README = REPO / "README.md"


def help_flags(command: str) -> set[str]:
    """Every option ``python -m raytrain_mnist COMMAND --help`` defines (not -h/--help)."""
    result = run_cli(command, "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    # argparse lists each option at the start of a line: "  --flag VALUE   help text".
    flags = set(re.findall(r"^\s{2}(?:-\w[^,]*, )?(--[a-z][a-z0-9-]*)", result.stdout, re.M))
    return flags - {"--help"}


def readme_table_flags(heading: str) -> set[str]:
    """The flags in the first column of the first table under ``heading``."""
    text = README.read_text()
    match = re.search(rf"^{re.escape(heading)}\s*$(.*?)(?=^#{{1,3}} |\Z)", text, re.M | re.S)
    assert match, f"README has no section {heading!r}"
    rows = [line for line in match.group(1).splitlines() if line.startswith("|")]
    assert rows, f"no table under {heading!r}"
    return {flag for row in rows for flag in re.findall(r"^\|\s*`(--[a-z][a-z0-9-]*)", row)}


@pytest.mark.parametrize("command, heading", [
    ("fit", "## Flags"),
    ("evaluate", "### Evaluation flags"),
])
def test_readme_flag_table_matches_help(command, heading):
    in_help, in_readme = help_flags(command), readme_table_flags(heading)
    assert in_help, "parsed no flags from --help"
    assert in_help - in_readme == set(), f"flags of `{command} --help` missing from the README"
    assert in_readme - in_help == set(), f"README lists flags `{command}` does not have"
