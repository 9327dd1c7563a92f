"""``python -m raytrain_mnist.serve RUN_DIR_OR_CHECKPOINT``: the trained model over HTTP.

Deploys a run's best checkpoint (weights only, ``weights_only=True``) as a Ray Serve
application on the cluster (``--address``, ``RAY_ADDRESS``) or on a local Ray this command
starts, prints its URL and serves until Ctrl-C (or SIGTERM, as ``submit stop`` sends), then
removes what it deployed. ``--write-config FILE`` writes the same application as a config
file for Ray's own ``serve deploy`` instead, without starting anything.

HTTP API, JSON both ways:

* ``POST /predict`` ``{"images": [...]}``: each image is 28 lists of 28 integers 0-255
  (MNIST's pixels, white digit on black, taken as they are) or a base64 PNG of any size
  (made MNIST-like: grayscale, dark background, the digit scaled into a 20x20 box and
  centred by its centre of mass in 28x28). Answers ``{"predictions": [...],
  "probabilities": [[10 floats], ...]}``. Images from all clients are batched together
  (``serve.batch``, at most ``--max-batch-size`` images per forward pass).
* ``GET /health``: answers once the replica has loaded the model.
* ``GET /``: a page to draw a digit on (``static/index.html``).

A bad request gets a 4xx and ``{"error": "one line"}``; nothing is ever written.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import numpy as np

from raytrain_mnist import compat
from raytrain_mnist._cli import (
    ArgumentParser,
    Command,
    add_dataclass_args,
    add_target_argument,
    dataclass_from_args,
    setup_logging,
)
from raytrain_mnist.config import ConfigError, check_int, option
from raytrain_mnist.driver.evaluation import load_checkpoint
from raytrain_mnist.driver.targets import resolve_target
from raytrain_mnist.errors import EXIT_USAGE, UserError

logger = logging.getLogger(__name__)

#: The Serve application's name on the cluster (``serve status`` shows it).
APP_NAME = "raytrain_mnist"
#: Images in one request; more is a 413 (split them over several requests).
MAX_IMAGES = 1024
#: Request body limit: 1024 images as JSON integers take ~3.2 MB; PNGs leave room to spare.
MAX_BODY_BYTES = 8 * 1024 * 1024
#: Largest PNG accepted, in pixels (PIL's own bomb guard allows ~179 M before refusing).
MAX_PNG_PIXELS = 4096 * 4096
#: How long a replica waits for more images before running a partial batch: long enough
#: for concurrent clients' requests to meet, short next to a forward pass.
BATCH_WAIT_S = 0.005
#: One CPU (and one torch thread) per replica: the net is small, so more replicas scale
#: better than more threads in one.
CPUS_PER_REPLICA = 1
SIDE = 28
_PAGE = ("static", "index.html")


# --------------------------------------------------------------------------- settings


_flag = option


@dataclass(frozen=True)
class ServeConfig:
    """How the model is served; the one home of the serve command's defaults."""

    address: Optional[str] = _flag(
        None,
        "Ray cluster address (host:port or auto); default: $RAY_ADDRESS, else start a local Ray",
    )
    host: str = _flag(
        "127.0.0.1",
        "interface the HTTP proxy listens on; 0.0.0.0 exposes the "
        "model and page to every network this machine is on (docs/serve.md)",
    )
    port: int = _flag(8000, "HTTP port")
    replicas: int = _flag(
        1, f"model replicas, each {CPUS_PER_REPLICA} CPU (plus 1 GPU with --use-gpu)"
    )
    max_batch_size: int = _flag(
        64, "most images in one forward pass, gathered across concurrent requests"
    )
    use_gpu: bool = _flag(False, "one GPU per replica")

    def __post_init__(self) -> None:
        if not self.host or not self.host.strip():
            raise ConfigError("--host must name an interface, e.g. 127.0.0.1")
        _check_int("port", self.port, 1, 65535)
        _check_int("replicas", self.replicas, 1)
        _check_int("max-batch-size", self.max_batch_size, 1)


_check_int = check_int


def _best_checkpoint(target: str | os.PathLike) -> str:
    """The checkpoint a run directory, Tune experiment or checkpoint path stands for
    (a local path or a URI)."""
    return resolve_target(target).checkpoint


