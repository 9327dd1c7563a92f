"""HAProxy as Ray's HAProxy mode starts it, with its configuration made safe first.

``python -m raytrain_mnist.serving.haproxy REAL_BINARY HOST ARGS...``: what ``serve`` gives
Ray as the HAProxy binary (``RAY_SERVE_HAPROXY_BINARY_PATH``, a two-line script in serve's
private directory). Ray starts (and on every change of replicas, restarts) HAProxy as
``BINARY -db -f CONFIG ...``; this rewrites CONFIG in place (:func:`guard`), then becomes the
real binary with the same arguments (so Ray finds its process by the config path, as ever).

Ray 2.60's template (``ray/serve/_private/haproxy_templates.py``) has no setting for these:
it binds the stats page and the Prometheus metrics on every interface, makes the admin socket
mode 666, sets no ``timeout http-request`` and lets idle stats connections take the
frontend's connections (one ``maxconn`` for all). After :func:`guard`: both listen on the
serve host only, each with :data:`SIDE_MAXCONN` connections of its own, the frontend with
:data:`FRONTEND_MAXCONN` of its own, every head must arrive within
:data:`HEAD_TIMEOUT_S`, and the admin socket and its folder are the user's only.
"""

from __future__ import annotations

import os
import re
import sys

from raytrain_mnist.serving.settings import is_loopback

#: The serve port's own connections (HAProxy's global maxconn is set above the sum).
FRONTEND_MAXCONN = 1024
#: Connections of the stats page and of the metrics endpoint, each.
SIDE_MAXCONN = 16
#: What Ray's global ``maxconn`` must be for the three (``RAY_SERVE_HAPROXY_MAXCONN``).
GLOBAL_MAXCONN = FRONTEND_MAXCONN + 2 * SIDE_MAXCONN + 32
#: Seconds a request's head may take (``timeout http-request``).
HEAD_TIMEOUT_S = 5

#: On loopback, Serve's own ``/-/healthz`` and ``/-/routes`` (HAProxy answers them itself)
#: refuse a ``Host`` that names no loopback, as the replicas do (serving.http).
_FOREIGN_HOST_RULE = (
    "    http-request return status 421 content-type application/json string "
    '"{\\"error\\": \\"Host is not a loopback name\\"}" if { path_beg /-/ } '
    "{ req.hdr(host) -m found } "
    r"!{ req.hdr(host) -m reg -i '^(127\.[0-9]+\.[0-9]+\.[0-9]+|localhost|\[::1\])(:[0-9]+)?$' }"
)
_SECTION = re.compile(r"^(global|defaults|frontend|backend|listen)\b\s*(\S*)")
_BIND = re.compile(r"^(\s*)bind\s+(\*|)?:(\d+)\s*$")


def guard(config: str, host: str) -> str:
    """Ray's HAProxy ``config`` with the stats and metrics listeners on ``host``, per-listener
    connection limits, a head timeout and a private admin socket."""
    bind_host = "*" if host in ("0.0.0.0", "::", "") else host
    out: list[str] = []
    section = name = ""
    for line in config.splitlines():
        match = _SECTION.match(line)
        if match:
            section, name = match.groups()
            out.append(line)
            if section == "defaults":
                out.append(f"    timeout http-request {HEAD_TIMEOUT_S}s")
            elif (section, name) == ("frontend", "http_frontend"):
                out.append(f"    maxconn {FRONTEND_MAXCONN}")
                if is_loopback(host):  # Serve's /-/ paths, answered here: as the replicas'
                    out.append(_FOREIGN_HOST_RULE)
            elif (section, name) in (("frontend", "prometheus"), ("listen", "stats")):
                out.append(f"    maxconn {SIDE_MAXCONN}")
            continue
        stripped = line.strip()
        if section == "global" and stripped.startswith("stats socket "):
            line = re.sub(r"\bmode\s+\d+", "mode 600", line)
        elif section == "defaults" and stripped.startswith("timeout http-request"):
            continue  # ours, above
        elif (section, name) in (("frontend", "prometheus"), ("listen", "stats")):
            bind = _BIND.match(line)
            if bind:
                line = f"{bind.group(1)}bind {bind_host}:{bind.group(3)}"
        out.append(line)
    return "\n".join(out) + "\n"


def _config_path(args: list[str]) -> str | None:
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "-f":
            return value
    return None


def _private(config: str) -> None:
    """The admin socket's folder (and the socket, once there) the user's only."""
    match = re.search(r"^\s*stats socket\s+(\S+)", config, re.MULTILINE)
    if not match:
        return
    folder = os.path.dirname(match.group(1))
    for path, mode in ((folder, 0o700), (match.group(1), 0o600)):
        try:
            os.chmod(path, mode)
        except OSError:
            pass  # not there yet: HAProxy creates the socket with mode 600


def main(argv: list[str]) -> int:
    real, host, args = argv[0], argv[1], argv[2:]
    path = _config_path(args)
    if path is not None:
        with open(path, encoding="utf-8") as f:
            config = guard(f.read(), host)
        with open(path, "w", encoding="utf-8") as f:
            f.write(config)
        _private(config)
    os.execv(real, [real, *args])
    return 1  # pragma: no cover  (execv does not return)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
