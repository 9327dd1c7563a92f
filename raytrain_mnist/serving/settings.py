"""How the model is served: :class:`ServeConfig`, the serve command's settings and defaults,
and who may use what it serves (:func:`check_access`, :class:`TokenHash`).

Pure (no Ray): the command builds it from flags, the driver side deploys by it, and the
replicas' sizing (:data:`CPUS_PER_REPLICA`) is read from here by both.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field
from typing import Optional

from raytrain_mnist.config import check_int, option
from raytrain_mnist.errors import ConfigError
from raytrain_mnist.net import is_loopback

#: One CPU (and one torch thread) per replica: the net is small, so more replicas scale
#: better than more threads in one.
CPUS_PER_REPLICA = 1
#: Where the bearer token comes from when ``--auth-token`` is not given, and where an
#: application built from a ``serve deploy`` config (``auth: token``) reads it.
TOKEN_ENV = "RAYTRAIN_MNIST_SERVE_TOKEN"
#: A token is RFC 6750's b64token (what an ``Authorization: Bearer`` header can carry), long
#: enough not to be guessed: ``python -c 'import secrets; print(secrets.token_urlsafe())'``.
TOKEN_MIN_CHARS = 16
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
#: A :class:`TokenHash` as one line of text: ``sha256$SALT$DIGEST``, both in hex.
_TOKEN_HASH = re.compile(r"sha256\$([0-9a-f]{32})\$([0-9a-f]{64})")
#: How HTTP reaches the replicas (docs/serve.md, "Ingress"): ``direct``, the one replica's own
#: HTTP server on --host:--port; ``haproxy``, Ray's HAProxy in front of the replicas'
#: servers; ``proxy``, Ray Serve's Python proxy; ``auto``: direct with one replica on a
#: local Ray that serve starts, proxy otherwise.
INGRESS_CHOICES = ("auto", "direct", "haproxy", "proxy")


@dataclass(frozen=True)
class ServeConfig:
    """How the model is served; the one home of the serve command's defaults."""

    address: Optional[str] = option(
        None,
        "Ray cluster address (host:port or auto); default: $RAY_ADDRESS, else start a local Ray",
    )
    host: str = option(
        "127.0.0.1",
        "interface the HTTP port listens on; beyond loopback (e.g. 0.0.0.0, every "
        f"network this machine is on) POST /predict needs a token (${TOKEN_ENV} or "
        "--auth-token) or --no-auth (docs/serve.md)",
    )
    port: int = option(8000, "HTTP port")
    replicas: int = option(
        1, f"model replicas, each {CPUS_PER_REPLICA} CPU (plus 1 GPU with --use-gpu)"
    )
    max_batch_size: int = option(
        64, "most images in one forward pass, gathered across concurrent requests (1: none)"
    )
    use_gpu: bool = option(False, "one GPU per replica")
    request_timeout_s: int = option(
        30,
        "seconds a request's body may take to arrive; a slower one gets 408 (Serve's "
        "proxy ends any request 5 s after)",
    )
    ingress: str = option(
        "auto",
        "how HTTP reaches the replicas: direct (the one replica's own server on --host:--port, "
        "no proxy: the fastest), haproxy (HAProxy in front of the replicas), proxy (Ray "
        "Serve's Python proxy); auto: direct with 1 replica on a local Ray, proxy otherwise "
        "(docs/serve.md)",
        choices=INGRESS_CHOICES,
    )
    no_auth: bool = option(
        False,
        "listen beyond loopback without a token: anyone who reaches the port may use the model",
    )

    def __post_init__(self) -> None:
        if not self.host or not self.host.strip():
            raise ConfigError("--host must name an interface, e.g. 127.0.0.1")
        check_int("port", self.port, 1, 65535)
        check_int("replicas", self.replicas, 1)
        check_int("max-batch-size", self.max_batch_size, 1)
        check_int("request-timeout-s", self.request_timeout_s, 1, 3600)
        if self.ingress not in INGRESS_CHOICES:
            raise ConfigError(f"--ingress must be one of {', '.join(INGRESS_CHOICES)}")
        if self.ingress == "direct" and self.replicas > 1:
            raise ConfigError(
                "--ingress direct serves one replica on --port; for --replicas "
                f"{self.replicas} pass --ingress haproxy or --ingress proxy"
            )

    @property
    def loopback(self) -> bool:
        """Whether the proxy listens on loopback only (requests then must name it in
        ``Host``: a DNS-rebound page cannot reach it)."""
        return is_loopback(self.host)