def _absolute(checkpoint: str) -> str:
    from raytrain_mnist.driver.runs import is_uri

    return checkpoint if is_uri(checkpoint) else str(Path(checkpoint).expanduser().resolve())


# --------------------------------------------------------------------------- requests


class BadRequest(Exception):
    """A request the server refuses: HTTP ``status`` and a one-line reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_images(body: bytes, max_images: int = MAX_IMAGES) -> np.ndarray:
    """The images of a ``/predict`` body as uint8 ``(N, 28, 28)``; :class:`BadRequest` else."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest(400, 'the body is not JSON; send {"images": [...]}') from None
    images = payload.get("images") if isinstance(payload, dict) else None
    if not isinstance(images, list) or not images:
        raise BadRequest(
            422,
            'expected {"images": [...]}: a non-empty list of 28x28 '
            "integer arrays (0-255) or base64 PNGs",
        )
    if len(images) > max_images:
        raise BadRequest(
            413,
            f"{len(images)} images in one request; the limit is "
            f"{max_images}: split them over several requests",
        )
    batch = np.empty((len(images), SIDE, SIDE), dtype=np.uint8)
    for i, image in enumerate(images):
        batch[i] = (
            png_to_mnist(_b64decode(image, i), i) if isinstance(image, str) else _pixels(image, i)
        )
    return batch


def _pixels(image: Any, i: int) -> np.ndarray:
    try:
        array = np.asarray(image)
    except (ValueError, TypeError, OverflowError):  # ragged nesting, odd types
        array = None
    if array is None or array.shape != (SIDE, SIDE):
        shape = "x".join(map(str, array.shape)) if array is not None else "ragged"
        raise BadRequest(
            422,
            f"image {i} has shape {shape or 'scalar'}; each image must be "
            "28x28 integers 0-255 or a base64 PNG",
        )
    if array.dtype.kind not in "iu":
        raise BadRequest(422, f"image {i}: pixels must be integers 0-255, got {_kind(array.dtype)}")
    if array.min() < 0 or array.max() > 255:
        raise BadRequest(
            422, f"image {i}: pixel values must be in 0-255, got {array.min()}..{array.max()}"
        )
    return array


def _kind(dtype: np.dtype) -> str:
    return {"f": "floats", "b": "booleans", "U": "strings", "O": "mixed or huge values"}.get(
        dtype.kind, str(dtype)
    )


def _b64decode(text: str, i: int) -> bytes:
    if text.startswith("data:"):  # a data URL, as a canvas's toDataURL() makes
        text = text.partition(",")[2]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(
            422, f"image {i} is a string but not base64 (a PNG, or a data: URL of one)"
        ) from None


