"""Credentials in URIs: found, refused and redacted. Flags and recorded paths travel into job
tables, run records and logs, so a URI that carries a secret is refused and shown redacted."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl

from raytrain_mnist.errors import ConfigError

#: URI schemes whose user part (``abfs://CONTAINER@ACCOUNT...``, ``hdfs://USER@HOST``) names
#: a container, an account or a user: not a credential unless it holds a password.
_NAMED_USER_SCHEMES = ("abfs", "abfss", "hdfs", "viewfs")
#: Names of query parameters (and environment variables) that carry secrets, matched
#: case-insensitively as parts of the name: pyarrow's S3 ``access_key``, ``secret_key``,
#: ``session_token``; Azure's ``account_key``, ``client_secret``, SAS ``sig``; any server's
#: token or password.
_SECRET_PARAMETERS = ("key", "secret", "token", "passw", "pwd", "credential", "sig", "auth")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
#: A query value that is a URL (``KEY:SECRET@host`` is not: ``KEY:`` is no scheme there).
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
#: What URL parsers (urllib's, WHATWG's) drop before a scheme: C0 controls and blanks.
_LEADING = "".join(map(chr, range(0x21)))
#: A query value that is itself a URI (``?endpoint_override=https://KEY:SECRET@host``) is
#: checked as one, this many levels deep; deeper nesting is refused rather than parsed.
_MAX_NESTING = 4


def looks_secret(name: str) -> bool:
    """Whether a parameter's or a variable's name says it holds a secret
    (:data:`_SECRET_PARAMETERS`, case-insensitively: ``secret_key``, ``AWS_SESSION_TOKEN``)."""
    key = name.lower()
    return any(secret in key for secret in _SECRET_PARAMETERS)


def _stripped(uri: str) -> str:
    """``uri`` without what a parser skips before its scheme: `` s3://...`` is ``s3://...``."""
    return str(uri).lstrip(_LEADING).lstrip()


def _uri_parts(uri: str) -> tuple[str, str | None, str, str]:
    """``(scheme, user info or None, query, fragment)`` of ``uri``, split by hand: the same
    for a URI urllib refuses (a bad IPv6 host), so that nothing slips past in one."""
    uri = _stripped(uri)
    found = _SCHEME.match(uri)
    scheme = found[1].lower() if found else ""
    rest = uri[found.end() :] if found else uri
    rest, _, fragment = rest.partition("#")
    rest, _, query = rest.partition("?")
    userinfo = None
    if rest.startswith("//"):
        authority = re.split(r"[/\\]", rest[2:], maxsplit=1)[0]
        port = authority.rpartition(":")[2]
        if "@" in authority:
            userinfo = authority.rpartition("@")[0]
        elif ":" in authority and not authority.startswith("[") and not port.isdigit():
            # KEY:SECRET@ where the secret holds a '/' (AWS secrets may): no port follows
            # the ':', an '@' does.
            userinfo = rest[2:].partition("@")[0] if "@" in rest else None
    return scheme, userinfo, query, fragment


def redact_uri(uri: str) -> str:
    """``uri`` as an error message may show it: its user info and its query string (and
    fragment) replaced by ``***``, e.g. ``s3://***@bucket/runs?***``."""
    uri = _stripped(uri)
    _, userinfo, query, fragment = _uri_parts(uri)
    shown = uri.partition("#")[0].partition("?")[0]
    if userinfo is not None:
        head, _, tail = shown.partition("//")
        shown = f"{head}//***@{tail[len(userinfo) + 1 :]}"
    return shown + ("?***" if query else "") + ("#***" if fragment else "")


def uri_credentials(uri: str, _depth: int = 0) -> str | None:
    """What in ``uri`` is a credential ("a password", "a user name", "the query parameter
    'secret_key'"), or None: a local path (no scheme) has none."""
    scheme, userinfo, query, _ = _uri_parts(uri)
    if not scheme:
        return None
    if userinfo is not None:
        if ":" in userinfo:
            return "a password"
        if scheme not in _NAMED_USER_SCHEMES:
            return "a user name or token"
    for name, value in parse_qsl(query, keep_blank_values=True):
        if looks_secret(name):
            return f"the query parameter {name[:40]!r}"
        if _depth >= _MAX_NESTING and ("@" in value or "?" in value):
            return f"the query parameter {name[:40]!r} (URIs nested too deep to check)"
        # pyarrow's endpoint_override (a proxy's, a redirect's) is a URL of its own, with
        # or without a scheme: KEY:SECRET@host is a password either way.
        if _URL.match(_stripped(value)):
            found = uri_credentials(value, _depth + 1)
        else:
            found = "a password" if ":" in (_uri_parts(f"x://{value}")[1] or "") else None
        if found is not None:
            return f"the query parameter {name[:40]!r}, which holds {found}"
    return None


def _credential_hint(flag: str, scheme: str) -> str:
    if flag == "--mlflow-uri":
        return "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN"
    if scheme == "s3":
        return "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
    if scheme in ("gs", "gcs"):
        return "GOOGLE_APPLICATION_CREDENTIALS"
    if scheme in ("abfs", "abfss"):
        return "AZURE_CLIENT_ID, AZURE_TENANT_ID and AZURE_CLIENT_SECRET"
    return "the store's own environment variables or configuration files"


def check_no_credentials(uri: str, flag: str) -> None:
    """Refuse a URI that carries a secret (``s3://KEY:SECRET@bucket``, ``https://token@host``,
    ``?secret_key=...``, ``?endpoint_override=https://KEY:SECRET@host``): flags travel into
    job tables, run records and logs. The message shows the URI redacted (:func:`redact_uri`)."""
    what = uri_credentials(uri)
    if what is not None:
        raise ConfigError(
            f"{flag} {redact_uri(uri)}: the URI carries credentials; pass them through the "
            f"environment instead ({_credential_hint(flag, _uri_parts(str(uri))[0])}); "
            f"it holds {what}"
        )
