"""s3rver, a real S3 server that is not moto, on 127.0.0.1 (pytest plugin).

It ignores ``If-None-Match`` and ``If-Match`` on PUT and answers 501 to
``list_multipart_uploads``: a server a writer must refuse (safeckpt._objstore.conditions) and a
reader must still read. Installed from npm by ``make test`` (tests/npm, ``npm ci``).

* ``s3rver``: a session-wide server, in a directory of its own;
* ``s3rver_bucket``: a fresh bucket on it, with the ``AWS_*`` variables pointing at it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from s3_server import REGION, S3Bucket, in_ci
from server_process import ServerProcess

BINARY = Path(__file__).parent.parent / "npm" / "node_modules" / ".bin" / "s3rver"


class S3rver(ServerProcess):
    name = "s3rver"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        (workdir / "data").mkdir(exist_ok=True)

    def command(self) -> list[str]:
        return [
            str(BINARY),
            "-d",
            str(self.workdir / "data"),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "--silent",
            "--allow-mismatched-signatures",  # the fake credentials of the tests
            "--no-vhost-buckets",
        ]

    def ready(self) -> bool:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/")
            return conn.getresponse().status < 500
        finally:
            conn.close()


@pytest.fixture(scope="session")
def s3rver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3rver]:
    if not BINARY.exists():
        reason = "s3rver is not installed: run `make test` (npm ci in tests/npm)"
        if in_ci():
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    server = S3rver(tmp_path_factory.mktemp("s3rver"))
    server.start()
    try:
        yield server
    finally:
        server.kill(signal.SIGTERM)


@pytest.fixture
def s3rver_bucket(s3rver: S3rver, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    bucket = S3Bucket(s3rver.endpoint, f"s3rver-{uuid.uuid4().hex[:12]}", "S3RVER", "S3RVER")  # its own keys
    for name, value in {
        "AWS_ENDPOINT_URL": bucket.endpoint_url,
        "AWS_ACCESS_KEY_ID": bucket.access_key,
        "AWS_SECRET_ACCESS_KEY": bucket.secret_key,
        "AWS_REGION": REGION,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    client = bucket.client()
    client.create_bucket(Bucket=bucket.name)
    try:
        yield bucket
    finally:
        with contextlib.suppress(Exception):
            stored = bucket.keys()
            for key in stored:
                client.delete_object(Bucket=bucket.name, Key=key)
            client.delete_bucket(Bucket=bucket.name)
