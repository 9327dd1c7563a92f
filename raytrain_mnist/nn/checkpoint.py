"""Save, load and check the full resume state of a run. Pure torch, no Ray.

A checkpoint is a directory holding one file, ``state.pt``: model, optimizer, scheduler and
grad-scaler state, completed epochs, best validation accuracy, per-epoch history, the
training config, the RNG state and the position within the next epoch (:data:`RESUME_KEYS`;
the worker builds it in ``loop.checkpoint_state``). :func:`resumable_state` checks on the
driver, before any worker starts, that a checkpoint will load where the worker loads it.

Format 2 added ``position`` (:func:`boundary_position`): a checkpoint written mid-epoch (a
preemption's, just in time) says how many steps of the next epoch it holds, the sums of
that epoch's metrics so far, the sampler's seed and epoch, and the world size that wrote it.
A format-1 checkpoint loads as what it was: one written at an epoch's end.

Loading uses ``torch.load(weights_only=True)``: a file that would run code when unpickled is
refused, never executed. That refusal is only as good as torch's: releases before 2.10 have
known bypasses, so loading needs at least that. Before torch reads anything, the archive is
checked with :mod:`zipfile` (sizes from its central directory): the records ``torch.save``
writes are stored uncompressed, so a compressed one (which could inflate without bound), more
than :data:`MAX_RECORDS` records, or more than
:data:`~raytrain_mnist.config.MAX_CHECKPOINT_BYTES` in all is refused.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import re
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from raytrain_mnist.config import MAX_CHECKPOINT_BYTES, TrainConfig
from raytrain_mnist.display import excerpt, is_count
from raytrain_mnist.errors import ConfigError, UserError, first_line
from raytrain_mnist.nn.model import ConvNet
from raytrain_mnist.nn.optim import build_optimizer

STATE_FILE = "state.pt"
FORMAT = "raytrain_mnist/2"
#: Every format :func:`load` reads; older ones are brought up to :data:`FORMAT` as they load.
FORMATS = ("raytrain_mnist/1", FORMAT)
#: The oldest torch whose ``weights_only`` loading has no known bypass (CVE-2025-32434 covers
#: releases before 2.6, a later advisory those before 2.10); pyproject.toml requires it too.
MIN_TORCH = (2, 10)


#: The most records its archive may list (torch.save writes one per tensor storage, plus a
#: few: ours hold under a hundred). Bounds the central directory zipfile reads.
MAX_RECORDS = 10_000
_EOCD = struct.Struct("<4s4H2LH")  # the end of central directory record
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")


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
    check_torch()
    path = Path(path)
    if path.is_dir():
        path = path / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    check_archive(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # weights_only refuses globals it does not know: a pickle that would call code.
        raise CheckpointError(
            f"refusing to load {path}: it is not a plain tensor checkpoint ({first_line(exc)})"
        ) from exc
    except Exception as exc:  # a malformed stream fails in many ways; none is a bug of ours
        raise CheckpointError(f"{path} is corrupt or truncated ({exc.__class__.__name__})") from exc
    if not isinstance(state, dict) or state.get("format") not in FORMATS:
        raise CheckpointError(f"{path} is not a raytrain_mnist checkpoint")
    # weights_only loads any plain value: what a command shows or follows is checked here.
    epoch, history = state.get("epoch"), state.get("history")
    if epoch is not None and not is_count(epoch):
        raise CheckpointError(
            f"{path}: its epoch {excerpt(epoch)} is not a completed epoch (a count)"
        )
    if history is not None and not (
        isinstance(history, list) and all(isinstance(h, dict) for h in history)
    ):
        raise CheckpointError(f"{path}: its history is not a list of per-epoch records")
    if state["format"] != FORMAT and epoch is not None:
        # Format 1 knew no position: it was always written at the end of epoch `epoch`.
        state["position"] = boundary_position(state.get("config") or {}, state["epoch"])
        state["format"] = FORMAT
    return state


def boundary_position(config: dict[str, Any], epoch: int, world_size: int | None = None) -> dict:
    """The ``position`` of a checkpoint written at the end of ``epoch`` completed epochs:
    no step of the next epoch done. ``config`` is the run's TrainConfig as a dict."""
    return {
        "step": 0,
        "sums": [0.0, 0.0, 0.0, 0.0],
        "sampler_seed": config.get("seed"),
        "sampler_epoch": epoch,
        "world_size": world_size,
        "kind": "epoch",
    }


