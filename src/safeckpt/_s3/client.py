"""The few S3 requests a root needs, on botocore, with errors as ``OSError``\\ s the core understands.

Every request is retried by botocore's ``standard`` mode: exponential backoff
with jitter on 5xx, ``SlowDown`` and other throttling, timeouts and dropped
connections, at most ``max_attempts`` times, each bounded by the connect and
read timeouts, so a request gives up in bounded time. A conditional PUT that
is retried after the server already applied it comes back as 412; the callers
that care (:meth:`Client.put_new`, :meth:`Client.put_over`) then read the object
and accept it if it is what they wrote.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import random
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

from .._format.checksums import crc32
from ..errors import ConfigError
from .location import Location, Settings

DELETE_BATCH = 1000  # S3's most keys per DeleteObjects


class NotFound(FileNotFoundError):
    """No object (or no bucket) at that key."""


class PreconditionFailed(OSError):
    """A conditional write lost: the object exists (``If-None-Match: *``) or changed (``If-Match``)."""

    def __init__(self, key: str) -> None:
        super().__init__(errno.EEXIST, "the object exists or changed since it was read", key)
        self.key = key

    def __reduce__(self) -> tuple[object, ...]:  # errors cross ranks pickled
        return (PreconditionFailed, (self.key,))


class S3Error(OSError):
    """Any other refusal, with S3's error code (``AccessDenied``, ``SlowDown``, ...)."""

    def __init__(self, code: str, status: int, message: str, key: str) -> None:
        number = errno.EACCES if status == 403 else errno.EIO
        super().__init__(number, f"{code} ({status}): {message}", key)
        self.code = code
        self.status = status
        self._args = (code, status, message, key)

    def __reduce__(self) -> tuple[object, ...]:  # errors cross ranks pickled
        return (S3Error, self._args)


@dataclass(frozen=True)
class Head:
    size: int
    etag: str
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Got:
    data: bytes
    etag: str
    size: int
    """The whole object's size (a ranged GET returns part of it)."""
    metadata: Mapping[str, str] = field(default_factory=dict)
    age: float = 0.0
    """Seconds since it was written, by the server's clock (``Date`` against ``Last-Modified``)."""


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


