"""The few Blob Storage requests a root needs (its REST API, over urllib3), as the object client
protocol.

* The token of a conditional write is the blob's ETag: create-only is ``If-None-Match: *``
  (lost: 409 ``BlobAlreadyExists``), replace-if-unchanged ``If-Match`` (lost: 412
  ``ConditionNotMet``). Every Put Blob and Put Block carries its ``Content-MD5``, which the
  service checks.
* A large object is a block blob: blocks (Put Block) in parallel, then Put Block List, the
  instant the blob appears whole. Uncommitted blocks are no blob and list nowhere; Azure
  discards them after a week, and an upload this process abandons is discarded at once (an
  empty block list committed create-only, then deleted).
* Metadata names are C# identifiers on Azure: ``-`` in a name is sent as ``_`` and read back.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import errno
import hashlib
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from email.utils import formatdate
from typing import Any
from urllib.parse import quote, urlencode

from .._objstore.client import Got, Head, ObjectStoreError, PreconditionFailed
from .._objstore.http import Http, Reply, age, content_size
from ..errors import ConfigError
from .auth import API_VERSION, Bearer, shared_key
from .location import Location, Settings

_META = "x-ms-meta-"


def _code(reply: Reply) -> str:
    code = reply.headers.get("x-ms-error-code", "")
    if not code and reply.body:
        with contextlib.suppress(ET.ParseError):
            found = ET.fromstring(reply.body).findtext("Code")
            code = found or ""
    if code == "ContainerNotFound":
        return "NoSuchBucket"  # the container is the bucket: "bucket" in the code says so
    return code or f"HTTP{reply.status}"


def _md5(data: bytes | memoryview) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


class AzureClient:
    """One container's requests, the :class:`~safeckpt._objstore.client.ObjectClient` of Azure."""

    def __init__(self, location: Location, settings: Settings) -> None:
        self.location = location
        self.settings = settings
        self.bucket = location.container
        self.endpoint = settings.endpoint
        self._base = f"{settings.endpoint}/{quote(location.container, safe='')}"
        self._bearer: Bearer | None = None
        credential = settings.credential
        if credential == "default":
            try:
                from azure.identity import DefaultAzureCredential
            except ImportError as e:
                raise ConfigError(
                    f"{location.url}: no account key or SAS was given, and DefaultAzureCredential needs "
                    "azure-identity: pip install 'safeckpt[azure]', or set "
                    "AZURE_STORAGE_CONNECTION_STRING (or storage_options account_key / sas_token).",
                    path=location.url,
                ) from e
            credential = DefaultAzureCredential()
        if credential is not None:
            if not hasattr(credential, "get_token"):
                raise ConfigError(
                    f"storage_options['credential'] of an az:// root is a key, a SAS or a token "
                    f"credential (get_token), got {type(credential).__name__}.",
                    path=location.url,
                )
            self._bearer = Bearer(credential)
        self._http = Http(settings.endpoint, settings.limits, explain_code=_code)
        self.reach = self._http.reach

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
        headers = {"x-ms-blob-type": "BlockBlob", "Content-MD5": _md5(data), **_meta_headers(metadata)}
        if create_only:
            headers["If-None-Match"] = "*"
        if replacing is not None:
            headers["If-Match"] = replacing
        reply = self._request("PUT", self._url(key), key, body=data, headers=headers)
        if reply.status == 412 or (reply.status == 409 and _code(reply) == "BlobAlreadyExists"):
            raise PreconditionFailed(key)
        if reply.status == 404 and replacing is not None and _code(reply) == "BlobNotFound":
            raise PreconditionFailed(key)
        return self._etag(self._http.ok(reply, key), key)

    def get(self, key: str, *, start: int | None = None, length: int | None = None) -> Got:
        headers: dict[str, str] = {}
        if start is not None:
            if length == 0:
                head = self.head(key)
                return Got(b"", head.token, head.size)
            end = "" if length is None else str(start + length - 1)
            headers["x-ms-range"] = f"bytes={start}-{end}"
        reply = self._request("GET", self._url(key), key, headers=headers)
        if reply.status == 416:
            raise ObjectStoreError("InvalidRange", 416, "the range starts past the blob's end", key)
        self._http.ok(reply, key)
        return Got(
            reply.body,
            self._etag(reply, key),
            content_size(reply),
            _metadata(reply.headers),
            age(reply.headers.get("last-modified"), reply.headers.get("date")),
        )

    def head(self, key: str) -> Head:
        reply = self._http.ok(self._request("HEAD", self._url(key), key), key)
        return Head(
            int(reply.headers.get("content-length", 0)), self._etag(reply, key), _metadata(reply.headers)
        )

    def delete(self, key: str) -> None:
        reply = self._request("DELETE", self._url(key), key)
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
        query = {"restype": "container", "comp": "list", "prefix": prefix}
        if delimiter:
            query["delimiter"] = delimiter
        if limit is not None:
            query["maxresults"] = str(limit)
        while True:
            reply = self._http.ok(self._request("GET", f"{self._base}?{urlencode(query)}", prefix), prefix)
            try:
                root = ET.fromstring(reply.body)
            except ET.ParseError as e:
                raise ObjectStoreError(
                    "InvalidResponse", reply.status, f"a listing that is not XML: {e}", prefix
                ) from e
            for blob in root.iter("Blob"):
                size = blob.findtext("Properties/Content-Length") or "0"
                objects.append((blob.findtext("Name") or "", int(size)))
            prefixes.extend(p.findtext("Name") or "" for p in root.iter("BlobPrefix"))
            marker = root.findtext("NextMarker")
            if limit is not None or not marker:
                return objects, prefixes
            query["marker"] = marker

    # --- block blobs ----------------------------------------------------------------------------

    def start_upload(self, key: str) -> str:
        return uuid.uuid4().hex  # blocks need no request to begin: their ids carry this one

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | memoryview) -> Any:
        """Put Block ``number`` with its MD5 (a block changed on the way is refused)."""
        block = base64.b64encode(f"{upload_id}-{number:06d}".encode()).decode()
        query = urlencode({"comp": "block", "blockid": block})
        headers = {"Content-MD5": _md5(data)}
        self._http.ok(self._request("PUT", f"{self._url(key)}?{query}", key, body=data, headers=headers), key)
        return block

    def finish_upload(self, key: str, upload_id: str, parts: builtins.list[Any]) -> str:
        """Put Block List: the blob appears, whole."""
        body = "".join(f"<Latest>{block}</Latest>" for block in parts)
        data = f'<?xml version="1.0" encoding="utf-8"?><BlockList>{body}</BlockList>'.encode()
        reply = self._request(
            "PUT",
            f"{self._url(key)}?comp=blocklist",
            key,
            body=data,
            headers={"Content-Type": "application/xml"},
        )
        return self._etag(self._http.ok(reply, key), key)

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Discard the blocks now: an empty block list committed create-only (never over a blob
        that finished), then the empty blob deleted."""
        empty = b'<?xml version="1.0" encoding="utf-8"?><BlockList></BlockList>'
        with contextlib.suppress(OSError):
            reply = self._request(
                "PUT", f"{self._url(key)}?comp=blocklist", key, body=empty, headers={"If-None-Match": "*"}
            )
            if 200 <= reply.status < 300:
                self.delete(key)

    def uploads(self, prefix: str) -> builtins.list[tuple[str, str]]:
        """None to list: uncommitted blocks are no blob, and Azure discards them after a week."""
        return []

    def upload_size(self, key: str, upload_id: str) -> int:
        return 0

    def explain(self, error: OSError) -> tuple[str, str]:
        return explain_error(self.location, self.settings, error)

    # --- plumbing ---------------------------------------------------------------------------------

    def _url(self, key: str) -> str:
        return f"{self._base}/{quote(key, safe='/~')}"

    def _request(self, method: str, url: str, key: str, **kwargs: Any) -> Reply:
        if self.settings.sas:
            url += ("&" if "?" in url else "?") + self.settings.sas
        return self._http.request(method, url, key, sign=self._sign, **kwargs)

    def _sign(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        headers["x-ms-version"] = API_VERSION
        headers["x-ms-date"] = formatdate(usegmt=True)
        if self._bearer is not None:
            headers["Authorization"] = self._bearer.header()
        elif self.settings.key and not self.settings.sas:
            headers["Authorization"] = shared_key(
                self.settings.account, self.settings.key, method, url, headers
            )
        return headers

    @staticmethod
    def _etag(reply: Reply, key: str) -> str:
        etag = reply.headers.get("etag", "")
        if not etag:
            raise ObjectStoreError("InvalidResponse", reply.status, "the reply has no ETag", key)
        return etag


def _meta_headers(metadata: Mapping[str, str] | None) -> dict[str, str]:
    return {_META + name.replace("-", "_"): value for name, value in (metadata or {}).items()}


def _metadata(headers: Mapping[str, str]) -> dict[str, str]:
    return {k[len(_META) :].replace("_", "-"): v for k, v in headers.items() if k.startswith(_META)}


def explain_error(location: Location, settings: Settings, error: OSError) -> tuple[str, str]:
    """What ``error`` (met on the root at ``location``) means, and what to do about it."""
    code = getattr(error, "code", "")
    status = getattr(error, "status", 0)
    if code == "NoSuchBucket":
        return f"the container {location.container!r} does not exist", (
            "create it, or fix the URL's container name"
        )
    if status in (401, 403) or error.errno == errno.EACCES:
        return f"access denied ({code or status})", (
            "check the credentials (AZURE_STORAGE_CONNECTION_STRING, the account key or SAS, or the "
            "identity's role: Storage Blob Data Contributor) and that they may read, write and delete "
            "blobs in the container; pass read_only=True for a job that only restores"
        )
    if isinstance(error, ConnectionError) or (isinstance(error, ObjectStoreError) and status == 0):
        return f"the service is not available ({error.strerror})", (
            f"check the endpoint ({settings.endpoint}) and the network; each request was retried for "
            "up to storage_options['timeout'] seconds"
        )
    return f"{type(error).__name__}: {error}", "check the container, the credentials and the service"
