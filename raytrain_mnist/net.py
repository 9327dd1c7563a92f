"""Host names and addresses as text: ``host:port`` split, and "is this this machine's
loopback". Pure: no lookups, no sockets."""

from __future__ import annotations

import ipaddress

#: Names that mean loopback without a lookup (a resolver may map any other name anywhere).
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address, IPv6 optionally in brackets, IPv4 optionally mapped
    into IPv6 as a dual-stack socket reports it) is this machine's loopback: ``localhost``,
    ``127.0.0.0/8`` or ``::1``."""
    host = str(host).strip().lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def split_host_port(text: str) -> tuple[str | None, int | None]:
    """``host:port`` or ``[v6]:port`` into its parts; None for a part that is not valid."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:  # an IPv6 address without brackets: the port is ambiguous
        return None, None
    valid_host = bool(host) and host.isprintable() and not any(c in host for c in " /@?#[]")
    valid_port = bool(sep) and port.isdigit() and 0 < int(port) < 65536
    return (host if valid_host else None), (int(port) if valid_port else None)
