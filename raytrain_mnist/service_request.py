"""One request to a warm service, as the workers read it: :class:`ServiceRequest`, a frozen
value that crosses Ray as a plain dict (:meth:`ServiceRequest.to_dict`,
:meth:`ServiceRequest.from_dict`), never as an object of ours. The service's queue builds it
and checks it against the service (``driver/service/request.py``: ``check_request``); here
is only what any holder can check alone: its keys and their types, the training settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raytrain_mnist.config import TrainConfig
from raytrain_mnist.errors import ConfigError
from raytrain_mnist.run_settings import CheckpointSettings, TorchSettings


class RequestError(ValueError):
    """A request the service refuses; its text is the one line its requester sees."""


@dataclass(frozen=True)
class ServiceRequest:
    """What the service trains: built by :func:`check_request` (the queue) and read by the
    workers, never assembled by hand on either side."""

    train: TrainConfig
    #: The storage path of the run, canonical (a resolved local path, or a checked URI).
    storage: str
    name: str
    #: The checkpoint it resumes from (canonical, inside the run), or None.
    resume_from: str | None = None
    progress: bool = False  # rank 0 streams per-step progress
    compile: bool = False  # torch.compile
    cuda_graphs: str = "auto"
    keep: int = 2  # --keep-checkpoints of the run
    claim: str = ""  # the token the requester wrote into the run (CLAIM_FILE)
    id: str = ""  # the queue's

    #: The keys of :meth:`to_dict`, and all a request may hold.
    KEYS = (
        "train",
        "storage",
        "name",
        "resume_from",
        "progress",
        "compile",
        "cuda_graphs",
        "keep",
        "claim",
        "id",
    )

    def to_dict(self) -> dict[str, Any]:
        values = {k: getattr(self, k) for k in self.KEYS}
        return {**values, "train": self.train.to_dict()}

    @classmethod
    def from_dict(cls, values: Any) -> ServiceRequest:
        """The request ``values`` hold: exactly :attr:`KEYS` (``id`` may be left out),
        each of its type, the training settings valid. :class:`RequestError` otherwise."""
        if not isinstance(values, dict):
            raise RequestError(f"a request is a dict, not {type(values).__name__}")
        given, known = set(values), set(cls.KEYS)
        if not given <= known or not known - {"id"} <= given:
            raise RequestError(f"a request holds {sorted(known)}, not {sorted(map(str, given))}")
        train = values["train"]
        if not isinstance(train, dict):
            raise RequestError("a request's training settings are a dict")
        try:
            config = TrainConfig.from_dict(train)
            cuda_graphs = TorchSettings(cuda_graphs=values["cuda_graphs"]).cuda_graphs
        except (ConfigError, TypeError) as exc:
            raise RequestError(str(exc)) from None
        for key, kind in (("storage", str), ("name", str), ("claim", str), ("id", str)):
            if not isinstance(values.get(key, ""), kind):
                raise RequestError(f"a request's {key} is a string")
        for key in ("progress", "compile"):
            if not isinstance(values[key], bool):
                raise RequestError(f"a request's {key} is true or false")
        try:  # the rule of --keep-checkpoints, in its one home
            keep = CheckpointSettings(keep_checkpoints=values["keep"]).keep_checkpoints
        except ConfigError as exc:
            raise RequestError(str(exc)) from None
        resume = values["resume_from"]
        if resume is not None and not isinstance(resume, str):
            raise RequestError("a request's resume_from is a path or None")
        return cls(
            config,
            values["storage"],
            values["name"],
            resume,
            values["progress"],
            values["compile"],
            cuda_graphs,
            keep,
            values["claim"],
            values.get("id", ""),
        )

    @property
    def run_dir(self) -> str:
        return f"{self.storage}/{self.name}"