def check_token(token: str, source: str) -> str:
    """``token`` if it can be a bearer token; ConfigError naming ``source`` (``--auth-token``
    or the variable) otherwise. The message never repeats the token."""
    if len(token) < TOKEN_MIN_CHARS or not _TOKEN.fullmatch(token):
        raise ConfigError(
            f"{source} must be at least {TOKEN_MIN_CHARS} characters of A-Z a-z 0-9 - . _ ~ + / "
            "(then =), e.g. from: python -c 'import secrets; print(secrets.token_urlsafe())'"
        )
    return token


@dataclass(frozen=True)
class TokenHash:
    """What ``POST /predict`` checks a bearer token against: a salted SHA-256 of the token,
    from which the token cannot be recovered. Replicas, the driver of a submitted ``serve``
    and the job's uploaded files hold this, never the token (docs/serve.md).

    SHA-256 and not a slow KDF (scrypt, PBKDF2): the check runs on every request, and a KDF
    slow enough to matter costs more CPU than the request itself. A slow hash protects
    guessable passwords; a bearer token is random (``secrets.token_urlsafe()``: 256 bits,
    and :data:`TOKEN_MIN_CHARS` of the base64 alphabet are 96), which no hash, fast or slow,
    lets anyone guess. The salt makes two hashes of one token differ (and a precomputed
    table useless)."""

    salt: bytes = field(repr=False)
    digest: bytes = field(repr=False)

    @classmethod
    def of(cls, token: str) -> TokenHash:
        """A new hash (a fresh random salt) of ``token``, a checked one (:func:`check_token`)."""
        salt = secrets.token_bytes(16)
        return cls(salt, _salted_sha256(salt, token.encode("ascii")))

    @classmethod
    def parse(cls, text: str, source: str) -> TokenHash:
        """The hash that ``text`` (:meth:`line`'s form) writes; ConfigError naming ``source``
        otherwise (the message never repeats ``text``)."""
        found = _TOKEN_HASH.fullmatch(text.strip())
        if found is None:
            raise ConfigError(
                f"{source} is not a token hash (one line: sha256$SALT$DIGEST, 32 and 64 "
                "hex digits, as `submit` writes it)"
            )
        return cls(bytes.fromhex(found[1]), bytes.fromhex(found[2]))

    def line(self) -> str:
        """The hash as one line of text, which :meth:`parse` reads."""
        return f"sha256${self.salt.hex()}${self.digest.hex()}"

    def accepts(self, presented: bytes) -> bool:
        """Whether ``presented`` (an ``Authorization: Bearer`` credential) is the token."""
        # Constant time: how much of a wrong token's hash matched does not show in the answer.
        return hmac.compare_digest(_salted_sha256(self.salt, presented), self.digest)


def _salted_sha256(salt: bytes, token: bytes) -> bytes:
    return hashlib.sha256(salt + token).digest()


def check_access(cfg: ServeConfig, token: TokenHash | None, listening: bool = True) -> None:
    """A token and ``--no-auth`` contradict; and when ``listening`` (serving, rather than
    writing a config whose application reads its token on the cluster), a proxy beyond
    loopback needs one of them. Checked before anything starts."""
    if token is not None and cfg.no_auth:
        raise ConfigError(
            f"--no-auth and a token (--auth-token or ${TOKEN_ENV}) contradict; drop one"
        )
    if listening and token is None and not cfg.no_auth and not cfg.loopback:
        raise ConfigError(
            f"--host {cfg.host} listens beyond loopback: give POST /predict a token "
            f"(${TOKEN_ENV}, or --auth-token) or pass --no-auth to serve it to anyone who "
            "reaches the port"
        )


def loopback_host_header(value: str) -> bool:
    """A ``Host`` header that names this machine's loopback (``127.0.0.1``, ``localhost``,
    ``[::1]``, each with an optional port), as a browser sends it for a loopback URL. A
    DNS-rebound name (an attacker's domain that now resolves to 127.0.0.1) is not one."""
    host = value.strip()
    if host.startswith("["):  # [v6]:port
        name, bracket, port = host[1:].partition("]")
        if not bracket:
            return False
        port = port.removeprefix(":") if port else ""
    else:
        name, _, port = host.partition(":")
        if ":" in port:  # an unbracketed IPv6 literal is no Host header
            return False
    return bool(name) and (port == "" or port.isdigit()) and is_loopback(name)
