"""What one connection may take of a server, bounded in the HTTP protocol itself, before the
request reaches Serve (or any ASGI application).

Ray 2.60 starts uvicorn with httptools and no limits (:func:`raytrain_mnist.compat.serve_http_bounded`
swaps in :class:`BoundedHttpToolsProtocol` wherever Serve starts one: a direct or HAProxy
replica's own server, and Serve's proxy). Per connection it bounds:

* the request head (request line and headers together): :data:`MAX_HEAD_BYTES`, else 431 and
  the connection closed; nothing past the limit is ever handed to the parser;
* the time the head may take: :data:`HEAD_TIMEOUT_S` from the connection's start, or from the
  first byte of a request on a kept-alive one; a silent connection or a half-sent head is
  closed then; an idle kept-alive connection after :data:`KEEP_ALIVE_S`;
* the body: read whole *before* the application runs, so a client that trickles its body
  holds no slot of Serve's (``max_ongoing_requests``, the queue, the parse threads), only its
  connection; at most :data:`MAX_BODY_BYTES` (413, on its declared length before any is read),
  within the request timeout (408), and all the connections of a process together hold at
  most :data:`BODY_BYTES_AT_ONCE` of bodies being received (503 for the one that would pass it);
* connections at once: :data:`MAX_CONNECTIONS` per server; the next one is answered 503 and
  closed at once.

On a connection that arrives on loopback, Serve's own ``/-/healthz`` and ``/-/routes`` answer
only a ``Host`` that names loopback (or none, as HAProxy's health checks send): a
DNS-rebound page gets 421, as from the application.

Imports uvicorn (it comes with ``ray[serve]``), never Ray nor torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from raytrain_mnist.serving.images import MAX_BODY_BYTES
from raytrain_mnist.serving.settings import ServeConfig, is_loopback, loopback_host_header

#: Request line and headers together: browsers send under 8 KiB; nginx's default is 8 KiB a
#: line, and 32 KiB leaves room for long cookies and tokens.
MAX_HEAD_BYTES = 32 * 1024
#: Seconds a request's head may take to arrive.
HEAD_TIMEOUT_S = 5.0
#: Seconds an idle kept-alive connection stays open.
KEEP_ALIVE_S = 5
#: Connections one server keeps at once.
MAX_CONNECTIONS = 1024
#: Bytes of bodies being received at once, over all of a process's connections: sixteen
#: bodies of the largest size. Clients trickling bodies hold a few bytes each.
BODY_BYTES_AT_ONCE = 16 * MAX_BODY_BYTES
#: Where the proxy's process finds the request timeout (``serve`` sets it for Serve's
#: processes); ServeConfig's default without it.
BODY_TIMEOUT_ENV = "RAYTRAIN_MNIST_SERVE_BODY_TIMEOUT_S"
#: What Serve's proxy and replicas call before they start their HTTP server
#: (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``): :func:`proxy_callback`.
PROXY_CALLBACK = f"{__name__}:proxy_callback"
_SYSTEM_PATHS = b"/-/"
#: How long an expired timer waits for reads already under way before it acts.
_RECHECK_S = 0.2


@dataclass(frozen=True)
class Limits:
    """What one connection may take (module constants by default)."""

    max_head_bytes: int = MAX_HEAD_BYTES
    head_timeout_s: float = HEAD_TIMEOUT_S
    keep_alive_s: int = KEEP_ALIVE_S
    max_connections: int = MAX_CONNECTIONS
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = ServeConfig.request_timeout_s
    body_bytes_at_once: int = BODY_BYTES_AT_ONCE

    @classmethod
    def from_env(cls) -> Limits:
        try:
            timeout = float(os.environ.get(BODY_TIMEOUT_ENV, ""))
        except ValueError:
            timeout = float(ServeConfig.request_timeout_s)
        return cls(body_timeout_s=timeout if timeout > 0 else ServeConfig.request_timeout_s)


def proxy_callback() -> list:
    """Serve's HTTP proxy callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``), called in
    Serve's proxy and in a direct-ingress replica before each starts its server: their
    uvicorn takes :class:`BoundedHttpToolsProtocol` (limits from the environment unless the
    replica set its own). No middleware."""
    from raytrain_mnist import compat

    compat.serve_http_bounded(bounded_protocol(Limits.from_env()), KEEP_ALIVE_S, replace=False)
    return []


def bounded_protocol(limits: Limits) -> type:
    """:class:`BoundedHttpToolsProtocol` with ``limits``, the class uvicorn's ``http`` takes."""
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), {"limits": limits})


