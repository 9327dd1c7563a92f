"""The Serve application: what runs inside each replica, and how it is deployed.

HTTP API, JSON both ways:

* ``POST /predict`` ``{"images": [...]}``: each image is 28 lists of 28 integers 0-255
  (MNIST's pixels, white digit on black, taken as they are) or a base64 PNG of any size
  (made MNIST-like: :mod:`raytrain_mnist.serving.images`). Answers ``{"predictions": [...],
  "probabilities": [[10 floats], ...]}``. Images from all clients are batched together
  (``serve.batch``, at most ``--max-batch-size`` images per forward pass).
* ``GET /health``: answers once the replica has loaded the model (its epoch, device and
  batch size: no path, nothing of the machine).
* ``GET /``: a page to draw a digit on (``static/index.html``).

A bad request gets a 4xx and ``{"error": "one line"}``; nothing is ever written.

What a request may cost is bounded (:class:`Access` and :mod:`raytrain_mnist.serving.images`
hold the limits): on a loopback proxy the ``Host`` header must name loopback (421: a
DNS-rebound page gets nothing); ``POST /predict`` takes ``Content-Type: application/json``
only (415: no cross-site form posts) and, with a token, ``Authorization: Bearer TOKEN``
(401); its body must arrive within the request timeout (408); at most
:data:`PARSES_AT_ONCE` bodies are parsed at once, off the event loop; and Serve queues at
most a round of requests per caller beyond the replicas' slots (503 past that).

:class:`DigitClassifier` is one replica; :func:`application` binds it to the weights it
serves. Reading the checkpoint is the driver side's job
(:mod:`raytrain_mnist.driver.deployment`): replicas receive weights, never paths. This
module imports neither Ray nor torch at module level: a replica (or the driver, when it
binds the application) imports them when it needs them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from importlib import resources

import numpy as np

from raytrain_mnist import compat
from raytrain_mnist.serving.images import MAX_BODY_BYTES, BadRequest, parse_images
from raytrain_mnist.serving.settings import (
    CPUS_PER_REPLICA,
    ServeConfig,
    TokenHash,
    loopback_host_header,
)

#: The deployment's name inside the application (``serve status`` shows it).
DEPLOYMENT_NAME = "DigitClassifier"
#: How long a replica waits for more images before running a partial batch: long enough
#: for concurrent clients' requests to meet, short next to a forward pass.
BATCH_WAIT_S = 0.005
#: Bodies smaller than this, with no string but the key (no PNG), are parsed on the event
#: loop (a thread hop would cost more); the rest in a thread.
_PARSE_INLINE_BYTES = 64 * 1024
#: Bodies parsed at once per replica, off its event loop. A replica has one CPU: more would
#: only hold more decoded pixels in memory at the same time, not finish sooner.
PARSES_AT_ONCE = 2
#: Serve's proxy ends any request this long after the replica's own timeout for its body:
#: a backstop (the replica's 408 is the one-line JSON answer).
PROXY_GRACE_S = 5
#: The header with which a client may change the proxy's timeout (Ray 2.60's
#: ``SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER``; 0 or less lifts it): only shorter is accepted.
_TIMEOUT_HEADER = "x-request-timeout-seconds"
#: Only what the page itself holds may load: no CDN, no third-party request.
_PAGE_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
)
_PAGE = ("static", "index.html")


def page() -> bytes:
    """The drawing page, from the package's data."""
    return resources.files("raytrain_mnist.serving").joinpath(*_PAGE).read_bytes()


@dataclass(frozen=True)
class Access:
    """Who may use a replica, and how long a request's body may take to arrive."""

    #: The salted hash of the ``Authorization: Bearer`` token that ``POST /predict`` needs
    #: (a replica never holds the token itself); None: no token.
    token_hash: TokenHash | None = field(default=None, repr=False)
    #: The proxy listens on loopback only: ``Host`` must then name loopback.
    loopback_only: bool = True
    request_timeout_s: float = ServeConfig.request_timeout_s

    @property
    def proxy_timeout_s(self) -> float:
        """Serve's own end-to-end timeout (``http_options.request_timeout_s``)."""
        return self.request_timeout_s + PROXY_GRACE_S


class Parser:
    """Parses ``/predict`` bodies (``parse``: :func:`~raytrain_mnist.serving.images.parse_images`)
    for one replica: small bodies of integers on the event loop, the rest in threads, at most
    ``at_once`` of those at a time."""

    def __init__(self, at_once: int = PARSES_AT_ONCE, parse=parse_images) -> None:
        self._parse_images = parse
        self._slots = asyncio.Semaphore(at_once)

    async def __call__(self, body: bytes) -> np.ndarray:
        if len(body) < _PARSE_INLINE_BYTES and body.count(b'"') <= 2:
            return self._parse_images(body)  # integers only, no PNG: a few KB to read
        # Parsing a large body or decoding PNGs (up to ~1 s) in a thread keeps the replica's
        # event loop, which also gathers the batches, free for other clients meanwhile. A slot
        # is freed when its parse ends, even if the request was cancelled meanwhile (its
        # thread cannot be): never more than at_once parses hold memory at the same time.
        await self._slots.acquire()
        parsing = asyncio.ensure_future(asyncio.to_thread(self._parse_images, body))
        parsing.add_done_callback(self._done)
        return await asyncio.shield(parsing)

    def _done(self, parsing: asyncio.Future) -> None:
        self._slots.release()
        if not parsing.cancelled():
            parsing.exception()  # retrieved: a cancelled request's 4xx is no "never retrieved"


