"""``raytrain-mnist COMMAND ...`` / ``python -m raytrain_mnist COMMAND ...``.

The commands are registered here, once. Each module's ``COMMAND`` (a
:class:`raytrain_mnist._cli.Command`) is imported only when it runs, so ``--help`` and an
unknown command answer without loading torch or Ray.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from raytrain_mnist._cli import Command, exit_now

#: name -> what it does (the module is ``raytrain_mnist.<name>``).
COMMANDS = {
    "fit": "train the ConvNet data-parallel on Ray Train",
    "tune": "search hyperparameters with Ray Tune, every trial a Ray Train run",
    "evaluate": "score a checkpoint on the test set: per-class accuracy, confusion matrix",
    "runs": "list the runs and searches under a storage path; 'runs show NAME' for one",
    "predict": "classify PNG/JPEG/IDX image files with a checkpoint, in this process",
    "export": "export a checkpoint's model as a torch.export program (pt2) or ONNX",
    "submit": "run fit, tune, evaluate or serve on a Ray cluster through the Jobs API",
    "serve": "serve a checkpoint over HTTP with Ray Serve: JSON API and a page to draw on",
    "service": "a warm training service: worker groups that train `fit --service` runs and trials",
}
#: Shells ``raytrain-mnist completion SHELL`` writes a completion script for.
COMPLETION_SHELLS = ("bash", "zsh")


def load_command(name: str) -> Command:
    """The registered command ``name`` (a KeyError for any other name)."""
    if name not in COMMANDS:
        raise KeyError(name)
    return importlib.import_module(f"raytrain_mnist.{name}").COMMAND


def completion_parser():
    """One parser holding every command's (its subcommands), for shell completion."""
    from raytrain_mnist._cli import ArgumentParser

    parser = ArgumentParser(prog="raytrain-mnist")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in COMMANDS.items():
        commands.add_parser(name, help=text)
        commands.choices[name] = load_command(name).build_parser()  # the command's own
    shell = commands.add_parser("completion", help="print a shell completion script")
    shell.add_argument("shell", choices=COMPLETION_SHELLS)
    return parser


def completion(argv: Sequence[str]) -> int:
    """``raytrain-mnist completion bash|zsh``: the script on stdout (shtab writes it)."""
    if argv[:1] in (["-h"], ["--help"]) or len(argv) != 1 or argv[0] not in COMPLETION_SHELLS:
        print(
            "usage: raytrain-mnist completion {bash,zsh}\n\n"
            'Print a completion script: eval "$(raytrain-mnist completion bash)" in ~/.bashrc, '
            "or raytrain-mnist completion zsh > ~/.zfunc/_raytrain-mnist (a directory on "
            "$fpath)",
            file=sys.stdout if argv[:1] in (["-h"], ["--help"]) else sys.stderr,
        )
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    import os

    import shtab

    try:
        print(shtab.complete(completion_parser(), shell=argv[0]), flush=True)
    except BrokenPipeError:  # `| head`: the reader had enough, which is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _version() -> str:
    from raytrain_mnist import __version__

    return f"raytrain-mnist {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        print(_version())
        return 0
    if argv[:1] == ["completion"]:
        return completion(argv[1:])
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<10} {text}" for name, text in COMMANDS.items()]
        lines.append(f"  {'completion':<10} print a shell completion script (bash or zsh)")
        print(
            "usage: raytrain-mnist COMMAND [flags]   (COMMAND --help for its flags)\n"
            "       raytrain-mnist --version\n\n"
            "commands:\n" + "\n".join(lines),
            file=sys.stderr if argv[:1] else sys.stdout,
        )
        if argv and argv[0] not in ("-h", "--help"):
            print(f"raytrain-mnist: error: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    return load_command(argv[0]).main(argv[1:])


def console() -> None:
    """The ``raytrain-mnist`` console script: :func:`main`, then the process ends with its
    status (:func:`raytrain_mnist._cli.exit_now`)."""
    exit_now(main())


if __name__ == "__main__":
    console()
