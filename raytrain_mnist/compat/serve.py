"""Private Ray Serve names: the running instance's HTTP options (driver), and what a replica
or proxy binds and how its uvicorn is bounded (see the package's table)."""

from __future__ import annotations

import logging
import socket
from typing import Any


def serve_http_config() -> Any | None:
    """The HTTP options (``host``, ``port``) of the Serve instance running on the connected
    cluster: Serve keeps the ones it started with and has no public accessor. None when Serve
    is not running or the accessor moved."""
    try:
        from ray.serve import context

        return context._get_global_client().http_config
    except Exception:
        return None


class _ReuseAddressSockets:
    """The ``socket`` module, but the sockets it makes take ``SO_REUSEADDR`` (what uvicorn,
    and most servers, set on a listening socket: binding past TIME_WAIT, never past a
    listener)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(socket, name)

    @staticmethod
    def socket(*args, **kwargs) -> socket.socket:
        sock = socket.socket(*args, **kwargs)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return sock


def serve_http_reuses_address() -> None:
    """In a Serve replica: the HTTP server of the direct ingress binds its port with
    ``SO_REUSEADDR``. Ray 2.60's ``start_asgi_http_server`` binds without it, so when a replica
    dies with connections open, the one that replaces it cannot bind the same port until their
    TIME_WAIT ends (60 s on Linux; measured: answers again 67 s after a SIGKILL). Without the
    private name: a warning, and that wait."""
    try:
        from ray.serve._private import http_util
    except ImportError:
        logging.getLogger(__name__).warning("Serve's http_util moved: no SO_REUSEADDR")
        return
    if getattr(http_util, "socket", None) is socket:
        http_util.socket = _ReuseAddressSockets()


def serve_replica_grpc_on_loopback() -> None:
    """In a Serve replica, before Serve starts the replica's inter-deployment gRPC server
    (after the deployment's constructor): bind it to loopback. Ray 2.60 binds it to
    ``[::]:0``, every interface, in every ingress mode, with no setting; a serve on loopback
    must listen on nothing else. Serve uses that server only for handle calls over gRPC
    (``RAY_SERVE_USE_GRPC_BY_DEFAULT``, off here), which reach it on the node's address:
    loopback on the local Ray serve starts. Without the private name: a warning, and the
    server stays on every interface."""
    try:
        from ray.serve._private import replica
    except ImportError:
        logging.getLogger(__name__).warning("Serve's replica module moved: gRPC on every interface")
        return
    add_port = getattr(replica, "add_port_to_grpc_server", None)
    if add_port is None or getattr(add_port, "_on_loopback", False):
        return

    def add_port_on_loopback(server, address: str):
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address.rpartition(":")[2]
        return add_port(server, address)

    add_port_on_loopback._on_loopback = True
    replica.add_port_to_grpc_server = add_port_on_loopback


class _BoundedUvicorn:
    """The ``uvicorn`` module, but every ``Config`` made through it takes ``protocol`` as its
    HTTP protocol and keeps idle connections at most ``keep_alive_s``."""

    def __init__(self, uvicorn: Any, protocol: type, keep_alive_s: int) -> None:
        self.module, self.protocol, self.keep_alive_s = uvicorn, protocol, keep_alive_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def Config(self, *args, **kwargs) -> Any:  # noqa: N802  (uvicorn's name)
        kwargs["http"] = self.protocol
        keep = kwargs.get("timeout_keep_alive", self.keep_alive_s)
        kwargs["timeout_keep_alive"] = min(keep, self.keep_alive_s)
        return self.module.Config(*args, **kwargs)


def serve_http_bounded(protocol: type, keep_alive_s: int, replace: bool = True) -> bool:
    """In a Serve replica or proxy, before it starts its HTTP server: uvicorn runs
    ``protocol`` (a subclass of uvicorn's httptools protocol that bounds a connection's head,
    time and body) and closes idle connections after ``keep_alive_s``. Ray 2.60's
    ``start_asgi_http_server`` (``ray/serve/_private/http_util.py``, used by the direct
    ingress and by the proxy) builds ``uvicorn.Config`` with httptools and no header, request
    line, head-time or idle limit, and no setting for any: one request's headers could take
    a replica's memory before our code saw them. Checked against ray 2.60.0 and uvicorn
    0.54 (``Config(http=<class>)`` takes a protocol class). ``replace``: whether an earlier
    call's protocol gives way. Without the private name: a warning, and Ray's unbounded
    server. True when installed."""
    try:
        from ray.serve._private import http_util
    except ImportError:
        logging.getLogger(__name__).warning("Serve's http_util moved: its HTTP is unbounded")
        return False
    current = getattr(http_util, "uvicorn", None)
    if isinstance(current, _BoundedUvicorn):
        if not replace:
            return True
        current = current.module
    if current is None or not hasattr(current, "Config"):
        logging.getLogger(__name__).warning("Serve's http_util changed: its HTTP is unbounded")
        return False
    http_util.uvicorn = _BoundedUvicorn(current, protocol, keep_alive_s)
    return True
