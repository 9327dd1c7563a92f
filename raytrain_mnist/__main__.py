"""``raytrain-mnist COMMAND ...`` / ``python -m raytrain_mnist COMMAND ...``.

The commands are registered here, once. Each module's ``COMMAND`` (a
:class:`raytrain_mnist._cli.Command`) is imported only when it runs, so ``--help`` and an
unknown command answer without loading torch or Ray.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from raytrain_mnist._cli import Command

#: name -> what it does (the module is ``raytrain_mnist.<name>``).
COMMANDS = {
    "fit": "train the ConvNet data-parallel on Ray Train",
    "tune": "search hyperparameters with Ray Tune, every trial a Ray Train run",
    "evaluate": "score a checkpoint on the test set: per-class accuracy, confusion matrix",
    "submit": "run fit, tune, evaluate or serve on a Ray cluster through the Jobs API",
    "serve": "serve a checkpoint over HTTP with Ray Serve: JSON API and a page to draw on",
}


def load_command(name: str) -> Command:
    """The registered command ``name`` (a KeyError for any other name)."""
    if name not in COMMANDS:
        raise KeyError(name)
    return importlib.import_module(f"raytrain_mnist.{name}").COMMAND


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<9} {text}" for name, text in COMMANDS.items()]
        print(
            "usage: raytrain-mnist COMMAND [flags]   (COMMAND --help for its flags)\n\n"
            "commands:\n" + "\n".join(lines),
            file=sys.stderr if argv[:1] else sys.stdout,
        )
        if argv and argv[0] not in ("-h", "--help"):
            print(f"raytrain-mnist: error: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    return load_command(argv[0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