def _loopback_host(value: bytes) -> bool:
    return loopback_host_header(value.decode("latin-1"))


class _Budget:
    """Bytes of bodies being received in this process (all servers, all connections)."""

    held = 0


try:  # uvicorn and httptools come with ray[serve]; without them nothing here is used
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # pragma: no cover
    HttpToolsProtocol = object  # type: ignore[assignment,misc]
    STATUS_LINE = {}


class BoundedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's httptools protocol with every resource of a connection bounded (module
    docstring). Head bytes are counted as they are read: a head that begins in the same read
    as the end of the previous request (a pipelining client) counts that whole read."""

    limits = Limits()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head: int | None = 0  # bytes of the current head so far; None past it
        self._feed = 0  # length of the read being parsed
        self._completed_in_feed = False
        self._pending = None  # (cycle, app) waiting for the whole body
        self._held = 0  # this connection's share of _Budget
        self._timer = self._timer_kind = None
        self._refused = False
        self._has_body = False
        self._loopback = bool(self.server) and _is_loopback_ip(self.server[0])
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, "this server has all the connections it takes; retry shortly")
            return
        self._arm("head")  # a silent connection is closed too

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._release()
        self._pending = None
        super().connection_lost(exc)

    # ------------------------------------------------------------------ reading

    def data_received(self, data: bytes) -> None:
        while data and not self._refused and not self.transport.is_closing():
            self._completed_in_feed = False
            if self._head is None:  # a body: all of it to the parser
                self._feed = len(data)
                super().data_received(data)
                data = b""
            else:
                piece = data[: self.limits.max_head_bytes - self._head]
                data = data[len(piece) :]
                self._head += len(piece)
                self._feed = len(piece)
                super().data_received(piece)
            if self._head is not None and self._head >= self.limits.max_head_bytes:
                if not self._refused and not self.transport.is_closing():
                    self._refuse(
                        431,
                        f"the request line and headers are over {self.limits.max_head_bytes} bytes",
                    )
                return
        self._settle_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head is None or self._completed_in_feed:
            self._head = self._feed  # begun inside an uncounted read: count all of it

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._head = None
        host = declared = None
        chunked = False
        for name, value in self.headers:
            if name == b"host":
                host = value
            elif name == b"content-length" and value.strip().isdigit():
                declared = int(value)
            elif name == b"transfer-encoding":
                chunked = True
        if declared is not None and declared > self.limits.max_body_bytes:
            self._refuse(
                413,
                f"the body is over {self.limits.max_body_bytes} bytes; send fewer images per "
                "request",
            )
            return
        if self._loopback and _system(self.url) and host is not None and not _loopback_host(host):
            self._refuse(
                421,
                f"Host {host[:80].decode('latin-1')!r} is not a loopback name: this server "
                "answers only Host 127.0.0.1, localhost or [::1] on loopback",
            )
            return
        self._has_body = (declared or 0) > 0 or chunked
        super().on_headers_complete()
        if self.cycle is not None:  # a pipelined request starts later: it keeps its own
            self.cycle.has_body = self._has_body

    def _start_asgi_task(self, cycle, app) -> None:
        if not (getattr(cycle, "has_body", self._has_body) and cycle.more_body):
            super()._start_asgi_task(cycle, app)
            return
        # The application starts once the body is in: until then this connection holds
        # nothing of Serve's (a slot, a queue place, a parse thread).
        self._pending = (cycle, app)
        if cycle.waiting_for_100_continue:
            cycle.waiting_for_100_continue = False
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        if self._pending is None or self._pending[0] is not self.cycle:
            super().on_body(body)
            return
        if len(self.cycle.body) + len(body) > self.limits.max_body_bytes:
            self._refuse(
                413,
                f"the body is over {self.limits.max_body_bytes} bytes; send fewer images per "
                "request",
            )
            return
        if _Budget.held + len(body) > self.limits.body_bytes_at_once:
            self._refuse(503, "this server is receiving all the bodies it takes; retry shortly")
            return
        _Budget.held += len(body)
        self._held += len(body)
        self.cycle.body += body  # no flow control: nobody reads it until it is whole

    def on_message_complete(self) -> None:
        if self._refused:
            return
        super().on_message_complete()
        self._head, self._completed_in_feed = 0, True
        if self._pending is not None and self._pending[0] is self.cycle:
            cycle, app = self._pending
            self._pending = None
            self._release()
            super()._start_asgi_task(cycle, app)

    # ------------------------------------------------------------------ timers and refusals

    def _head_timed_out(self) -> None:
        if self._recheck(self._head_timed_out):
            return
        if self._head is not None and not self.transport.is_closing():
            # A silent connection, or a head that did not arrive in time: closed. A
            # request whose head did arrive is answered first.
            if self._head > 0 and not self._cycle_running():
                self._refuse(408, "the request's headers did not arrive in time")
            else:
                self._refused = True
                self.transport.close()

    def _body_timed_out(self) -> None:
        if self._recheck(self._body_timed_out):
            return
        if self._pending is not None and not self.transport.is_closing():
            self._refuse(
                408,
                f"the body took over {self.limits.body_timeout_s:g} s to arrive; send it at "
                "once, or fewer images per request",
            )

    def _settle_timer(self) -> None:
        """After a read: the deadline the connection's state now needs (a body not yet whole:
        the body's; a head begun and not complete: the head's; else none), changed only when
        it changes, so a request read whole in one read costs no timer at all."""
        if self._refused:
            return
        kind = "body" if self._pending is not None else "head" if self._head else None
        if kind != self._timer_kind:
            self._disarm()
            if kind is not None:
                self._arm(kind)

    def _arm(self, kind: str) -> None:
        self._disarm()
        self._rechecked, self._timer_kind = False, kind
        if kind == "head":
            self._timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)
        else:
            self._timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def _recheck(self, callback) -> bool:
        """Whether a timer that just expired looks once more first: a loop kept busy (a
        loaded machine) may run timers before the reads that were waiting, so what already
        arrived is read before the connection is refused."""
        self._timer = None
        if self._rechecked:
            return False
        self._rechecked = True
        self._timer = self.loop.call_later(_RECHECK_S, callback)
        return True

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_kind = None

    def _release(self) -> None:
        _Budget.held -= self._held
        self._held = 0

    def _cycle_running(self) -> bool:
        cycle = self.cycle
        pending = self._pending[0] if self._pending is not None else None
        return cycle is not None and cycle is not pending and not cycle.response_complete

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with one line of JSON (unless another answer is being written on
        this connection) and close it; nothing more of it is read."""
        running = self._cycle_running()
        self._refused = True
        self._disarm()
        self._release()
        self._pending = None
        if not running:
            body = json.dumps({"error": message}).encode()
            head = [STATUS_LINE[status]]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            head.append(
                b"content-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % len(body)
            )
            self.transport.write(b"".join(head) + body)
        self.transport.close()


def _system(url: bytes) -> bool:
    """Whether the request target names Serve's own ``/-/`` paths (as Serve routes it: an
    absolute URL's path, percent-decoded)."""
    import urllib.parse

    import httptools

    try:
        path = url if url.startswith(b"/") else httptools.parse_url(url).path or b""
    except httptools.HttpParserError:
        return False  # uvicorn refuses it (400)
    if b"%" in path:
        path = urllib.parse.unquote_to_bytes(path)
    return path.startswith(_SYSTEM_PATHS)


def _is_loopback_ip(ip: str) -> bool:
    return is_loopback(ip.removeprefix("::ffff:"))
