"""``python -m raytrain_mnist.serve RUN_DIR_OR_CHECKPOINT``: the trained model over HTTP.

Deploys a run's best checkpoint (weights only, ``weights_only=True``) as a Ray Serve
application on the cluster (``--address``, ``RAY_ADDRESS``) or on a local Ray this command
starts, prints its URL and serves until Ctrl-C (or SIGTERM, as ``submit stop`` sends), then
removes what it deployed. ``--write-config FILE`` writes the same application as a config
file for Ray's own ``serve deploy`` instead, without starting anything.

The command only parses, prints and waits for the signal. Deploying (and the checks before
Ray starts) is :mod:`raytrain_mnist.driver.deployment`; what runs inside the replicas (the
HTTP API, the page, the batching, the image decoding) is :mod:`raytrain_mnist.serving`,
whose module docstrings describe the API (docs/serve.md too).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from raytrain_mnist._cli import (
    ArgumentParser,
    Command,
    add_dataclass_args,
    add_target_argument,
    dataclass_from_args,
    exit_now,
    on_sigterm,
    setup_logging,
    terminated,
)
from raytrain_mnist.driver import deployment
from raytrain_mnist.driver.deployment import build_app  # noqa: F401  (see below)
from raytrain_mnist.driver.targets import resolve_target
from raytrain_mnist.errors import EXIT_TERMINATED, ConfigError
from raytrain_mnist.serving.settings import (
    TOKEN_ENV,
    ServeConfig,
    TokenHash,
    check_access,
    check_token,
)

# ``build_app`` is imported above so that ``serve deploy`` configs written before it moved
# (``import_path: raytrain_mnist.serve:build_app``) still build; new ones name
# ``deployment.IMPORT_PATH``.


@dataclass(frozen=True)
class ServeOptions:
    """What the command line asks for."""

    target: str  # RUN_DIR_OR_CHECKPOINT, resolved when the command runs (on the cluster's side)
    serve: ServeConfig
    write_config: str | None = None  # write a `serve deploy` config here instead of serving
    #: The salted hash of POST /predict's bearer token (--auth-token, --auth-token-file or
    #: --auth-token-hash, else $RAYTRAIN_MNIST_SERVE_TOKEN): what the replicas check, and all
    #: of the token that leaves this process; never printed, never written into a config file.
    token_hash: TokenHash | None = field(default=None, repr=False)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="raytrain-mnist serve",
        description="Serve a run's best checkpoint over HTTP with Ray Serve: POST /predict, "
        "GET /health, and a page at / to draw a digit on. Ctrl-C stops it.",
    )
    add_target_argument(parser)
    add_dataclass_args(parser, ServeConfig, "serving")
    parser.add_argument(
        "--auth-token",
        metavar="TOKEN",
        help=f"bearer token POST /predict requires (default: ${TOKEN_ENV}; the variable "
        "keeps it out of the process list); needed beyond loopback unless --no-auth",
    )
    parser.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="read the bearer token from FILE's first line instead",
    )
    parser.add_argument(
        "--auth-token-hash",
        metavar="FILE",
        help="read the token's salted hash (sha256$SALT$DIGEST) from FILE's first line "
        "instead of the token: what `submit` carries to the cluster, which never holds the "
        "token",
    )
    parser.add_argument(
        "--write-config",
        metavar="FILE",
        help="write a Ray Serve config for `serve deploy` to FILE and exit (starts nothing)",
    )
    return parser


def parse_command(argv: Sequence[str] | None = None) -> ServeOptions:
    """Flags only (``submit`` checks them here; the target is the cluster's path). Serving
    beyond loopback needs a token or ``--no-auth``; a config file needs neither here (the
    application reads its token where it is built)."""
    args = build_parser().parse_args(argv)
    cfg = dataclass_from_args(ServeConfig, args)
    given = [
        flag
        for flag, value in (
            ("--auth-token", args.auth_token),
            ("--auth-token-file", args.auth_token_file),
            ("--auth-token-hash", args.auth_token_hash),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} contradict; give one")
    if args.auth_token_hash is not None:
        flag = f"--auth-token-hash {args.auth_token_hash}"
        token_hash = TokenHash.parse(read_first_line(args.auth_token_hash, flag), flag)
    elif args.auth_token is not None:
        token_hash = TokenHash.of(check_token(args.auth_token, "--auth-token"))
    elif args.auth_token_file is not None:
        token = read_first_line(args.auth_token_file, f"--auth-token-file {args.auth_token_file}")
        token_hash = TokenHash.of(check_token(token, "--auth-token-file's token"))
    elif os.environ.get(TOKEN_ENV):
        token_hash = TokenHash.of(check_token(os.environ[TOKEN_ENV], f"${TOKEN_ENV}"))
    else:
        token_hash = None
    check_access(cfg, token_hash, listening=not args.write_config)
    if args.write_config and cfg.ingress not in ("auto", "proxy"):
        raise ConfigError(
            f"--write-config writes a config for Serve's proxy (what `serve deploy` and "
            f"KubeRay run); --ingress {cfg.ingress} is for serve itself"
        )
    return ServeOptions(args.target, cfg, args.write_config, token_hash)


def read_first_line(path: str, flag: str) -> str:
    """The first line of ``path``, stripped (a token file may say more after it); ``flag``
    names it in the error."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline(4096).strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or "not UTF-8 text"
        raise ConfigError(f"{flag}: cannot read it ({why})") from None


def run(options: ServeOptions) -> int:
    setup_logging()
    cfg = options.serve
    checkpoint = resolve_target(options.target).checkpoint
    if options.write_config:
        deployment.load_servable(checkpoint)  # a bad one is one line now, not the cluster's
        token_auth = options.token_hash is not None or not (cfg.loopback or cfg.no_auth)
        path = deployment.write_config(options.write_config, cfg, checkpoint, token_auth)
        print(f"wrote {path}; deploy it with: serve deploy {path}")
        if token_auth:
            print(
                f"it holds no token: set ${TOKEN_ENV} where the application is built "
                "(docs/serve.md)"
            )
        return 0
    deployment.check_local(cfg)
    from ray import serve  # noqa: F401  (configures Serve's logger, which we then quiet)

    # Serve's driver-side INFO lines repeat what this command prints.
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    with deployment.serving(cfg, checkpoint, options.token_hash) as url, _signals_stop():
        print(
            f"serving {checkpoint} at {url} (POST {url}predict, GET {url}health); Ctrl-C stops",
            flush=True,
        )
        if url.ingress == "haproxy":
            env = url.env
            print(
                f"HAProxy's stats (port {env.get('RAY_SERVE_HAPROXY_STATS_PORT', 8404)}) and "
                f"metrics (port {env.get('RAY_SERVE_HAPROXY_METRICS_PORT', 9101)}) listen on "
                f"{cfg.host} too (docs/serve.md)",
                flush=True,
            )
        if not cfg.loopback:
            who = "anyone" if options.token_hash is None else "anyone holding the token"
            print(
                f"listening on {cfg.host}: {who} who can reach this machine can use the "
                "model, over plain HTTP (see docs/serve.md)",
                flush=True,
            )
        try:
            while True:
                signal.pause()
        except KeyboardInterrupt:
            print("stopping", flush=True)
    print("stopped")
    return EXIT_TERMINATED if terminated() else 0  # SIGTERM: 143, as every command


@contextlib.contextmanager
def _signals_stop() -> Iterator[None]:
    """Ctrl-C, and the SIGTERM that ``submit stop`` (or systemd, or Docker) sends, both
    stop the server the same way. Installed once Ray is up: Ray's own handlers (a stack dump
    and ``sys.exit`` on SIGTERM) replace any installed before ``ray.init``. SIGINT is set
    explicitly because a shell starts background commands with it ignored."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    # SIGTERM: the command layer's handler (it notes the signal, for the exit status 143, and
    # does what SIGINT's handler, this one, does).
    handlers = {signal.SIGINT: interrupt, signal.SIGTERM: on_sigterm}
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


COMMAND = Command("serve", build_parser, parse_command, run)
cli = COMMAND.main


if __name__ == "__main__":
    exit_now(COMMAND.main())
