"""``raytrain-mnist COMMAND ...`` / ``python -m raytrain_mnist COMMAND ...``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

COMMANDS = {
    "fit": "train the ConvNet data-parallel on Ray Train",
    "tune": "search hyperparameters with Ray Tune, every trial a Ray Train run",
    "evaluate": "score a checkpoint on the test set: per-class accuracy, confusion matrix",
    "submit": "run fit or tune on a Ray cluster through the Jobs API, and follow it",
    "serve": "serve a checkpoint over HTTP with Ray Serve: JSON API and a page to draw on",
}


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
    module = importlib.import_module(f"raytrain_mnist.{argv[0]}")
    return module.cli(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