class Client:
    """One bucket's requests (thread-safe: botocore's clients are)."""

    def __init__(self, location: Location, settings: Settings) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as e:  # pragma: no cover - the extra is missing
            raise ConfigError("s3:// roots need boto3: pip install 'safeckpt[s3]'.", path=location.url) from e
        config = Config(
            retries={"mode": "standard", "total_max_attempts": settings.max_attempts},  # not retries
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
            max_pool_connections=max(16, 4 * settings.max_concurrency),
            # Checksums are sent by us where we have them (CRC32, computed once as the bytes go out).
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.bucket = location.bucket
        self._attempts = settings.max_attempts
        self._s3 = boto3.session.Session(botocore_session=_botocore_session()).client(
            "s3", config=config, **dict(settings.client)
        )
        self.endpoint = str(self._s3.meta.endpoint_url)

    # --- objects ----------------------------------------------------------------------------------

    def put(
        self,
        key: str,
        data: bytes,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> str:
        """PUT ``data`` at ``key`` with its CRC32 (the server checks it); the new ETag."""
        args: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": key,
            "Body": data,
            "ChecksumCRC32": crc32_header(data),
        }
        if if_none_match:
            args["IfNoneMatch"] = "*"
        if if_match is not None:
            args["IfMatch"] = if_match
        if metadata:
            args["Metadata"] = dict(metadata)
        return str(self._call("put_object", key, **args)["ETag"])

    def put_new(self, key: str, data: bytes, *, metadata: Mapping[str, str] | None = None) -> str:
        """PUT only if nothing is at ``key`` (``If-None-Match: *``); :class:`PreconditionFailed` if
        something else is. Our own earlier attempt, applied before a retry, counts as success."""
        try:
            return self.put(key, data, if_none_match=True, metadata=metadata)
        except PreconditionFailed:
            return self._ours_or_raise(key, data, metadata)

    def put_over(self, key: str, data: bytes, etag: str, *, metadata: Mapping[str, str] | None = None) -> str:
        """PUT only if ``key`` still has ``etag`` (``If-Match``), with the same retry rule."""
        try:
            return self.put(key, data, if_match=etag, metadata=metadata)
        except PreconditionFailed:
            return self._ours_or_raise(key, data, metadata)

    def _ours_or_raise(self, key: str, data: bytes, metadata: Mapping[str, str] | None) -> str:
        try:
            there = self.get(key)
        except NotFound:
            raise PreconditionFailed(key) from None
        if there.data == data and dict(there.metadata) == dict(metadata or {}):
            return there.etag
        raise PreconditionFailed(key)

    def get(self, key: str, *, start: int | None = None, length: int | None = None) -> Got:
        """The object at ``key``, or ``length`` bytes of it from ``start``."""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if start is not None:
            if length == 0:
                return Got(b"", "", self.head(key).size)
            end = "" if length is None else str(start + length - 1)
            args["Range"] = f"bytes={start}-{end}"
        for attempt in range(self._attempts):
            reply = self._call("get_object", key, **args)
            body = reply["Body"]
            try:
                data = body.read()
                break
            except Exception as e:  # a body cut mid-way: botocore retries the request, not its body
                if attempt + 1 == self._attempts:
                    raise S3Error("ReadError", 0, f"{type(e).__name__}: {e}", key) from e
                time.sleep(min(1.0, 0.05 * 2**attempt) * (0.5 + random.random()))
            finally:
                body.close()
        size = int(reply.get("ContentRange", "/").rpartition("/")[2] or reply["ContentLength"])
        date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        age = _age(reply.get("LastModified"), date)
        return Got(data, str(reply["ETag"]), size, reply.get("Metadata") or {}, age)

    def head(self, key: str) -> Head:
        reply = self._call("head_object", key, Bucket=self.bucket, Key=key)
        return Head(int(reply["ContentLength"]), str(reply["ETag"]), reply.get("Metadata") or {})

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        """DELETE ``key`` (only if it still has ``if_match``, where the server supports that)."""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if if_match is not None:
            args["IfMatch"] = if_match
        self._call("delete_object", key, **args)

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
        if limit is not None:
            args = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": limit}
            if delimiter:
                args["Delimiter"] = delimiter
            page = self._call("list_objects_v2", prefix, **args)
            objects.extend((o["Key"], int(o["Size"])) for o in page.get("Contents") or ())
            prefixes.extend(p["Prefix"] for p in page.get("CommonPrefixes") or ())
            return objects, prefixes
        for page in self._pages("list_objects_v2", prefix, Prefix=prefix, Delimiter=delimiter):
            objects.extend((o["Key"], int(o["Size"])) for o in page.get("Contents") or ())
            prefixes.extend(p["Prefix"] for p in page.get("CommonPrefixes") or ())
        return objects, prefixes

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

    def finish_upload(self, key: str, upload_id: str, parts: list[dict[str, Any]]) -> str:
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

    def uploads(self, prefix: str) -> list[tuple[str, str]]:
        """Unfinished multipart uploads under ``prefix``: ``(key, upload id)``."""
        found = []
        for page in self._pages("list_multipart_uploads", prefix, Prefix=prefix):
            found.extend((u["Key"], u["UploadId"]) for u in page.get("Uploads") or ())
        return found

    def upload_size(self, key: str, upload_id: str) -> int:
        """Bytes in the parts of the unfinished upload ``upload_id`` of ``key`` (0 once it is gone)."""
        try:
            pages = list(self._pages("list_parts", key, Key=key, UploadId=upload_id))
        except NotFound:  # completed or aborted meanwhile
            return 0
        return sum(int(part.get("Size", 0)) for page in pages for part in page.get("Parts") or ())

    # --- plumbing ---------------------------------------------------------------------------------

    def _pages(self, operation: str, key: str, **args: Any) -> Iterator[dict[str, Any]]:
        args = {k: v for k, v in args.items() if v is not None}
        paginator = self._s3.get_paginator(operation)
        try:
            yield from paginator.paginate(Bucket=self.bucket, **args)
        except Exception as e:
            raise _as_os_error(e, key) from e

    def _call(self, operation: str, key: str, **args: Any) -> dict[str, Any]:
        try:
            return getattr(self._s3, operation)(**args)
        except Exception as e:
            raise _as_os_error(e, key) from e


def _age(last_modified: Any, date_header: str | None) -> float:
    if last_modified is None or not date_header:
        return 0.0
    return max(0.0, (parsedate_to_datetime(date_header) - last_modified).total_seconds())


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
    if isinstance(error, BotoCoreError):  # no connection, a timeout, after every retry
        return S3Error(type(error).__name__, 0, str(error), key)
    return error