def png_to_mnist(data: bytes, i: int = 0) -> np.ndarray:
    """A PNG of any size made MNIST-like: uint8 28x28, white digit on black, the digit
    scaled into a 20x20 box and centred by its centre of mass, as MNIST's digits were."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as img:
            if img.width * img.height > MAX_PNG_PIXELS:
                raise BadRequest(
                    413,
                    f"image {i} is {img.width}x{img.height} pixels; the "
                    f"limit is {MAX_PNG_PIXELS} pixels",
                )
            rgba = img.convert("RGBA")
    except BadRequest:
        raise
    except (
        UnidentifiedImageError,
        OSError,
        SyntaxError,
        ValueError,
        Image.DecompressionBombError,
    ) as exc:
        raise BadRequest(
            422, f"image {i} is not a readable PNG ({exc.__class__.__name__})"
        ) from None
    # Transparent pixels count as paper: a digit drawn on a transparent sheet shows on white.
    paper = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    gray = np.asarray(Image.alpha_composite(paper, rgba).convert("L"), dtype=np.float32)
    return _mnist_like(gray)


def _mnist_like(gray: np.ndarray) -> np.ndarray:
    from PIL import Image

    border = np.concatenate([gray[0], gray[-1], gray[:, 0], gray[:, -1]])
    if np.median(border) > 127:  # dark ink on light paper: MNIST's digits are white on black
        gray, border = 255 - gray, 255 - border
    ink = np.clip(gray - np.median(border), 0, None)
    if ink.max() < 16:  # a blank sheet stays blank
        return np.zeros((SIDE, SIDE), dtype=np.uint8)
    ink *= 255.0 / ink.max()
    rows, cols = np.nonzero(ink > 25)
    ink = ink[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
    scale = 20.0 / max(ink.shape)
    size = (max(1, round(ink.shape[1] * scale)), max(1, round(ink.shape[0] * scale)))
    box = np.asarray(
        Image.fromarray(ink.astype(np.uint8)).resize(size, Image.Resampling.LANCZOS),
        dtype=np.float32,
    )
    # Place the box so that its centre of mass lands on pixel (14, 14), where MNIST's are.
    total = box.sum() or 1.0
    com_y = (box.sum(1) * np.arange(box.shape[0])).sum() / total
    com_x = (box.sum(0) * np.arange(box.shape[1])).sum() / total
    top = int(np.clip(round(SIDE / 2 - com_y), 0, SIDE - box.shape[0]))
    left = int(np.clip(round(SIDE / 2 - com_x), 0, SIDE - box.shape[1]))
    out = np.zeros((SIDE, SIDE), dtype=np.float32)
    out[top : top + box.shape[0], left : left + box.shape[1]] = box
    return np.clip(out, 0, 255).round().astype(np.uint8)


def page() -> bytes:
    """The drawing page, from the package's data."""
    return resources.files("raytrain_mnist.serving").joinpath(*_PAGE).read_bytes()


# --------------------------------------------------------------------------- the deployment

#: Bodies smaller than this are parsed on the event loop (a thread hop would cost more).
_PARSE_INLINE_BYTES = 64 * 1024
#: Only what the page itself holds may load: no CDN, no third-party request.
_PAGE_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
)


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
        # module imports neither Ray nor torch until a replica or the CLI needs them).
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


def build_app(args: dict):
    """The Serve application; also the ``import_path`` target of ``serve deploy`` configs.

    ``args``: ``checkpoint`` (a checkpoint directory or state.pt; the weights are read here,
    where the application is built), ``replicas``, ``max_batch_size``, ``use_gpu``.
    """
    from ray import serve

    known = {"checkpoint", "replicas", "max_batch_size", "use_gpu"}
    unknown = sorted(set(args) - known)
    if unknown or "checkpoint" not in args:
        raise ConfigError(f"serve application args: need 'checkpoint'; unknown: {unknown}")
    replicas, batch = int(args.get("replicas", 1)), int(args.get("max_batch_size", 64))
    use_gpu = bool(args.get("use_gpu", False))
    checkpoint = _absolute(str(args["checkpoint"]))
    state, model = load_checkpoint(checkpoint)
    info = {"checkpoint": checkpoint, "epoch": state.get("epoch")}
    amp = (state.get("config") or {}).get("amp", "off")
    deployment = serve.deployment(
        DigitClassifier,
        name="DigitClassifier",
        num_replicas=replicas,
        # Room for a full batch in flight and the next one gathering.
        max_ongoing_requests=max(8, 2 * batch),
        # Requests take milliseconds: a stopping replica need not wait 2 s between checks
        # for its last ones.
        graceful_shutdown_wait_loop_s=0.2,
        ray_actor_options={"num_cpus": CPUS_PER_REPLICA, "num_gpus": 1 if use_gpu else 0},
    )
    return deployment.bind(model.state_dict(), amp, info, batch, use_gpu)


# --------------------------------------------------------------------------- config file


def deploy_config(cfg: ServeConfig, checkpoint: str) -> dict:
    """A config for Ray's ``serve deploy`` (``ServeDeploySchema``) serving ``checkpoint``."""
    return {
        "http_options": {"host": cfg.host, "port": cfg.port},
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": "raytrain_mnist.serve:build_app",
                "args": {
                    "checkpoint": _absolute(checkpoint),
                    "replicas": cfg.replicas,
                    "max_batch_size": cfg.max_batch_size,
                    "use_gpu": cfg.use_gpu,
                },
            }
        ],
    }