def check_archive(path: str | os.PathLike) -> None:
    """Refuse, before torch inflates a byte of it, a ``state.pt`` that is not the plain zip
    archive ``torch.save`` writes: larger than :data:`MAX_CHECKPOINT_BYTES`, a central
    directory of more than :data:`MAX_RECORDS` records, a compressed or encrypted record, or
    records that unpack to more than :data:`MAX_CHECKPOINT_BYTES` (overlapping records
    included)."""
    path = Path(path)
    refused = f"refusing to load {path}:"
    corrupt = f"{path} is corrupt or truncated (not the zip archive torch.save writes)"
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_CHECKPOINT_BYTES:
                raise CheckpointError(
                    f"{refused} {size} bytes, more than a checkpoint holds "
                    f"({MAX_CHECKPOINT_BYTES} at most)"
                )
            count = _record_count(f, size)
            if count is None:
                raise CheckpointError(corrupt)
            if count > MAX_RECORDS:
                raise CheckpointError(
                    f"{refused} its archive lists {count} records ({MAX_RECORDS} at most)"
                )
            f.seek(0)
            with zipfile.ZipFile(f) as archive:
                records = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as exc:
        raise CheckpointError(corrupt) from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read {path} ({exc.strerror or exc})") from exc
    if len(records) > MAX_RECORDS:
        raise CheckpointError(f"{refused} its archive lists {len(records)} records")
    total = 0
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED or record.flag_bits & 0x1:
            kind = "encrypted" if record.flag_bits & 0x1 else "compressed"
            raise CheckpointError(
                f"{refused} its record {record.filename[:80]!r} is {kind} (torch.save "
                "stores every record as it is; one that inflates is never unpacked)"
            )
        if record.file_size != record.compress_size or record.header_offset > size:
            raise CheckpointError(corrupt)
        total += record.file_size
    if total > MAX_CHECKPOINT_BYTES:
        raise CheckpointError(
            f"{refused} its records unpack to {total} bytes, more than a checkpoint "
            f"holds ({MAX_CHECKPOINT_BYTES} at most)"
        )


def _record_count(f, size: int) -> int | None:
    """The number of records the zip archive ``f`` says it holds (its end of central
    directory record, or the zip64 one it points to), read before zipfile reads them all;
    None when there is no such record."""
    f.seek(max(0, size - _EOCD.size - 0xFFFF))  # the record, then a comment of 64 KiB at most
    tail = f.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < _EOCD.size:
        return None
    count, directory_size = _EOCD.unpack_from(tail, at)[4:6]
    if count != 0xFFFF and directory_size != 0xFFFFFFFF:
        return count
    locator = at - _ZIP64_LOCATOR.size
    if locator < 0 or tail[locator : locator + 4] != b"PK\x06\x07":
        return None
    offset = _ZIP64_LOCATOR.unpack_from(tail, locator)[2]
    if offset + _ZIP64_EOCD.size > size:
        return None
    f.seek(offset)
    record = f.read(_ZIP64_EOCD.size)
    if len(record) < _ZIP64_EOCD.size or record[:4] != b"PK\x06\x06":
        return None
    return _ZIP64_EOCD.unpack(record)[7]


def check_torch(version: str | None = None) -> None:
    """Refuse to load anything with a torch whose ``weights_only`` can be bypassed."""
    version = version or torch.__version__
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) < MIN_TORCH:
        floor = ".".join(map(str, MIN_TORCH))
        raise CheckpointError(
            f"torch {version} cannot load checkpoints safely (its weights_only loading has "
            f"known bypasses); upgrade to torch>={floor}: pip install 'torch>={floor}'"
        )


def load_model(path: str | os.PathLike) -> ConvNet:
    """A :class:`ConvNet` holding the weights of the checkpoint at ``path``."""
    return model_from(load(path), path)


