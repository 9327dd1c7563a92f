"""Serving from the driver: deploy a checkpoint on Ray Serve, check what can be checked
before Ray starts, and write a config for Ray's own ``serve deploy``.

What runs inside the replicas is :mod:`raytrain_mnist.serving.app`; this module reads the
checkpoint (once, here, so a bad one is refused before any Ray starts), binds the
application to its weights and deploys it. :func:`build_app` is also the ``import_path``
that a ``serve deploy`` config names: Serve's controller then runs it on the cluster.
Library code: it logs, never prints.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from raytrain_mnist import compat
from raytrain_mnist.driver import cluster
from raytrain_mnist.driver.evaluation import load_checkpoint
from raytrain_mnist.driver.runs import is_uri
from raytrain_mnist.errors import EXIT_USAGE, ConfigError, UserError
from raytrain_mnist.serving import app
from raytrain_mnist.serving.settings import (
    CPUS_PER_REPLICA,
    TOKEN_ENV,
    ServeConfig,
    check_access,
    check_token,
)

logger = logging.getLogger(__name__)

#: The Serve application's name on the cluster (``serve status`` shows it).
APP_NAME = "raytrain_mnist"
#: What a ``serve deploy`` config imports to build the application (:func:`build_app`).
IMPORT_PATH = f"{__name__}:build_app"
_APP_ARGS = (
    "checkpoint",
    "replicas",
    "max_batch_size",
    "use_gpu",
    "request_timeout_s",
    "hosts",
    "auth",
)
#: ``hosts``: which ``Host`` headers the replicas answer (``loopback``: only loopback names,
#: for a proxy on loopback; ``any``); ``auth``: ``token`` (read from $RAYTRAIN_MNIST_SERVE_TOKEN
#: where the application is built) or ``none``. Configs written before these existed get
#: the safe side: loopback names only, no token.
_HOSTS = ("loopback", "any")
_AUTH = ("token", "none")


# --------------------------------------------------------------------------- the application


def build_app(args: dict):
    """The Serve application; also the ``import_path`` target of ``serve deploy`` configs.

    ``args``: ``checkpoint`` (a checkpoint directory or state.pt; the weights are read here,
    where the application is built), ``replicas``, ``max_batch_size``, ``use_gpu``,
    ``request_timeout_s``, ``hosts`` and ``auth`` (with ``token``, the token is read from
    ``$RAYTRAIN_MNIST_SERVE_TOKEN`` here: a config file never holds it).
    """
    unknown = sorted(set(args) - set(_APP_ARGS))
    if unknown or "checkpoint" not in args:
        raise ConfigError(f"serve application args: need 'checkpoint'; unknown: {unknown}")
    hosts, auth = args.get("hosts", "loopback"), args.get("auth", "none")
    if hosts not in _HOSTS or auth not in _AUTH:
        raise ConfigError(
            f"serve application args: hosts must be one of {_HOSTS}, auth one of {_AUTH}"
        )
    token = None
    if auth == "token":
        token = os.environ.get(TOKEN_ENV)
        if not token:
            raise ConfigError(
                f"serve application args: auth: token needs ${TOKEN_ENV} set where the "
                "application is built (a Secret on KubeRay: docs/serve.md)"
            )
        check_token(token, f"${TOKEN_ENV}")
    access = app.Access(
        token=token,
        loopback_only=hosts == "loopback",
        request_timeout_s=int(args.get("request_timeout_s", ServeConfig.request_timeout_s)),
    )
    return _application(args, access)


def _application(args: dict, access: app.Access):
    checkpoint = _absolute(str(args["checkpoint"]))
    state, model = load_checkpoint(checkpoint)
    return app.application(
        model.state_dict(),
        amp=(state.get("config") or {}).get("amp", "off"),
        info={"epoch": state.get("epoch")},  # nothing local: /health may be public
        replicas=int(args.get("replicas", ServeConfig.replicas)),
        max_batch_size=int(args.get("max_batch_size", ServeConfig.max_batch_size)),
        use_gpu=bool(args.get("use_gpu", ServeConfig.use_gpu)),
        access=access,
    )


def _app_args(cfg: ServeConfig, checkpoint: str, auth: str) -> dict:
    return {
        "checkpoint": checkpoint,
        "replicas": cfg.replicas,
        "max_batch_size": cfg.max_batch_size,
        "use_gpu": cfg.use_gpu,
        "request_timeout_s": cfg.request_timeout_s,
        "hosts": "loopback" if cfg.loopback else "any",
        "auth": auth,
    }


def _http_options(cfg: ServeConfig) -> dict:
    return {
        "host": cfg.host,
        "port": cfg.port,
        "request_timeout_s": app.Access(request_timeout_s=cfg.request_timeout_s).proxy_timeout_s,
    }


def _absolute(checkpoint: str) -> str:
    return checkpoint if is_uri(checkpoint) else str(Path(checkpoint).expanduser().resolve())


# --------------------------------------------------------------------------- config file


def deploy_config(cfg: ServeConfig, checkpoint: str, token_auth: bool | None = None) -> dict:
    """A config for Ray's ``serve deploy`` (``ServeDeploySchema``) serving ``checkpoint``.

    It holds no secret. With ``token_auth`` (by default: beyond loopback, unless
    ``cfg.no_auth``) it says ``auth: token``, and the application reads the token from
    ``$RAYTRAIN_MNIST_SERVE_TOKEN`` where it is built."""
    if token_auth is None:
        token_auth = not (cfg.loopback or cfg.no_auth)
    return {
        "http_options": _http_options(cfg),
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": _app_args(cfg, _absolute(checkpoint), "token" if token_auth else "none"),
            }
        ],
    }


def write_config(
    path: str | os.PathLike, cfg: ServeConfig, checkpoint: str, token_auth: bool | None = None
) -> Path:
    """Write :func:`deploy_config` as YAML to ``path``; the path written."""
    import yaml

    path = Path(path).expanduser()
    config = deploy_config(cfg, checkpoint, token_auth)
    header = (
        "# Ray Serve config for `serve deploy` (or `serve run`), written by "
        "`raytrain-mnist serve --write-config`.\n# The application is built on the "
        "cluster: it needs raytrain_mnist installed and the checkpoint at this path.\n"
    )
    if config["applications"][0]["args"]["auth"] == "token":
        header += (
            f"# auth: token: where the application is built, ${TOKEN_ENV} must hold the "
            "token that POST /predict then requires (never written here).\n"
        )
    try:
        path.write_text(header + yaml.safe_dump(config, sort_keys=False))
    except OSError as exc:
        raise UserError(f"cannot write {path} ({exc.strerror or exc})", EXIT_USAGE) from exc
    return path


# --------------------------------------------------------------------------- serving


def check_local(cfg: ServeConfig) -> None:
    """What can be refused before a local Ray starts: GPUs, and the HTTP port. Nothing is
    checked when ``cfg`` (or ``RAY_ADDRESS``) names a cluster: its nodes are, once connected."""
    if cluster.resolve_address(cfg.address) is not None:
        return
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
def serving(cfg: ServeConfig, checkpoint: str, token: str | None = None) -> Iterator[str]:
    """Deploy ``checkpoint`` and yield the URL; on exit remove what this call deployed
    (the application; Serve itself when it was not running before; a Ray it started).
    With ``token``, ``POST /predict`` needs it as ``Authorization: Bearer``; beyond loopback
    a token or ``cfg.no_auth`` is required (ConfigError)."""
    from ray import serve

    check_access(cfg, token)
    if token is not None:
        check_token(token, "the token")
    address = cluster.resolve_address(cfg.address)
    # Reads the weights: a bad checkpoint is refused here, before any Ray starts.
    access = app.Access(token, cfg.loopback, cfg.request_timeout_s)
    application = _application(_app_args(cfg, checkpoint, "none"), access)
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
        serve.start(http_options=_http_options(cfg))
        try:
            if serve_was_running:
                _check_same_http(cfg)
            logger.info(
                "deploying %s (%d replica(s), batches of up to %d images)",
                checkpoint,
                cfg.replicas,
                cfg.max_batch_size,
            )
            serve.run(application, name=APP_NAME, route_prefix="/")
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
    wanted = _http_options(cfg)["request_timeout_s"]
    if getattr(running, "request_timeout_s", wanted) != wanted:
        logger.warning(
            "Serve already runs with its proxy's request timeout at %s s (this serve asks for "
            "%s s) and keeps it; the replicas still refuse bodies slower than %d s",
            running.request_timeout_s,
            wanted,
            cfg.request_timeout_s,
        )