def write_config(path: str | os.PathLike, cfg: ServeConfig, checkpoint: str) -> Path:
    import yaml

    path = Path(path).expanduser()
    header = (
        "# Ray Serve config for `serve deploy` (or `serve run`), written by "
        "`raytrain-mnist serve --write-config`.\n# The application is built on the "
        "cluster: it needs raytrain_mnist installed and the checkpoint at this path.\n"
    )
    try:
        path.write_text(header + yaml.safe_dump(deploy_config(cfg, checkpoint), sort_keys=False))
    except OSError as exc:
        raise UserError(f"cannot write {path} ({exc.strerror or exc})", EXIT_USAGE) from exc
    return path


# --------------------------------------------------------------------------- serving


def check_local(cfg: ServeConfig) -> None:
    """What can be refused before a local Ray starts: GPUs, and the HTTP port."""
    if cfg.use_gpu:
        import torch

        found = torch.cuda.device_count()
        if found < cfg.replicas:
            raise UserError(
                f"--use-gpu asks for {cfg.replicas} GPU replica(s) but this "
                f"machine has {found} GPU(s) visible to PyTorch (no --address or "
                "RAY_ADDRESS given); drop --use-gpu to serve on CPUs, or lower "
                "--replicas",
                EXIT_USAGE,
            )
    with socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.port))
        except OSError as exc:
            raise UserError(
                f"cannot listen on {cfg.host}:{cfg.port} ({exc.strerror or exc}); "
                "pass another --port or --host",
                EXIT_USAGE,
            ) from exc
        except (socket.gaierror, UnicodeError) as exc:
            raise UserError(
                f"--host {cfg.host!r} is not an address of this machine", EXIT_USAGE
            ) from exc


def url_of(cfg: ServeConfig) -> str:
    host = cfg.host
    if host in ("0.0.0.0", "::"):  # every interface; this name reaches one of them
        host = socket.gethostname()
    return f"http://{f'[{host}]' if ':' in host else host}:{cfg.port}/"


@contextlib.contextmanager
def serving(cfg: ServeConfig, checkpoint: str) -> Iterator[str]:
    """Deploy ``checkpoint`` and yield the URL; on exit remove what this call deployed
    (the application; Serve itself when it was not running before; a Ray it started)."""
    from ray import serve

    from raytrain_mnist.driver import cluster

    address = cluster.resolve_address(cfg.address)
    # Reads the weights: a bad checkpoint is refused here, before any Ray starts.
    app = build_app(
        {
            "checkpoint": checkpoint,
            "replicas": cfg.replicas,
            "max_batch_size": cfg.max_batch_size,
            "use_gpu": cfg.use_gpu,
        }
    )
    # Replicas are not training workers: the local Ray is sized for them as extra CPUs,
    # and their placement is checked below, in their own words.
    request = cluster.Request(0, 1, cfg.use_gpu, extra_cpus=cfg.replicas * CPUS_PER_REPLICA)
    with cluster.connect(address, request) as started_ray:
        _check_placeable(cfg, strict=started_ray)
        before = serve.status()
        if APP_NAME in before.applications:
            raise UserError(
                f"an application named {APP_NAME!r} already runs on this "
                "cluster's Serve (`serve status`): stop the serve that runs it, "
                "or remove it (`serve shutdown` stops all of Serve)"
            )
        serve_was_running = bool(before.proxies or before.applications)
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        try:
            if serve_was_running:
                _check_same_http(cfg)
            logger.info(
                "deploying %s (%d replica(s), batches of up to %d images)",
                checkpoint,
                cfg.replicas,
                cfg.max_batch_size,
            )
            serve.run(app, name=APP_NAME, route_prefix="/")
            yield url_of(cfg)
        finally:
            logger.info("shutting down the application")
            # The delete is sent to Serve's controller before the wait for it starts, so it
            # holds even if this process is killed meanwhile (a stopped job is, after 3 s).
            with contextlib.suppress(Exception):  # keep going: Serve itself must still stop
                serve.delete(APP_NAME)
            # A Ray we started goes down whole right after this; Serve with it.
            if not serve_was_running and not started_ray:
                serve.shutdown()


