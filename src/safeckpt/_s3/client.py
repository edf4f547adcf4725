"""The few S3 requests a root needs, on botocore, with errors as ``OSError``\\ s the core understands.

Every request is retried here (botocore's own retries are off), with exponential
backoff and jitter, on 5xx, ``SlowDown`` and other throttling, timeouts and
dropped connections, until ``max_attempts`` or the ``timeout`` deadline runs
out, whichever comes first; a server that stops answering is then *down* for
every request of this client, which fail at once but for a probe every few
seconds (:mod:`safeckpt._util.reachability`). So an outage costs a public call
about one deadline, never minutes per request. A conditional PUT that is
retried after the server already applied it comes back as 412; the callers
that care (:meth:`Client.put_new`, :meth:`Client.put_over`) then read the object
and accept it if it is what they wrote.

A server's reply is untrusted input: a reply botocore cannot parse, or a
``Date`` that cannot be read, is an error or an unknown, never a raw exception.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import datetime
import errno
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from email.utils import parsedate_to_datetime
from typing import Any

from .._format.checksums import crc32
from .._objstore.client import Got, Head, NotFound, ObjectStoreError, PreconditionFailed, Unreachable
from .._util.reachability import Outcome, Reachability, call_with_deadline
from ..errors import ConfigError
from .location import Location, Settings

logger = logging.getLogger(__name__)

DELETE_BATCH = 1000  # S3's most keys per DeleteObjects
_PROBE_TIMEOUT = 2.0  # a probe's connect and read timeouts, while the server is down


S3Error = ObjectStoreError  # S3's refusals, with its error code (the generic class, by its old name)


def crc32_header(data: bytes | memoryview) -> str:
    """The value of ``x-amz-checksum-crc32`` for ``data``: the server refuses a body that differs."""
    return base64.b64encode(crc32(data).to_bytes(4, "big")).decode()


_loader: Any = None
_loader_lock = threading.Lock()


def _botocore_session() -> Any:
    """A new botocore session (credentials and settings are read afresh for each client) that
    shares one loader of botocore's service models: parsing them is most of a client's cost."""
    global _loader
    import botocore.loaders
    import botocore.session

    with _loader_lock:
        if _loader is None:
            _loader = botocore.loaders.create_loader()
    session = botocore.session.get_session()
    session.register_component("data_loader", _loader)
    return session


class S3Client:
    """One bucket's requests, the :class:`~safeckpt._objstore.client.ObjectClient` of S3
    (thread-safe: botocore's clients are)."""

    def __init__(self, location: Location, settings: Settings) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as e:  # pragma: no cover - the extra is missing
            raise ConfigError("s3:// roots need boto3: pip install 'safeckpt[s3]'.", path=location.url) from e
        config = Config(
            retries={"mode": "standard", "total_max_attempts": 1},  # retried here, within a deadline
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
            max_pool_connections=max(16, 4 * settings.max_concurrency),
            # Checksums are sent by us where we have them (CRC32, computed once as the bytes go out).
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.bucket = location.bucket
        self.location = location
        self._settings = settings
        self._prober: Any = None  # the client of the probes, made at the first one
        self._attempts = settings.max_attempts
        self._deadline = settings.timeout
        self.reach = Reachability()
        self.lists_uploads = True  # False once the server said it does not (501): see uploads()
        self._session = boto3.session.Session(botocore_session=_botocore_session())
        self._s3 = self._session.client("s3", config=config, **dict(settings.client))
        self.endpoint = str(self._s3.meta.endpoint_url)

    # --- objects ----------------------------------------------------------------------------------

    def put(
        self,
        key: str,
        data: bytes,
        *,
        create_only: bool = False,
        replacing: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> str:
        """PUT ``data`` at ``key`` with its CRC32 (the server checks it); the new ETag.
        ``create_only``: ``If-None-Match: *``; ``replacing``: ``If-Match`` on that ETag."""
        args: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": key,
            "Body": data,
            "ChecksumCRC32": crc32_header(data),
        }
        if create_only:
            args["IfNoneMatch"] = "*"
        if replacing is not None:
            args["IfMatch"] = replacing
        if metadata:
            args["Metadata"] = dict(metadata)
        return str(self._call("put_object", key, **args)["ETag"])

    def get(self, key: str, *, start: int | None = None, length: int | None = None) -> Got:
        """The object at ``key``, or ``length`` bytes of it from ``start``."""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if start is not None:
            if length == 0:
                return Got(b"", "", self.head(key).size)
            end = "" if length is None else str(start + length - 1)
            args["Range"] = f"bytes={start}-{end}"

        def attempt() -> tuple[dict[str, Any], bytes]:
            reply = self._s3.get_object(**args)
            body = reply["Body"]
            try:  # a body cut mid-way is retried with its request
                return reply, body.read()
            finally:
                body.close()

        reply, data = self._retrying(key, attempt)
        size = int(reply.get("ContentRange", "/").rpartition("/")[2] or reply["ContentLength"])
        date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        age = _age(reply.get("LastModified"), date)
        return Got(data, str(reply["ETag"]), size, reply.get("Metadata") or {}, age)

    def head(self, key: str) -> Head:
        reply = self._call("head_object", key, Bucket=self.bucket, Key=key)
        return Head(int(reply["ContentLength"]), str(reply["ETag"]), reply.get("Metadata") or {})

    def delete(self, key: str) -> None:
        """DELETE ``key`` (S3 answers a missing key with success too)."""
        self._call("delete_object", key, Bucket=self.bucket, Key=key)

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` in batches of 1,000; a key the server failed to delete raises."""
        batch: list[str] = []
        for key in keys:
            batch.append(key)
            if len(batch) == DELETE_BATCH:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def _delete_batch(self, keys: list[str]) -> None:
        if len(keys) == 1:
            self.delete(keys[0])
            return
        objects = [{"Key": k} for k in keys]
        reply = self._call(
            "delete_objects", keys[0], Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}
        )
        errors = reply.get("Errors") or []
        if errors:
            first = errors[0]
            raise S3Error(
                first.get("Code", "DeleteFailed"), 500, first.get("Message", ""), first.get("Key", "")
            )

    def list(
        self, prefix: str, *, delimiter: str | None = "/", limit: int | None = None
    ) -> tuple[list[tuple[str, int]], list[str]]:
        """Objects ``(key, size)`` and sub-prefixes under ``prefix`` (everything below it when
        ``delimiter`` is None); the first page of at most ``limit`` only, when given."""
        objects: list[tuple[str, int]] = []
        prefixes: list[str] = []
        args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            args["Delimiter"] = delimiter
        if limit is not None:
            args["MaxKeys"] = limit
        while True:
            page = self._call("list_objects_v2", prefix, **args)
            objects.extend((o["Key"], int(o["Size"])) for o in page.get("Contents") or ())
            prefixes.extend(p["Prefix"] for p in page.get("CommonPrefixes") or ())
            token = page.get("NextContinuationToken")
            if limit is not None or not page.get("IsTruncated") or not token:
                return objects, prefixes
            args["ContinuationToken"] = token

    # --- multipart ------------------------------------------------------------------------------

    def start_upload(self, key: str) -> str:
        reply = self._call(
            "create_multipart_upload", key, Bucket=self.bucket, Key=key, ChecksumAlgorithm="CRC32"
        )
        return str(reply["UploadId"])

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | memoryview) -> dict[str, Any]:
        """One part, with its CRC32 (a part corrupted on the way is refused by the server)."""
        checksum = crc32_header(data)
        reply = self._call(
            "upload_part",
            key,
            Bucket=self.bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=bytes(data),
            ChecksumAlgorithm="CRC32",
            ChecksumCRC32=checksum,
        )
        return {"PartNumber": number, "ETag": reply["ETag"], "ChecksumCRC32": checksum}

    # builtins.list: below the method list(), the name `list` in this class is that method
    def finish_upload(self, key: str, upload_id: str, parts: builtins.list[dict[str, Any]]) -> str:
        reply = self._call(
            "complete_multipart_upload",
            key,
            Bucket=self.bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
        )
        return str(reply["ETag"])

    def abort_upload(self, key: str, upload_id: str) -> None:
        with contextlib.suppress(NotFound):  # completed or aborted already
            self._call("abort_multipart_upload", key, Bucket=self.bucket, Key=key, UploadId=upload_id)

    def uploads(self, prefix: str) -> builtins.list[tuple[str, str]]:
        """Unfinished multipart uploads under ``prefix``: ``(key, upload id)``.

        A server that does not implement the listing (501, as some S3-compatible servers answer)
        has none to show: said once, and the uploads a killed save left there stay until the
        bucket's lifecycle rule for incomplete uploads removes them (docs/object-storage.md).
        """
        if not self.lists_uploads:
            return []
        found: list[tuple[str, str]] = []
        args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        while True:
            try:
                page = self._call("list_multipart_uploads", prefix, **args)
            except S3Error as e:
                if e.status != 501 and e.code not in ("NotImplemented", "NotImplementedError"):
                    raise
                self.lists_uploads = False
                logger.warning(
                    "safeckpt: %s does not list unfinished multipart uploads (%s); those a killed save "
                    "leaves are not collected by safeckpt: give the bucket a lifecycle rule that aborts "
                    "incomplete multipart uploads",
                    self.endpoint,
                    e.code,
                )
                return []
            found.extend((u["Key"], u["UploadId"]) for u in page.get("Uploads") or ())
            if not page.get("IsTruncated"):
                return found
            args["KeyMarker"] = page.get("NextKeyMarker", "")
            args["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    def upload_size(self, key: str, upload_id: str) -> int:
        """Bytes in the parts of the unfinished upload ``upload_id`` of ``key`` (0 once it is gone)."""
        size = 0
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": key, "UploadId": upload_id}
        while True:
            try:
                page = self._call("list_parts", key, **args)
            except NotFound:  # completed or aborted meanwhile
                return 0
            size += sum(int(part.get("Size", 0)) for part in page.get("Parts") or ())
            if not page.get("IsTruncated"):
                return size
            args["PartNumberMarker"] = page.get("NextPartNumberMarker", 0)

    def explain(self, error: OSError) -> tuple[str, str]:
        from .errors import explain_error

        return explain_error(self.location, error)

    # --- plumbing ---------------------------------------------------------------------------------

    def _call(self, operation: str, key: str, **args: Any) -> dict[str, Any]:
        method = getattr(self._s3, operation)
        return self._retrying(key, lambda: method(**args))

    def _probe(self) -> None:
        """One cheap request (HEAD of the bucket) with short timeouts: any reply, even a refusal,
        shows the server answers (see safeckpt._util.reachability)."""
        if self._prober is None:
            from botocore.config import Config

            config = Config(
                retries={"mode": "standard", "total_max_attempts": 1},
                connect_timeout=min(_PROBE_TIMEOUT, self._settings.connect_timeout),
                read_timeout=min(_PROBE_TIMEOUT, self._settings.read_timeout),
            )
            self._prober = self._session.client("s3", config=config, **dict(self._settings.client))
        self._prober.head_bucket(Bucket=self.bucket)

    def _retrying(self, key: str, attempt: Callable[[], Any]) -> Any:
        """``attempt()`` with the retries and deadline of the module doc; errors as ``OSError``."""

        def unreachable(error: BaseException, down: float) -> Unreachable:
            cause = _as_os_error(error, key) if isinstance(error, Exception) else error
            if getattr(cause, "status", 0):
                how = f"kept failing ({cause.code}, {cause.status})"  # type: ignore[attr-defined]
            else:
                how = f"does not answer ({getattr(cause, 'code', '') or type(error).__name__})"
            return Unreachable("Unreachable", 0, f"{self.endpoint} {how}, for {down:.0f} s so far", key)

        try:
            return call_with_deadline(
                attempt,
                _classify,
                self.reach,
                attempts=self._attempts,
                deadline=self._deadline,
                unreachable=unreachable,
                probe=self._probe,
            )
        except Unreachable:
            raise
        except Exception as e:
            raise _as_os_error(e, key) from e


_RETRIED_CODES = frozenset(
    (
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    )
)


def _classify(error: BaseException) -> Outcome:
    from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, HTTPClientError

    if isinstance(error, ClientError):
        info = error.response.get("Error") or {}
        status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if status == 501:
            return Outcome.ANSWERED
        if status >= 500 or status == 429 or str(info.get("Code", "")) in _RETRIED_CODES:
            return Outcome.RETRY
        return Outcome.ANSWERED
    if isinstance(error, (ConnectionError, HTTPClientError)):
        return Outcome.SILENT  # refused, reset, timed out, or a body cut short
    if isinstance(error, BotoCoreError):
        return Outcome.DONE  # no credentials, a bad parameter: trying again changes nothing
    if isinstance(error, (OSError, ValueError)) and not isinstance(error, FileNotFoundError):
        return Outcome.SILENT  # a body read that failed below botocore (urllib3, ssl)
    return Outcome.DONE


def _age(last_modified: Any, date_header: Any) -> float | None:
    """Seconds between ``Last-Modified`` and the reply's ``Date``, both the server's; None where
    either cannot be read (absent, unparseable, or several ``Date`` headers that disagree)."""
    if not isinstance(last_modified, datetime.datetime) or not isinstance(date_header, str):
        return None
    dates = set()
    for part in _split_dates(date_header):
        try:
            parsed = parsedate_to_datetime(part)
        except (TypeError, ValueError, IndexError):
            return None
        dates.add(parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.timezone.utc))  # -0000
    if len(dates) != 1:
        return None
    modified = last_modified if last_modified.tzinfo else last_modified.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, (dates.pop() - modified).total_seconds())


def _split_dates(header: str) -> list[str]:
    """A ``Date`` header, or several joined with ``", "`` (HTTP's rule for a repeated header): each
    HTTP date has one comma of its own, after the weekday."""
    pieces = [p.strip() for p in header.split(",")]
    if len(pieces) % 2:
        return [header]
    return [f"{pieces[i]}, {pieces[i + 1]}" for i in range(0, len(pieces), 2)]


def _as_os_error(error: Exception, key: str) -> Exception:
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(error, ClientError):
        info = error.response.get("Error") or {}
        code = str(info.get("Code", ""))
        status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
            return PreconditionFailed(key)
        if code in ("NoSuchKey", "NoSuchUpload", "404", "NotFound") or (
            status == 404 and code != "NoSuchBucket"
        ):
            return NotFound(errno.ENOENT, "no such object", key)
        return S3Error(code or "Error", status, str(info.get("Message", error)), key)
    from botocore.exceptions import ConnectionError as NoConnection
    from botocore.exceptions import HTTPClientError, NoCredentialsError, PartialCredentialsError

    if isinstance(error, (NoConnection, HTTPClientError)):  # no connection, a timeout
        return S3Error(type(error).__name__, 0, str(error), key)
    if isinstance(error, (NoCredentialsError, PartialCredentialsError)):
        return S3Error("NoCredentials", 401, str(error), key)
    if isinstance(error, BotoCoreError):  # a request this side could not make (a bad parameter)
        return S3Error(type(error).__name__, 400, str(error), key)
    if isinstance(error, OSError):
        return error
    # Anything else is a reply botocore could not make sense of (a bad date, a broken XML body):
    # the server's fault, said as such (not available, never a checkpoint's damage), never a raw
    # TypeError from deep inside the client.
    return Unreachable(
        "InvalidResponse", 0, f"the server's reply could not be read ({type(error).__name__}: {error})", key
    )
