"""A real S3 server (moto's server mode, over HTTP) on 127.0.0.1 for the test session (pytest plugin).

One ``python -m moto.server`` per session on a free port (it starts in about a second and keeps
everything in memory). Ready when S3 answers ``GET /``; stopped by its pid (its own process group)
at the end. Tests may ``kill()`` it and ``start()`` it again on the same port, to play an outage
(its objects are lost then: moto keeps nothing on disk).

At start the server must prove what safeckpt's S3 commit rests on: a conflicting conditional PUT
(``If-None-Match: *`` on an existing key, ``If-Match`` with a wrong ETag) is refused with 412.
Some moto releases accept both with 200, which would let every commit test pass against a server
that cannot detect a conflict; so a server that fails the check is a test failure under CI=true
and a skip elsewhere, naming the moto version. The version is pinned in constraints/ci.txt.

* ``s3_server``: the session's server.
* ``s3_bucket``: a fresh, empty bucket for one test, with the standard ``AWS_*`` variables set
  (through monkeypatch, so nothing leaks) to reach it; emptied and deleted afterwards.

No moto in-process mocks: everything goes over HTTP, as it would to a real S3.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.metadata
import itertools
import os
import signal
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from server_process import ServerProcess

_START_TIMEOUT = 60.0  # moto starts in ~1 s; generous for a loaded 2-core machine

# moto accepts any credentials; these are fake on purpose and are no secret.
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"

# Variables that would point a client elsewhere than the test server (a developer's own AWS
# profile, a session token, a per-service endpoint that wins over AWS_ENDPOINT_URL).
_FOREIGN_AWS_VARS = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def moto_version() -> str:
    try:
        return importlib.metadata.version("moto")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _request(
    endpoint: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One SigV4-signed HTTP request, with the fake test credentials.

    Sent with http.client rather than an S3 client, so the checks see the status the server sent,
    untouched by a client's retries or error mapping. Signed, because moto answers an unsigned
    request that fails a precondition with 403, not 412: a real client always signs.
    """
    from botocore.auth import S3SigV4Auth  # botocore comes with moto
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    request = AWSRequest(method=method, url=endpoint + path, data=body, headers=headers or {})
    S3SigV4Auth(Credentials(ACCESS_KEY, SECRET_KEY), "s3", REGION).add_auth(request)
    parts = urlsplit(endpoint)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=10)
    try:
        conn.request(method, path, body=body, headers=dict(request.headers.items()))
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def conditional_write_problem(endpoint: str, bucket: str = "safeckpt-conditional-probe") -> str | None:
    """What is wrong with this server's conditional PUTs, or None when it refuses conflicts with 412.

    Also checks the other side (a plain PUT and an ``If-Match`` on the right ETag succeed, and the
    object holds what was last written), so a server that refuses everything does not pass.
    """
    key = f"/{bucket}/probe-{uuid.uuid4().hex}"
    problems = []
    try:
        status, _, _ = _request(endpoint, "PUT", f"/{bucket}")
        if status not in (200, 409):  # 409: the bucket is there already (a restarted check)
            return f"creating bucket {bucket!r} answered {status}"
        status, headers, _ = _request(endpoint, "PUT", key, b"first")
        etag = headers.get("etag")
        if status != 200 or not etag:
            return f"a plain PUT answered {status} with ETag {etag!r}"
        status, _, _ = _request(endpoint, "PUT", key, b"second", {"If-None-Match": "*"})
        if status != 412:
            problems.append(f"PUT with If-None-Match: * on an existing key answered {status}, not 412")
        wrong = '"' + "0" * 32 + '"'
        status, _, _ = _request(endpoint, "PUT", key, b"third", {"If-Match": wrong})
        if status != 412:
            problems.append(f"PUT with If-Match on a wrong ETag answered {status}, not 412")
        if not problems:
            status, _, _ = _request(endpoint, "PUT", key, b"fourth", {"If-Match": etag})
            if status != 200:
                problems.append(f"PUT with If-Match on the current ETag answered {status}, not 200")
            status, _, body = _request(endpoint, "GET", key)
            if (status, body) != (200, b"fourth"):
                problems.append(f"GET after the conditional PUTs answered {status} with {body[:40]!r}")
        with contextlib.suppress(OSError):
            _request(endpoint, "DELETE", key)
            _request(endpoint, "DELETE", f"/{bucket}")
    except OSError as e:
        return f"the server could not be reached: {e}"
    return "; ".join(problems) or None


