"""The Serve application: what runs inside each replica, and how it is deployed.

HTTP API, JSON both ways:

* ``POST /predict`` ``{"images": [...]}``: each image is 28 lists of 28 integers 0-255
  (MNIST's pixels, white digit on black, taken as they are) or a base64 PNG of any size
  (made MNIST-like: :mod:`raytrain_mnist.serving.images`). Answers ``{"predictions": [...],
  "probabilities": [[10 floats], ...]}``. Images from all clients are batched together
  (``serve.batch``, at most ``--max-batch-size`` images per forward pass).
* ``GET /health``: answers once the replica has loaded the model.
* ``GET /``: a page to draw a digit on (``static/index.html``).

A bad request gets a 4xx and ``{"error": "one line"}``; nothing is ever written.

:class:`DigitClassifier` is one replica; :func:`application` binds it to the weights it
serves. Reading the checkpoint is the driver side's job
(:mod:`raytrain_mnist.driver.deployment`): replicas receive weights, never paths. This
module imports neither Ray nor torch at module level: a replica (or the driver, when it
binds the application) imports them when it needs them.
"""

from __future__ import annotations

import asyncio
from importlib import resources

import numpy as np

from raytrain_mnist.serving.images import MAX_BODY_BYTES, BadRequest, parse_images
from raytrain_mnist.serving.settings import CPUS_PER_REPLICA

#: The deployment's name inside the application (``serve status`` shows it).
DEPLOYMENT_NAME = "DigitClassifier"
#: How long a replica waits for more images before running a partial batch: long enough
#: for concurrent clients' requests to meet, short next to a forward pass.
BATCH_WAIT_S = 0.005
#: Bodies smaller than this are parsed on the event loop (a thread hop would cost more).
_PARSE_INLINE_BYTES = 64 * 1024
#: Only what the page itself holds may load: no CDN, no third-party request.
_PAGE_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
)
_PAGE = ("static", "index.html")


def page() -> bytes:
    """The drawing page, from the package's data."""
    return resources.files("raytrain_mnist.serving").joinpath(*_PAGE).read_bytes()


class DigitClassifier:
    """One Serve replica: the ConvNet in eval mode, answering HTTP requests directly (a
    plain ``__call__`` rather than FastAPI, so every error keeps our one-line form)."""

    def __init__(
        self, weights: dict, amp: str, info: dict, max_batch_size: int, use_gpu: bool
    ) -> None:
        import torch
        from ray import serve

        from raytrain_mnist.model import ConvNet
        from raytrain_mnist.worker.optim import amp_context

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
        # Built per replica, so --max-batch-size needs no class-level decorator (and this
        # module imports neither Ray nor torch until a replica or the driver needs them).
        # Items are chunks of images; a batch holds at most max_batch_size images.
        self._batched = serve.batch(
            max_batch_size=max_batch_size,
            batch_wait_timeout_s=BATCH_WAIT_S,
            batch_size_fn=lambda chunks: sum(len(c) for c in chunks),
        )(self._run_batch)

    async def _run_batch(self, chunks: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        # The forward pass leaves the event loop free to gather the next batch meanwhile.
        predictions, probabilities = await asyncio.to_thread(self._forward, np.concatenate(chunks))
        bounds = np.cumsum([len(c) for c in chunks])[:-1]
        return list(
            zip(np.split(predictions, bounds), np.split(probabilities, bounds), strict=False)
        )

    def _forward(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import torch

        from raytrain_mnist.model import normalize

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
            body = await _read_body(request)
            # Parsing a large body (up to ~100 ms) in a thread keeps this replica's event
            # loop, which also gathers the batches, free for other clients meanwhile.
            images = (
                parse_images(body)
                if len(body) < _PARSE_INLINE_BYTES
                else await asyncio.to_thread(parse_images, body)
            )
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        return JSONResponse(await self.predict(images))


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
):
    """The Serve application (``serve.run`` takes it): ``replicas`` copies of
    :class:`DigitClassifier` holding ``weights`` (a state dict, shipped to them by Ray).
    ``info`` is what ``GET /health`` reports beside the device and the batch size."""
    from ray import serve

    deployment = serve.deployment(
        DigitClassifier,
        name=DEPLOYMENT_NAME,
        num_replicas=replicas,
        # Room for a full batch in flight and the next one gathering.
        max_ongoing_requests=max(8, 2 * max_batch_size),
        # Requests take milliseconds: a stopping replica need not wait 2 s between checks
        # for its last ones.
        graceful_shutdown_wait_loop_s=0.2,
        ray_actor_options={"num_cpus": CPUS_PER_REPLICA, "num_gpus": 1 if use_gpu else 0},
    )
    return deployment.bind(weights, amp, info, max_batch_size, use_gpu)
