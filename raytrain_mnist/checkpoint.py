"""Save and load the full resume state of a run. Pure torch, no Ray.

A checkpoint is a directory holding one file, ``state.pt``: model, optimizer, scheduler and
grad-scaler state, completed epochs, best validation accuracy, per-epoch history, the
training config and the RNG state. Loading uses ``torch.load(weights_only=True)``: a file
that would run code when unpickled is refused, never executed.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from raytrain_mnist._cli import UserError
from raytrain_mnist.model import ConvNet

STATE_FILE = "state.pt"
FORMAT = "raytrain_mnist/1"


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message says why."""


def save(directory: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` into ``directory``/state.pt atomically (write, then rename)."""
    path = Path(directory) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    torch.save({"format": FORMAT, **state}, tmp)
    os.replace(tmp, path)
    return path


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint directory or its ``state.pt`` onto the CPU, safely.

    Raises :class:`CheckpointError` for a missing, corrupt, foreign or unsafe file.
    """
    path = Path(path)
    if path.is_dir():
        path = path / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # weights_only refuses globals it does not know: a pickle that would call code.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unsafe content"
        raise CheckpointError(
            f"refusing to load {path}: it is not a plain tensor checkpoint ({first[:160]})"
        ) from exc
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as exc:
        raise CheckpointError(f"{path} is corrupt or truncated ({exc.__class__.__name__})") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a raytrain_mnist checkpoint")
    return state


def load_model(path: str | os.PathLike) -> ConvNet:
    """A :class:`ConvNet` holding the weights of the checkpoint at ``path``."""
    return _model_from(load(path), path)


def _model_from(state: dict[str, Any], path: str | os.PathLike) -> ConvNet:
    model = ConvNet()
    try:
        model.load_state_dict(state["model"])
    except (KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{path} holds weights of a different model") from exc
    return model


RESUME_KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "history", "rng", "config")


def check_resumable(path: str | os.PathLike, train_config: dict[str, Any]) -> int:
    """Check that the checkpoint at ``path`` can resume a run of ``train_config``.

    Returns its epoch; raises :class:`CheckpointError` naming what is wrong.
    """
    state = load(path)
    missing = [key for key in RESUME_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: it cannot resume a run")
    _model_from(state, path)
    if state["config"] != train_config:
        raise CheckpointError(f"{path} was written by a run with other training settings")
    return int(state["epoch"])


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