class S3Server(ServerProcess):
    """One ``moto.server`` process (group); ``endpoint`` is its URL (``AWS_ENDPOINT_URL``)."""

    name = "moto server"
    start_timeout = _START_TIMEOUT

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    def environ(self) -> dict[str, str]:
        """The standard ``AWS_*`` variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
        }

    def ready(self) -> bool:
        return _request(self.endpoint, "GET", "/")[0] == 200  # ListBuckets: S3 is answering


@dataclass(frozen=True)
class S3Bucket:
    """Where one test's bucket is, and the credentials that reach it (also set as ``AWS_*``)."""

    endpoint_url: str
    name: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.name}/{prefix}" if prefix else f"s3://{self.name}"

    @property
    def storage_options(self) -> dict[str, str]:
        """The same settings as fsspec-style ``storage_options`` (for tests that pass them explicitly)."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": self.access_key,
            "secret": self.secret_key,
            "region": self.region,
        }

    def client(self) -> Any:
        """A boto3 client on this server (boto3 comes with moto), for tests to look at the bucket."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )

    def keys(self) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.name)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _empty_and_delete(bucket: S3Bucket) -> None:
    """Remove the bucket's objects, unfinished multipart uploads and the bucket: moto holds all in RAM."""
    client = bucket.client()
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket.name):
        for upload in page.get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket.name, Key=upload["Key"], UploadId=upload["UploadId"])
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket.name):
        objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objects:
            client.delete_objects(Bucket=bucket.name, Delete={"Objects": objects, "Quiet": True})
    client.delete_bucket(Bucket=bucket.name)


def _skip_or_fail(reason: str) -> None:
    if in_ci():
        pytest.fail(f"CI=true and the S3 tests cannot run: {reason}", pytrace=False)
    pytest.skip(f"needs a moto S3 server: {reason}")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A running moto S3 server (session-wide) that answers conflicting conditional PUTs with 412."""
    try:
        import moto.server  # noqa: F401 - the server's own entry point, run in a child below
    except ImportError as e:
        _skip_or_fail(f"moto[server] is not installed ({e}); pip install -e '.[test]'")
    server = S3Server(tmp_path_factory.mktemp("s3_server"))
    server.start()
    try:
        problem = conditional_write_problem(server.endpoint)
        if problem is not None:
            _skip_or_fail(
                f"moto {moto_version()} does not refuse conflicting conditional writes: {problem} "
                "(use the version pinned in constraints/ci.txt)"
            )
        yield server
    finally:
        server.kill(signal.SIGTERM)


_bucket_numbers = itertools.count()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """A fresh, empty bucket on the session's server; ``AWS_*`` point at it for this test only."""
    # A new name per test (not one reused bucket): nothing a test left, even half-deleted, is seen
    # by the next one. S3 names: 3-63 characters, lower case, digits and hyphens.
    bucket = S3Bucket(s3_server.endpoint, f"test-{next(_bucket_numbers)}-{uuid.uuid4().hex[:12]}")
    for name in _FOREIGN_AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", bucket.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", bucket.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", bucket.secret_key)
    monkeypatch.setenv("AWS_REGION", bucket.region)
    monkeypatch.setenv("AWS_DEFAULT_REGION", bucket.region)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")  # object_store-based clients refuse http:// without it
    # No developer's ~/.aws config or credentials file may change what the clients do.
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    bucket.client().create_bucket(Bucket=bucket.name)
    try:
        yield bucket
    finally:
        if s3_server.running:
            try:
                _empty_and_delete(bucket)
            except Exception as e:  # a test that restarted the server lost its bucket with it
                if getattr(e, "response", {}).get("Error", {}).get("Code") != "NoSuchBucket":
                    raise