def _in_serve_replica() -> bool:
    """Whether this process is a Serve replica (not the plain baseline, not a test)."""
    import sys

    return "ray.serve._private.replica" in sys.modules


class DigitClassifier:
    """One Serve replica: the ConvNet in eval mode, answering HTTP requests directly (a
    plain ``__call__`` rather than FastAPI, so every error keeps our one-line form)."""

    def __init__(
        self,
        weights: dict,
        amp: str,
        info: dict,
        max_batch_size: int,
        use_gpu: bool,
        access: Access | None = None,
    ) -> None:
        import torch

        from raytrain_mnist.nn.model import ConvNet
        from raytrain_mnist.nn.optim import amp_context

        torch.set_num_threads(CPUS_PER_REPLICA)
        self.device = torch.device("cuda" if use_gpu else "cpu")
        self.model = ConvNet()
        self.model.load_state_dict(weights)
        self.model.to(self.device).eval()
        if amp == "fp16" and self.device.type != "cuda":
            amp = "off"  # as evaluate scores it: fp16 autocast is a GPU feature
        self.autocast = amp_context(amp, self.device)
        self.max_batch_size = max_batch_size
        self.info = {**info, "device": self.device.type, "max_batch_size": max_batch_size}
        self.page = page()
        self.access = access or Access()
        if _in_serve_replica():
            # A replica that replaces a dead one binds the direct ingress's port at once.
            compat.serve_http_reuses_address()
            # Its own server (direct, HAProxy) bounds each connection before Serve sees it.
            from raytrain_mnist.serving import http

            limits = http.Limits(body_timeout_s=self.access.request_timeout_s)
            compat.serve_http_bounded(http.bounded_protocol(limits), http.KEEP_ALIVE_S)
        if self.access.loopback_only and _in_serve_replica():
            # Ray 2.60 starts an inter-deployment gRPC server in every replica, on every
            # interface, once this constructor returns: on loopback it listens there only.
            compat.serve_replica_grpc_on_loopback()
        self._parse = Parser()
        if max_batch_size == 1:  # no batching: each chunk's forward pass runs as it comes
            self._batched = self._run_alone
            return
        from ray import serve

        # Built per replica, so --max-batch-size needs no class-level decorator (and this
        # module imports neither Ray nor torch until a replica or the driver needs them).
        # Items are chunks of images; a batch holds at most max_batch_size images.
        self._batched = serve.batch(
            max_batch_size=max_batch_size,
            batch_wait_timeout_s=BATCH_WAIT_S,
            batch_size_fn=lambda chunks: sum(len(c) for c in chunks),
        )(self._run_batch)

    async def _run_alone(self, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # On the event loop: a replica has one CPU, so a thread would only add its hop.
        return self._forward(chunk)

    async def _run_batch(self, chunks: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        # The forward pass leaves the event loop free to gather the next batch meanwhile.
        predictions, probabilities = await asyncio.to_thread(self._forward, np.concatenate(chunks))
        bounds = np.cumsum([len(c) for c in chunks])[:-1]
        return list(
            zip(np.split(predictions, bounds), np.split(probabilities, bounds), strict=False)
        )

    def _forward(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import torch

        from raytrain_mnist.nn.model import normalize

        with torch.inference_mode(), self.autocast:
            logits = self.model(normalize(torch.from_numpy(images).to(self.device))).float()
        # The prediction is the logits' argmax, as evaluate counts it.
        return logits.argmax(1).cpu().numpy(), logits.softmax(1).cpu().numpy()

    async def predict(self, images: np.ndarray) -> dict[str, list]:
        chunks = [
            images[i : i + self.max_batch_size] for i in range(0, len(images), self.max_batch_size)
        ]
        results = await asyncio.gather(*(self._batched(chunk) for chunk in chunks))
        return {
            "predictions": np.concatenate([p for p, _ in results]).tolist(),
            "probabilities": np.concatenate([q for _, q in results]).round(6).tolist(),
        }

    async def __call__(self, request):
        from starlette.responses import JSONResponse, Response

        path, method = request.url.path, request.method
        host = request.headers.get("host", "")
        if self.access.loopback_only and not loopback_host_header(host):
            return _error(
                421,
                f"Host {host[:80]!r} is not a loopback name: this server listens on loopback "
                "and answers only Host 127.0.0.1, localhost or [::1] (DNS rebinding guard)",
            )
        routes = {
            "/": ("GET",),
            "/index.html": ("GET",),
            "/health": ("GET",),
            "/predict": ("POST",),
        }
        if path not in routes:
            return _error(404, f"no {path[:80]}; try GET /, GET /health or POST /predict")
        if method not in routes[path]:
            return _error(
                405,
                f"{path} answers {' and '.join(routes[path])}",
                {"Allow": ", ".join(routes[path])},
            )
        if path == "/health":
            return JSONResponse({"status": "ok", **self.info})
        if path != "/predict":
            return Response(
                self.page,
                media_type="text/html; charset=utf-8",
                headers={"Content-Security-Policy": _PAGE_CSP},
            )
        try:
            self._admit(request)
            # The body must arrive in time: a client that trickles it holds a slot of this
            # replica only that long.
            body = await asyncio.wait_for(_read_body(request), self.access.request_timeout_s)
            images = await self._parse(body)
        except BadRequest as exc:
            return _error(exc.status, str(exc), exc.headers)
        except asyncio.TimeoutError:
            return _error(
                408,
                f"the body took over {self.access.request_timeout_s:g} s to arrive; send it "
                "at once, or fewer images per request",
            )
        return JSONResponse(await self.predict(images))

    def _admit(self, request) -> None:
        """The checks of a ``POST /predict`` before its body is read: the token, the content
        type (no cross-site form post is JSON), the proxy's timeout left in place."""
        if (token_hash := self.access.token_hash) is not None:
            scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token_hash.accepts(
                credentials.strip().encode("latin-1")
            ):
                raise BadRequest(
                    401,
                    "POST /predict needs this server's token: send Authorization: Bearer "
                    "TOKEN (the page: open it as /#token=TOKEN)",
                    {"WWW-Authenticate": 'Bearer realm="raytrain-mnist"'},
                )
        kind = request.headers.get("content-type", "")
        if kind.partition(";")[0].strip().lower() != "application/json":
            raise BadRequest(
                415,
                f"POST /predict takes Content-Type: application/json, not {kind[:60]!r}",
            )
        limit = self.access.proxy_timeout_s
        if _TIMEOUT_HEADER in request.headers:
            try:
                asked = float(request.headers[_TIMEOUT_HEADER])
            except ValueError:
                asked = 0.0
            if not 0 < asked <= limit:
                raise BadRequest(
                    400, f"{_TIMEOUT_HEADER} may only shorten this server's {limit:g} s"
                )


async def _read_body(request, limit: int = MAX_BODY_BYTES) -> bytes:
    too_big = BadRequest(413, f"the body is over {limit} bytes; send fewer images per request")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big  # refused before reading any of it
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    return bytes(body)


def _error(status: int, message: str, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status, headers=headers)


def application(
    weights: dict,
    amp: str,
    info: dict,
    replicas: int,
    max_batch_size: int,
    use_gpu: bool,
    access: Access | None = None,
    env_vars: dict | None = None,
):
    """The Serve application (``serve.run`` takes it): ``replicas`` copies of
    :class:`DigitClassifier` holding ``weights`` (a state dict, shipped to them by Ray).
    ``info`` is what ``GET /health`` reports beside the device and the batch size (nothing
    local: no path); ``access`` who may use it; ``env_vars`` the replicas' Serve settings
    (their ingress: :func:`raytrain_mnist.driver.deployment.ingress_env`)."""
    from ray import serve

    # Room for a full batch in flight and the next one gathering.
    ongoing = max(8, 2 * max_batch_size)
    deployment = serve.deployment(
        DigitClassifier,
        name=DEPLOYMENT_NAME,
        num_replicas=replicas,
        max_ongoing_requests=ongoing,
        # Beyond every replica's slots, one more round waits at each proxy; the next request
        # is refused at once (503, Retry-After: 1) instead of waiting behind slow clients.
        max_queued_requests=ongoing * replicas,
        backpressure_config={"retry_after_s": 1},
        # Requests take milliseconds: a stopping replica need not wait 2 s between checks
        # for its last ones.
        graceful_shutdown_wait_loop_s=0.2,
        ray_actor_options={
            "num_cpus": CPUS_PER_REPLICA,
            "num_gpus": 1 if use_gpu else 0,
            **({"runtime_env": {"env_vars": env_vars}} if env_vars else {}),
        },
    )
    return deployment.bind(weights, amp, info, max_batch_size, use_gpu, access)


def asgi(classifier: DigitClassifier):
    """``classifier`` as a bare ASGI application, no Ray: the same request handling (limits,
    parsing, model) under any ASGI server. The serve benchmark's plain baseline runs it
    under uvicorn."""
    from starlette.requests import Request

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return  # lifespan, websockets: nothing to set up or answer
        response = await classifier(Request(scope, receive))
        await response(scope, receive, send)

    return app