def _check_placeable(cfg: ServeConfig, strict: bool) -> None:
    """Serve would wait forever for replicas the cluster cannot place: refuse at once on a
    Ray we started; on a cluster an autoscaler may still add nodes, so only warn."""
    import ray

    from raytrain_mnist.driver import cluster

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    want = cluster.Request(cfg.replicas, CPUS_PER_REPLICA, cfg.use_gpu)
    fits = cluster.placeable_workers(nodes, want)
    if fits >= cfg.replicas:
        return
    what = "GPU" if cfg.use_gpu else "CPU"
    message = (
        f"the cluster can place {fits} of {cfg.replicas} replica(s) "
        f"({CPUS_PER_REPLICA} CPU{' + 1 GPU' if cfg.use_gpu else ''} each)"
    )
    if strict:
        raise UserError(f"{message}; lower --replicas", EXIT_USAGE)
    logger.warning("%s; Serve waits until nodes with a free %s join", message, what)


def _check_same_http(cfg: ServeConfig) -> None:
    """Serve keeps the HTTP host and port it started with and ignores new ones."""
    running = compat.serve_http_config()
    if running is None:
        return
    if (running.host, running.port) != (cfg.host, cfg.port):
        raise UserError(
            f"Serve already runs on this cluster with HTTP on {running.host}:"
            f"{running.port}, and keeps it; pass --host {running.host} --port "
            f"{running.port}",
            EXIT_USAGE,
        )


@contextlib.contextmanager
def _signals_stop() -> Iterator[None]:
    """Ctrl-C, and the SIGTERM that ``submit stop`` (or systemd, or Docker) sends, both
    stop the server the same way. Installed once Ray is up: Ray's own handlers (a stack dump
    and ``sys.exit`` on SIGTERM) replace any installed before ``ray.init``. SIGINT is set
    explicitly because a shell starts background commands with it ignored."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# --------------------------------------------------------------------------- the command


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist serve",
        description="Serve a run's best checkpoint over HTTP with Ray Serve: POST /predict, "
        "GET /health, and a page at / to draw a digit on. Ctrl-C stops it.",
    )
    add_target_argument(parser)
    add_dataclass_args(parser, ServeConfig, "serving")
    parser.add_argument(
        "--write-config",
        metavar="FILE",
        help="write a Ray Serve config for `serve deploy` to FILE and exit (starts nothing)",
    )
    return parser


def parse_command(argv: Sequence[str] | None = None) -> tuple[str, ServeConfig, str | None]:
    """Flags only (``submit`` checks them here; the target is the cluster's path)."""
    args = build_parser().parse_args(argv)
    return args.target, dataclass_from_args(ServeConfig, args), args.write_config


def _serve(target: str, cfg: ServeConfig, config_file: str | None) -> int:
    checkpoint = _best_checkpoint(target)
    if config_file:
        load_checkpoint(checkpoint)  # a bad checkpoint is one line now, not the cluster's
        path = write_config(config_file, cfg, checkpoint)
        print(f"wrote {path}; deploy it with: serve deploy {path}")
        return 0
    from raytrain_mnist.driver import cluster

    if cluster.resolve_address(cfg.address) is None:
        check_local(cfg)
    from ray import serve  # noqa: F401  (configures Serve's logger, which we then quiet)

    # Serve's driver-side INFO lines repeat what this command prints.
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    with serving(cfg, checkpoint) as url, _signals_stop():
        print(
            f"serving {checkpoint} at {url} (POST {url}predict, GET {url}health); Ctrl-C stops",
            flush=True,
        )
        if cfg.host not in ("127.0.0.1", "localhost", "::1"):
            print(
                f"listening on {cfg.host}: anyone who can reach this machine can use the "
                "model (see docs/serve.md)",
                flush=True,
            )
        try:
            while True:
                signal.pause()
        except KeyboardInterrupt:
            print("stopping", flush=True)
    print("stopped")
    return 0


def run(parsed: tuple[str, ServeConfig, str | None]) -> int:
    target, cfg, config_file = parsed
    setup_logging()
    return _serve(target, cfg, config_file)


COMMAND = Command("serve", build_parser, parse_command, run)
cli = COMMAND.main


if __name__ == "__main__":
    sys.exit(COMMAND.main())
