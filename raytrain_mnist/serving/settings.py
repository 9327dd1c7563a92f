"""How the model is served: :class:`ServeConfig`, the serve command's settings and defaults.

Pure (no Ray): the command builds it from flags, the driver side deploys by it, and the
replicas' sizing (:data:`CPUS_PER_REPLICA`) is read from here by both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_mnist.config import check_int, option
from raytrain_mnist.errors import ConfigError

#: One CPU (and one torch thread) per replica: the net is small, so more replicas scale
#: better than more threads in one.
CPUS_PER_REPLICA = 1


@dataclass(frozen=True)
class ServeConfig:
    """How the model is served; the one home of the serve command's defaults."""

    address: Optional[str] = option(
        None,
        "Ray cluster address (host:port or auto); default: $RAY_ADDRESS, else start a local Ray",
    )
    host: str = option(
        "127.0.0.1",
        "interface the HTTP proxy listens on; 0.0.0.0 exposes the "
        "model and page to every network this machine is on (docs/serve.md)",
    )
    port: int = option(8000, "HTTP port")
    replicas: int = option(
        1, f"model replicas, each {CPUS_PER_REPLICA} CPU (plus 1 GPU with --use-gpu)"
    )
    max_batch_size: int = option(
        64, "most images in one forward pass, gathered across concurrent requests"
    )
    use_gpu: bool = option(False, "one GPU per replica")

    def __post_init__(self) -> None:
        if not self.host or not self.host.strip():
            raise ConfigError("--host must name an interface, e.g. 127.0.0.1")
        check_int("port", self.port, 1, 65535)
        check_int("replicas", self.replicas, 1)
        check_int("max-batch-size", self.max_batch_size, 1)