def model_from(state: dict[str, Any], path: str | os.PathLike) -> ConvNet:
    """A :class:`ConvNet` holding the weights of ``state`` (loaded from ``path``)."""
    model = ConvNet()
    weights = state.get("model")
    if not isinstance(weights, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()
    ):
        raise CheckpointError(
            f"{path} holds no model weights (its 'model' is not a mapping of names to tensors)"
        )
    try:
        model.load_state_dict(weights)
    except (KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{path} holds weights of a different model") from exc
    return model


#: What a checkpoint that can resume a run holds (besides ``format``).
RESUME_KEYS = (
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "epoch",
    "best_val_accuracy",
    "history",
    "rng",
    "config",
    "position",
)

#: What a ``position`` says (:func:`boundary_position`): ``step``, the steps of epoch
#: ``epoch + 1`` done (0 at an epoch's end); ``sums``, that epoch's training loss sum,
#: correct predictions, images and CPU seconds so far over all ranks; ``sampler_seed`` and
#: ``sampler_epoch``, what the sampler's order is drawn from; ``world_size``, the ranks
#: that wrote it (None when unknown); ``kind``, ``"epoch"`` or ``"preemption"``.
POSITION_KEYS = ("step", "sums", "sampler_seed", "sampler_epoch", "world_size", "kind")


def resumable_state(path: str | os.PathLike, train_config: dict[str, Any]) -> dict[str, Any]:
    """Check that the checkpoint at ``path`` can resume a run of ``train_config``: on the
    driver, before any worker starts, everything a worker will load is loaded here into
    freshly built objects on the CPU (model, optimizer, schedule, grad scaler, RNG) and used
    once, so a worker cannot fail on it.

    Returns the state; raises :class:`CheckpointError` naming what is wrong.
    """
    state = load(path)
    missing = [key for key in RESUME_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: it cannot resume a run")
    model = model_from(state, path)
    if state["config"] != train_config:
        raise CheckpointError(f"{path} was written by a run with other training settings")
    try:
        cfg = TrainConfig.from_dict(train_config)
    except (ConfigError, TypeError) as exc:
        raise CheckpointError(f"{path} holds training settings that are not valid") from exc
    epoch = state["epoch"]
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= cfg.epochs:
        raise CheckpointError(
            f"{path}: its epoch {epoch!r} is not a completed epoch of a {cfg.epochs}-epoch run"
        )
    _check_position(state["position"], epoch, cfg, path)
    best = state["best_val_accuracy"]
    if isinstance(best, bool) or not isinstance(best, (int, float)) or not 0 <= best <= 1:
        raise CheckpointError(f"{path}: its best_val_accuracy {best!r} is not an accuracy")
    history = state["history"]
    if not isinstance(history, list) or not all(
        isinstance(h, dict) and all(isinstance(k, str) for k in h) for h in history
    ):
        raise CheckpointError(f"{path}: its history is not a list of per-epoch records")
    _check_training_state(state, cfg, model, path)
    _check_rng(state["rng"], path)
    return state


def _check_training_state(
    state: dict[str, Any], cfg: TrainConfig, model: ConvNet, path: str | os.PathLike
) -> None:
    """Load optimizer, schedule and scaler state as the worker does, then take one step."""
    # Any length will do (the loaded state brings the run's), except one whose one-cycle
    # warm-up is zero steps long, which OneCycleLR divides by (epochs 4 at 25 %, say).
    steps = 2 if cfg.warmup_pct * cfg.epochs == 1 else 1
    optimizer, scheduler = build_optimizer(model, cfg, steps)
    for part, target in (("optimizer", optimizer), ("scheduler", scheduler)):
        try:
            if not isinstance(state[part], dict):
                raise TypeError(f"a {type(state[part]).__name__}, not a dict")
            # A copy: loading shares the state's tensors, and the step below moves them.
            target.load_state_dict(copy.deepcopy(state[part]))
            if part == "optimizer":
                # Shapes and types of the per-parameter state (momentum buffers) show only
                # when they are used: one step with zero gradients uses them all.
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
                optimizer.step()
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "use get_last_lr()": we mean get_lr
                    lrs = scheduler.get_lr()
                if not all(isinstance(lr, (int, float)) and math.isfinite(lr) for lr in lrs):
                    raise ValueError(f"learning rates {lrs!r}")
        except Exception as exc:  # torch raises anything from KeyError to RuntimeError here
            raise CheckpointError(
                f"{path}: its {part} state does not fit this run ({first_line(exc)})"
            ) from exc
    scaler_state = state["scaler"]
    try:
        if not isinstance(scaler_state, dict):
            raise TypeError(f"a {type(scaler_state).__name__}, not a dict")
        if cfg.amp == "fp16":  # a disabled scaler (every other precision) loads nothing
            scaler = torch.amp.GradScaler("cpu", enabled=True)
            scaler.load_state_dict(scaler_state)
            scaler.scale(torch.ones(()))  # builds its scale tensor from the loaded value
    except Exception as exc:
        raise CheckpointError(
            f"{path}: its scaler state does not fit this run ({first_line(exc)})"
        ) from exc


def _check_position(position: Any, epoch: int, cfg: TrainConfig, path: str | os.PathLike) -> None:
    """A position the loop can resume from: mid-epoch only inside the run's epochs, at an
    epoch's end only after one, the sampler's order this run's."""
    bad = f"{path}: its position"
    if not isinstance(position, dict) or set(position) != set(POSITION_KEYS):
        raise CheckpointError(f"{bad} {position!r:.80} is not a position within an epoch")
    step, sums, size = position["step"], position["sums"], position["world_size"]
    if not is_count(step) or (step == 0 and epoch < 1) or (step > 0 and epoch >= cfg.epochs):
        raise CheckpointError(
            f"{bad}: step {step!r} of epoch {epoch + 1} is not a step of a {cfg.epochs}-epoch run"
        )
    if not (
        isinstance(sums, list)
        and len(sums) == 4
        and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in sums)
    ):
        raise CheckpointError(f"{bad}: its epoch's sums {sums!r:.80} are not 4 sums")
    if position["sampler_seed"] != cfg.seed or position["sampler_epoch"] != epoch:
        raise CheckpointError(f"{bad}: its sampler's seed and epoch are not this run's")
    if not (size is None or is_count(size, 1)) or position["kind"] not in ("epoch", "preemption"):
        raise CheckpointError(f"{bad}: its world size or kind is not valid")


def _check_rng(rng: Any, path: str | os.PathLike) -> None:
    try:
        if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor):
            raise TypeError("no torch generator state")
        torch.Generator().set_state(rng["torch"])  # validates without touching ours
        cuda = rng.get("cuda")
        if cuda is not None and not (isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8):
            raise TypeError("the CUDA generator state is not a byte tensor")
    except Exception as exc:
        raise CheckpointError(f"{path}: its RNG state is unusable ({first_line(exc)})") from exc


def rng_state() -> dict[str, Any]:
    """This process's torch generator states (CPU, and CUDA once it is in use)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` returned: the next draws are the ones it would make."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
