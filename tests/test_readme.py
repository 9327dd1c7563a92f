"""The README is a guide that stays true: short, its links lead somewhere, every flag it names
exists, and every command it shows parses with the real parsers (the full flag list is
``--help``'s, generated from the config dataclasses). Every other document (docs/*.md,
CONTRIBUTING.md, benchmarks/README.md) keeps its links and its commands true too."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from raytrain_mnist.__main__ import load_command
from tests.conftest import REPO

README = REPO / "README.md"
#: Documents whose commands and links this file checks: every one.
GUIDES = [
    README,
    *sorted((REPO / "docs").rglob("*.md")),
    REPO / "CONTRIBUTING.md",
    REPO / "benchmarks" / "README.md",
]
MAX_BYTES = 16 * 1024
COMMANDS = ("fit", "tune", "evaluate", "runs", "predict", "export", "submit", "serve", "service")
#: What ends a command on a shell line: a pipe, a redirection, a list.
_SHELL_OPERATORS = ("|", "||", "&&", ";", ">", ">>", "<", "2>", "&")


# --------------------------------------------------------------------------- helpers


def _blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block."""
    return re.findall(r"^```([^\n]*)\n(.*?)^```", text, re.M | re.S)


def _shell_lines(body: str, prompt: bool) -> list[str]:
    """The commands of a block, continuation lines joined; with ``prompt`` only ``$ `` lines."""
    lines, pending = [], ""
    for line in body.splitlines():
        if prompt:
            if line.startswith("$ "):
                lines.append(line[2:])
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return [line for line in lines if line.strip()]


def package_commands(doc: Path) -> list[tuple[str, list[str], str]]:
    """(command, its arguments, the line) for every ``raytrain-mnist ...``, ``python -m
    raytrain_mnist[.COMMAND] ...`` and ``make fit ARGS=...`` in the document's code blocks
    (``text`` blocks: only the lines after a ``$`` prompt)."""
    found = []
    for info, body in _blocks(doc.read_text()):
        exported: dict[str, str] = {}  # what an `export` line of the block set
        for line in _shell_lines(body, prompt=info.strip() == "text"):
            words = shlex.split(line, comments=True)
            if words[:1] == ["export"]:
                for word in words[1:]:
                    name, _, value = word.partition("=")
                    # A value the shell computes ("$(python -c ...)": a token) stands in
                    # as one such value.
                    exported[name] = "T" * 43 if "$(" in value else value
                continue
            if exported:  # the block's later commands run with it: VAR=value before them
                prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in exported.items())
                line = f"{prefix} {line}"
                words = shlex.split(line, comments=True)
            for i, word in enumerate(words):
                if word in _SHELL_OPERATORS:
                    words = words[:i]
                    break
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                words = words[1:]  # VAR=value before the command
            if "--" in words and words[:1] == ["ray"]:  # ray job submit ... -- python -m ...
                words = words[words.index("--") + 1 :]
            if words[:2] == ["make", "fit"]:
                args = [w.partition("=")[2] for w in words[2:] if w.startswith("ARGS=")]
                found.append(("fit", shlex.split(args[0]) if args else [], line))
            elif words[:1] == ["raytrain-mnist"] or words[:3] == ["python", "-m", "raytrain_mnist"]:
                rest = words[1:] if words[0] == "raytrain-mnist" else words[3:]
                found.append((rest[0] if rest else "", rest[1:], line))
            elif words[:2] == ["python", "-m"] and words[2].startswith("raytrain_mnist."):
                found.append((words[2].partition(".")[2], words[3:], line))
    return found


def parse(command: str, args: list[str]) -> None:
    """Parse (and validate) ``args`` as ``raytrain-mnist COMMAND`` would, without running it:
    the command's own parse (submit's checks the command after ``--`` through that one's)."""
    if command in ("", "-h", "--help", "--version"):
        return
    if command == "completion":
        assert args in (["bash"], ["zsh"]), f"completion {args}"
        return
    assert command in COMMANDS, f"no command {command!r}"
    load_command(command).parse(args)


def option_strings(command: str) -> set[str]:
    module = importlib.import_module(f"raytrain_mnist.{command}")
    return {s for action in module.build_parser()._actions for s in action.option_strings}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


# --------------------------------------------------------------------------- the checks


def test_readme_is_short_and_starts_with_the_two_commands():
    raw = README.read_bytes()
    assert len(raw) <= MAX_BYTES, (
        f"README.md is {len(raw)} bytes; a guide stays within "
        f"{MAX_BYTES} (measurements: benchmarks/README.md, the "
        "suite: CONTRIBUTING.md, depth: docs/)"
    )
    text = raw.decode()
    first = _blocks(text)[0][1]
    commands = [line.split("#")[0].strip() for line in first.splitlines()]
    assert commands == ["make fit", "make test"]
    assert text.index("make fit") < 200, "the two commands come first"


@pytest.mark.parametrize("doc", GUIDES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_lead_to_files_and_headings(doc):
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.name} links to {target}, which does not exist"
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{doc.name}: no heading #{anchor}"


@pytest.mark.parametrize("doc", GUIDES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_shown_parses_with_the_real_parsers(doc, monkeypatch):
    found = package_commands(doc)
    if doc in (README, REPO / "docs" / "cluster.md"):
        assert found, f"no raytrain_mnist command found in {doc.name}"
    failures = []
    for command, args, line in found:
        try:
            with monkeypatch.context() as env:  # VAR=value before the command: its environment
                for word in shlex.split(line, comments=True):
                    if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word):
                        break
                    env.setenv(*word.split("=", 1))
                parse(command, args)
        except SystemExit as exc:  # argparse: a usage error (or --help, status 0)
            if exc.code not in (0, None):
                failures.append(f"{line}  -> exit {exc.code}")
        except Exception as exc:  # a config rule the command breaks
            failures.append(f"{line}  -> {exc}")
    assert not failures, "commands that do not parse:\n" + "\n".join(failures)


def test_readme_finds_the_commands_it_shows():
    """The extractor sees what a reader sees: each entry point and each command."""
    found = package_commands(README)
    assert {c for c, _, _ in found} >= set(COMMANDS)


def test_every_document_is_checked():
    """A new document is checked without anyone remembering to add it here."""
    docs = {p for p in REPO.rglob("*.md") if not {".venv", "node_modules", ".git"} & set(p.parts)}
    generated = REPO / "benchmarks" / "results"  # tables a benchmark writes: no commands
    docs = {p for p in docs if ".pytest_cache" not in p.parts and generated not in p.parents}
    assert docs <= set(GUIDES), sorted(str(p.relative_to(REPO)) for p in docs - set(GUIDES))


def test_every_flag_the_readme_names_exists():
    """The flag table is a selection of fit's flags, none stale; every flag named in the
    prose (`--flag ...`) belongs to some command."""
    text = README.read_text()
    section = re.search(r"^## The flags that matter\s*$(.*?)(?=^## )", text, re.M | re.S)
    assert section, "README has no section '## The flags that matter'"
    table = set(re.findall(r"^\|\s*`(--[a-z][a-z0-9-]*)`", section.group(1), re.M))
    assert len(table) >= 8, "the flag table lists the flags that matter"
    assert table - option_strings("fit") == set(), "README's table lists flags fit lacks"
    every = set().union(*(option_strings(c) for c in COMMANDS))
    named = {
        m
        for span in re.findall(r"`(--[^`]*)`", text)
        for m in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span)
    }
    assert named - every == set(), "README names flags no command has"
