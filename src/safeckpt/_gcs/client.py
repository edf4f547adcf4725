"""The few GCS requests a root needs (its JSON API, over urllib3), as the object client protocol.

* The token of a conditional write is the object's *generation*: create-only is
  ``ifGenerationMatch=0``, replace-if-unchanged ``ifGenerationMatch=<generation>``; a lost
  one is 412. Small objects (the record, ``latest``, the lease) are one multipart request
  carrying their MD5, which the service checks.
* A large object is a *resumable upload*: its chunks go in order (GCS takes no other), each a
  multiple of 256 KiB but the last, and the MD5 of the whole goes with the request that
  finishes it, so a body changed on the way is refused. GCS's XML multipart upload (parallel
  parts) takes no precondition and completing one overwrites; data objects go to unique names
  anyway, but the emulators lack it, and one stream per object is what the JSON API offers.
  An unfinished resumable upload is no object, lists nowhere, and expires after a week:
  nothing to collect (:meth:`GcsClient.uploads` has none).
* A whole-object GET reads the object's metadata, then its bytes on that generation (the
  JSON API's media download has no user metadata), so the two are of one version.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import datetime
import errno
import hashlib
import json
import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

from .._objstore.client import Got, Head, NotFound, ObjectStoreError, PreconditionFailed
from .._objstore.http import Http, Reply, content_size
from .location import CHUNK, Location, Settings, credentials

_TRIES_OF_A_CONSISTENT_READ = 5


def md5_b64(data: bytes | memoryview) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def _code(reply: Reply) -> str:
    """The error's reason from GCS's JSON error body (``notFound``, ``conditionNotMet``, ...)."""
    try:
        error = json.loads(reply.body or b"{}").get("error") or {}
    except (ValueError, AttributeError):
        return f"HTTP{reply.status}"
    if not isinstance(error, dict):
        return f"HTTP{reply.status}"
    message = str(error.get("message", ""))
    if reply.status == 404 and "bucket" in message.lower():
        return "NoSuchBucket"
    reasons = error.get("errors") or [{}]
    reason = reasons[0].get("reason", "") if isinstance(reasons[0], dict) else ""
    return str(reason or message or f"HTTP{reply.status}").replace(" ", "")


@dataclass
class _Upload:
    """A resumable upload of this process: where its chunks go and what went."""

    key: str
    session: str
    offset: int = 0
    md5: Any = field(default_factory=hashlib.md5)
    next: int = 1
    tail: bytes = b""
    failed: bool = False
    turn: threading.Condition = field(default_factory=threading.Condition)


class GcsClient:
    """One bucket's requests, the :class:`~safeckpt._objstore.client.ObjectClient` of GCS."""

    def __init__(self, location: Location, settings: Settings) -> None:
        self.location = location
        self.bucket = location.bucket
        self.endpoint = settings.endpoint
        self.settings = settings
        self._credentials = credentials(settings, location.url)
        self._auth_lock = threading.Lock()
        self._auth_request: Any = None
        self._http = Http(settings.endpoint, settings.limits, explain_code=_code)
        self.reach = self._http.reach
        self._objects = f"{self.endpoint}/storage/v1/b/{quote(self.bucket, safe='')}/o"
        self._uploads_url = f"{self.endpoint}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"
        self._uploads: dict[str, _Upload] = {}
        self._guard = threading.Lock()

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
        """One multipart request: the object's metadata (with its MD5, which GCS checks) and bytes."""
        query: dict[str, str] = {"uploadType": "multipart"}
        if create_only:
            query["ifGenerationMatch"] = "0"
        if replacing is not None:
            if not replacing.isdigit():  # not a generation: nothing there can have it
                raise PreconditionFailed(key)
            query["ifGenerationMatch"] = replacing
        resource: dict[str, Any] = {"name": key, "md5Hash": md5_b64(data)}
        if metadata:
            resource["metadata"] = dict(metadata)
        boundary = uuid.uuid4().hex
        body = b"".join(
            (
                f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
                json.dumps(resource).encode(),
                f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
                bytes(data),
                f"\r\n--{boundary}--\r\n".encode(),
            )
        )
        headers = {"Content-Type": f"multipart/related; boundary={boundary}"}
        reply = self._request(
            "POST", f"{self._uploads_url}?{urlencode(query)}", key, body=body, headers=headers
        )
        if reply.status == 412:
            raise PreconditionFailed(key)
        self._bucket_there(reply, key)
        return self._generation(self._http.ok(reply, key), key)

    def get(self, key: str, *, start: int | None = None, length: int | None = None) -> Got:
        if start is None:
            return self._whole(key)
        if length == 0:
            head = self.head(key)
            return Got(b"", head.token, head.size)
        end = "" if length is None else str(start + length - 1)
        reply = self._request("GET", self._media(key), key, headers={"Range": f"bytes={start}-{end}"})
        if reply.status == 416:
            raise ObjectStoreError("InvalidRange", 416, "the range starts past the object's end", key)
        self._http.ok(reply, key)
        token = reply.headers.get("x-goog-generation", "")
        return Got(reply.body, token, content_size(reply), {}, None)

    def _whole(self, key: str) -> Got:
        """The metadata, then the bytes of that generation (the bytes of a newer one: read again)."""
        for _ in range(_TRIES_OF_A_CONSISTENT_READ):
            reply = self._request("GET", self._object(key), key)
            resource = self._json(self._http.ok(reply, key), key)
            generation = str(resource.get("generation", ""))
            media = self._request("GET", self._media(key, ifGenerationMatch=generation), key)
            if media.status in (412, 404):  # replaced or removed between the two requests
                continue
            self._http.ok(media, key)
            return Got(
                media.body,
                generation,
                len(media.body),
                dict(resource.get("metadata") or {}),
                _age(resource.get("updated"), reply.headers.get("date")),
            )
        raise ObjectStoreError("Changing", 409, "the object kept changing while it was read", key)

    def head(self, key: str) -> Head:
        resource = self._json(self._http.ok(self._request("GET", self._object(key), key), key), key)
        return Head(
            int(resource.get("size", 0)), str(resource.get("generation", "")), resource.get("metadata") or {}
        )

    def delete(self, key: str) -> None:
        reply = self._request("DELETE", self._object(key), key)
        if reply.status != 404:
            self._http.ok(reply, key)

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.delete(key)

    def list(
        self, prefix: str, *, delimiter: str | None = "/", limit: int | None = None
    ) -> tuple[list[tuple[str, int]], list[str]]:
        objects: list[tuple[str, int]] = []
        prefixes: list[str] = []
        query: dict[str, str] = {"prefix": prefix}
        if delimiter:
            query["delimiter"] = delimiter
        if limit is not None:
            query["maxResults"] = str(limit)
        while True:
            reply = self._request("GET", f"{self._objects}?{urlencode(query)}", prefix)
            self._bucket_there(reply, prefix)
            page = self._json(self._http.ok(reply, prefix), prefix)
            objects.extend((o["name"], int(o.get("size", 0))) for o in page.get("items") or ())
            prefixes.extend(page.get("prefixes") or ())
            token = page.get("nextPageToken")
            if limit is not None or not token:
                return objects, prefixes
            query["pageToken"] = token

    # --- resumable uploads ---------------------------------------------------------------------

    def start_upload(self, key: str) -> str:
        query = urlencode({"uploadType": "resumable", "name": key, "ifGenerationMatch": "0"})
        reply = self._request(
            "POST",
            f"{self._uploads_url}?{query}",
            key,
            body=json.dumps({"name": key}).encode(),
            headers={"Content-Type": "application/json; charset=UTF-8"},
        )
        if reply.status == 412:
            raise PreconditionFailed(key)
        self._bucket_there(reply, key)
        session = self._http.ok(reply, key).headers.get("location", "")
        if not session:
            raise ObjectStoreError("NoSession", reply.status, "no resumable upload session was given", key)
        with self._guard:
            self._uploads[session] = _Upload(key, session)
        return session

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | memoryview) -> Any:
        """Chunk ``number``, after every chunk before it (GCS takes them in order). A chunk that is
        not a multiple of 256 KiB is the last: it goes with the request that finishes the upload."""
        upload = self._upload(key, upload_id)
        with upload.turn:
            upload.turn.wait_for(lambda: upload.next == number or upload.failed)
            if upload.failed:
                raise ObjectStoreError("UploadFailed", 0, "an earlier chunk of this upload failed", key)
            try:
                if len(data) % CHUNK:
                    upload.tail = bytes(data)
                else:
                    self._send_chunk(upload, bytes(data))
            except BaseException:
                upload.failed = True
                raise
            finally:
                upload.next += 1 if not upload.failed else 0
                upload.turn.notify_all()
        return number

    def _send_chunk(self, upload: _Upload, data: bytes) -> None:
        start, sent = upload.offset, 0
        while sent < len(data):
            first, last = start + sent, start + len(data) - 1
            reply = self._request(
                "PUT",
                upload.session,
                upload.key,
                body=memoryview(data)[sent:],
                headers={"Content-Range": f"bytes {first}-{last}/*"},
            )
            if reply.status != 308:
                raise self._http.refusal(reply, upload.key)
            persisted = reply.headers.get("range", "").rpartition("-")[2]
            # What the service kept (a chunk is sometimes kept in part): the rest goes again.
            sent = int(persisted) + 1 - start if persisted.isdigit() else len(data)
        upload.md5.update(data)
        upload.offset += len(data)

    def finish_upload(self, key: str, upload_id: str, parts: builtins.list[Any]) -> str:
        upload = self._upload(key, upload_id)
        tail = upload.tail
        total = upload.offset + len(tail)
        upload.md5.update(tail)
        digest = base64.b64encode(upload.md5.digest()).decode()
        span = f"bytes {upload.offset}-{total - 1}/{total}" if tail else f"bytes */{total}"
        reply = self._request(
            "PUT",
            upload.session,
            key,
            body=tail,
            headers={"Content-Range": span, "X-Goog-Hash": f"md5={digest}"},
        )
        with self._guard:
            self._uploads.pop(upload_id, None)
        if reply.status in (200, 201):
            return self._generation(reply, key)
        if reply.status in (404, 410):  # finished by an earlier try whose reply was lost?
            resource = self._json(self._http.ok(self._request("GET", self._object(key), key), key), key)
            if int(resource.get("size", -1)) == total and resource.get("md5Hash") == digest:
                return str(resource["generation"])
        raise self._http.refusal(reply, key)

    def abort_upload(self, key: str, upload_id: str) -> None:
        with self._guard:
            self._uploads.pop(upload_id, None)
        if upload_id.startswith(self.endpoint):  # a session of this endpoint, never another URL
            with contextlib.suppress(ObjectStoreError):
                self._request("DELETE", upload_id, key)  # 499: cancelled; 404/410: gone already

    def uploads(self, prefix: str) -> builtins.list[tuple[str, str]]:
        """None to list: an unfinished resumable upload is no object and expires by itself."""
        return []

    def upload_size(self, key: str, upload_id: str) -> int:
        return 0

    def explain(self, error: OSError) -> tuple[str, str]:
        return explain_error(self.location, self.settings, error)

    # --- plumbing ---------------------------------------------------------------------------------

    def _upload(self, key: str, upload_id: str) -> _Upload:
        with self._guard:
            found = self._uploads.get(upload_id)
        if found is None:
            raise NotFound(errno.ENOENT, "no such upload (finished or abandoned)", key)
        return found

    def _object(self, key: str) -> str:
        return f"{self._objects}/{quote(key, safe='')}"

    def _media(self, key: str, **query: str) -> str:
        return f"{self._object(key)}?{urlencode({'alt': 'media', **query})}"

    def _request(self, method: str, url: str, key: str, **kwargs: Any) -> Any:
        return self._http.request(method, url, key, sign=self._sign if self._credentials else None, **kwargs)

    def _sign(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        """The credentials' token on the request (refreshed by google-auth when it expires)."""
        with self._auth_lock:
            if self._auth_request is None:
                import google.auth.transport.urllib3
                import urllib3

                self._auth_request = google.auth.transport.urllib3.Request(urllib3.PoolManager())
            self._credentials.before_request(self._auth_request, method, url, headers)
        return headers

    def _bucket_there(self, reply: Reply, key: str) -> None:
        """A 404 to a request on the bucket itself (a listing, an upload): no bucket."""
        if reply.status == 404:
            raise ObjectStoreError("NoSuchBucket", 404, f"no bucket {self.bucket!r}", key)

    @staticmethod
    def _json(reply: Reply, key: str) -> dict[str, Any]:
        try:
            found = json.loads(reply.body)
        except ValueError:
            found = None
        if not isinstance(found, dict):
            raise ObjectStoreError("InvalidResponse", reply.status, "the reply is not a JSON object", key)
        return found

    def _generation(self, reply: Reply, key: str) -> str:
        generation = str(self._json(reply, key).get("generation", ""))
        if not generation.isdigit():
            raise ObjectStoreError("InvalidResponse", reply.status, "the reply names no generation", key)
        return generation


def _age(updated: Any, date: str | None) -> float | None:
    from email.utils import parsedate_to_datetime

    try:
        then = datetime.datetime.fromisoformat(str(updated).replace("Z", "+00:00"))
        now = parsedate_to_datetime(date or "")
    except (TypeError, ValueError, IndexError):
        return None
    if then.tzinfo is None or now is None or now.tzinfo is None:
        return None
    return max(0.0, (now - then).total_seconds())


def explain_error(location: Location, settings: Settings, error: OSError) -> tuple[str, str]:
    """What ``error`` (met on the root at ``location``) means, and what to do about it."""
    code = getattr(error, "code", "")
    status = getattr(error, "status", 0)
    if code == "NoSuchBucket":
        return f"the bucket {location.bucket!r} does not exist", "create it, or fix the URL's bucket name"
    if status in (401, 403) or error.errno == errno.EACCES:
        return f"access denied ({code or status})", (
            "check the credentials (Application Default Credentials, GOOGLE_APPLICATION_CREDENTIALS or "
            "storage_options['token']) and that they may read, write and delete objects in the bucket "
            "(roles/storage.objectUser); pass read_only=True for a job that only restores"
        )
    if isinstance(error, ConnectionError) or (isinstance(error, ObjectStoreError) and status == 0):
        return f"the service is not available ({error.strerror})", (
            f"check the endpoint ({settings.endpoint}: storage_options['endpoint_url'] or "
            "STORAGE_EMULATOR_HOST) and the network; each request was retried for up to "
            "storage_options['timeout'] seconds"
        )
    return f"{type(error).__name__}: {error}", "check the bucket, the credentials and the service"
