"""One object on a store, read with its version and, where the store can, written only over
the version last read: the compare-and-swap that the lease of :mod:`.claim` renews with.

S3 has conditional writes: a ``PutObject`` with ``If-None-Match: *`` lands only where no
object is, one with ``If-Match: ETAG`` only over that version; otherwise the store answers
412 and keeps what is there. pyarrow's file systems have no conditional put, so on
``s3://`` the object goes through boto3 (the ``s3`` extra), with the endpoint, region and
credentials pyarrow uses (the standard AWS environment; the region pyarrow resolved for the
bucket). Every other store (``gs://``, any other pyarrow file system, an ``s3://`` URI that
carries pyarrow options in its query, or no boto3 installed) is written unconditionally:
:class:`FileObject`, and the claim keeps its read-back there.
"""

from __future__ import annotations

import contextlib
import logging

from raytrain_mnist.driver.runs.storage import MAX_RECORD_BYTES, RunStorage

logger = logging.getLogger(__name__)

#: ``expect`` of a write that must find no object there (``If-None-Match: *``).
ABSENT = "*"


class Conflict(Exception):
    """The store refused a conditional write: the object there (if any) is not the version
    the write expected. Not an :class:`OSError`: it is an answer, never retried."""


class FileObject:
    """Through a pyarrow file system: no conditional writes, no versions (``None``)."""

    conditional = False

    def __init__(self, fs, path: str) -> None:
        self.fs, self.path = fs, path

    def read(self) -> tuple[bytes, str | None] | None:
        """The object's bytes (no more than a record holds and one byte: a bigger object
        reads as one that is not a record) and version; None only when the store says
        there is none."""
        try:
            with self.fs.open_input_stream(self.path) as f:
                return f.read(MAX_RECORD_BYTES + 1), None
        except FileNotFoundError:
            return None

    def write(self, payload: bytes, expect: str | None) -> str | None:
        """Written whatever is there (``expect`` cannot be checked here)."""
        with self.fs.open_output_stream(self.path) as f:
            f.write(payload)
        return None

    def delete(self, expect: str | None) -> None:
        self.fs.delete_file(self.path)


class S3Object:
    """Through a boto3 client, with conditional writes. The store's errors other than a
    refused condition are :class:`OSError` (one line: code and message), as pyarrow's are,
    so that callers retry them the same way."""

    conditional = True

    def __init__(self, client, bucket: str, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        self.client, self.bucket, self.key = client, bucket, key
        #: What the store or the connection raise (a body cut off is a BotoCoreError).
        self._errors = (ClientError, BotoCoreError, OSError)

    def read(self) -> tuple[bytes, str | None] | None:
        """The object's bytes (at most a record's and one, as :meth:`FileObject.read`) and
        ETag; None only when the store says there is none."""
        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self.key)
            with contextlib.closing(answer["Body"]) as body:
                return body.read(MAX_RECORD_BYTES + 1), answer["ETag"]
        except self._errors as exc:
            if _status(exc) == 404:
                return None
            raise _os_error(exc) from exc

    def write(self, payload: bytes, expect: str | None) -> str | None:
        """Written only where the object is the version ``expect`` (:data:`ABSENT`: none is
        there; None: whatever is); its new ETag. :class:`Conflict` when the store refuses:
        412, or 404 for an ``If-Match`` whose object is gone."""
        condition = {"IfNoneMatch": "*"} if expect == ABSENT else {"IfMatch": expect}
        try:
            return self.client.put_object(
                Bucket=self.bucket, Key=self.key, Body=payload, **(condition if expect else {})
            )["ETag"]
        except self._errors as exc:
            if _status(exc) == 412 or (expect and _status(exc) == 404):
                raise Conflict(_code(exc)) from exc
            raise _os_error(exc) from exc  # 409 ConditionalRequestConflict too: retried

    def ignores_conditions(self, payload: bytes) -> bool:
        """Whether the store applies writes it must refuse while the object is there: one
        with ``If-None-Match: *``, one with ``If-Match`` on a version that never was (an
        S3-compatible store may ignore either header). What it applies is ``payload``."""
        for expect in (ABSENT, '"00000000000000000000000000000000"'):
            try:
                self.write(payload, expect)
            except Conflict:
                continue
            return True
        return False

    def delete(self, expect: str | None) -> None:
        """Deleted only while it is the version ``expect`` (None: whatever is there);
        :class:`Conflict` otherwise. A store that answers the conditional delete with
        anything but 412 or 404 (one without conditional deletes may say 501 or 400) gets a
        plain one, as before conditions: the caller has just read the object as its own."""
        if expect is not None:
            try:
                self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=expect)
                return
            except self._errors as exc:
                if _status(exc) == 412:
                    raise Conflict(_code(exc)) from exc
                if _status(exc) == 404:
                    return
                logger.debug("conditional delete of %s refused (%s)", self.key, _os_error(exc))
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key)
        except self._errors as exc:
            if _status(exc) != 404:
                raise _os_error(exc) from exc


def _status(exc: Exception) -> int | None:
    """The HTTP status of a store's answer (botocore's ``ClientError``), None for others."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _code(exc: Exception) -> str:
    error = getattr(exc, "response", {}).get("Error", {})
    return f"{error.get('Code', 'error')}: {error.get('Message', '')}".rstrip(": ")


def _os_error(exc: Exception) -> OSError:
    """An error of the store or of the connection as an :class:`OSError` of one line."""
    if isinstance(exc, OSError):
        return exc
    if _status(exc) is not None:
        return OSError(f"{_code(exc)} (HTTP {_status(exc)})")
    return OSError(f"{type(exc).__name__}: {exc}")


_warned: set[str] = set()


def open_object(files: RunStorage, path: str) -> FileObject | S3Object:
    """The object ``path`` (a path in ``files.filesystem``), conditional where it can be."""
    root = files.root.lower()
    if not root.startswith("s3://") or "?" in root:
        return FileObject(files.filesystem, path)
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        if "boto3" not in _warned:
            _warned.add("boto3")
            logger.warning(
                "boto3 is not installed: the lease on %s is written without a conditional "
                "write, and two commands may both hold a run for a moment (pip install "
                "'raytrain-mnist[s3]')",
                files.root,
            )
        return FileObject(files.filesystem, path)
    config = Config(
        connect_timeout=5,
        read_timeout=10,
        retries={"mode": "standard", "max_attempts": 3},
        # Checksums only where the operation requires one, as before botocore 1.36: S3-
        # compatible stores (older MinIO, Ceph) refuse the trailing CRC otherwise.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    region = getattr(files.filesystem, "region", None) or None
    client = boto3.session.Session().client("s3", region_name=region, config=config)
    bucket, _, key = path.partition("/")
    return S3Object(client, bucket, key)
