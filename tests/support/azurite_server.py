"""Azurite, Microsoft's Blob Storage emulator, on 127.0.0.1 for the test session (pytest plugin).

Installed from npm by ``make test`` (tests/npm, ``npm ci``; 3.35.0 is the newest that runs on
Node 20). In memory, in a working folder of its own (it writes its debug files there). At
start it must prove what safeckpt's commit rests on: a create-only PUT over a blob refused with
409, a PUT on a wrong ETag with 412.

* ``azurite``: the session's server;
* ``azure_container``: a fresh container on it, with ``AZURE_STORAGE_CONNECTION_STRING``
  pointing at it (Azurite's published development account).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from s3_server import in_ci
from server_process import ServerProcess

BINARY = Path(__file__).parent.parent / "npm" / "node_modules" / ".bin" / "azurite-blob"
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # published


class Azurite(ServerProcess):
    name = "azurite"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.endpoint = f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    def command(self) -> list[str]:
        return [
            str(BINARY),
            "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
            "--inMemoryPersistence", "--extentMemoryLimit", "1024",
            "--skipApiVersionCheck", "--disableTelemetry", "--silent",
        ]  # fmt: skip

    def cwd(self) -> Path:
        return self.workdir  # its own working folder: it may write files there

    def ready(self) -> bool:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", f"/{ACCOUNT}?comp=list")
            return conn.getresponse().status < 500
        finally:
            conn.close()

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint={self.endpoint};"
        )

    def client(self, container: str):  # the client under test, to make and look at containers
        from safeckpt._azure.client import AzureClient
        from safeckpt._azure.location import Location, settings

        return AzureClient(
            Location(container, ""), settings({"connection_string": self.connection_string}, "az://")
        )

    def make_container(self, name: str) -> None:
        client = self.client(name)
        reply = client._request("PUT", f"{client._base}?restype=container", "")
        assert reply.status == 201, (reply.status, reply.body)


def conditional_put_problem(server: Azurite) -> str | None:
    from safeckpt._objstore.conditions import _probe

    name = f"probe-{uuid.uuid4().hex[:12]}"
    server.make_container(name)
    return _probe(server.client(name), "probe")


@dataclass(frozen=True)
class AzureContainer:
    connection_string: str
    name: str

    def url(self, prefix: str = "") -> str:
        return f"az://{self.name}/{prefix}" if prefix else f"az://{self.name}"

    @property
    def storage_options(self) -> dict[str, str]:
        return {"connection_string": self.connection_string}


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    if not BINARY.exists():
        reason = "azurite is not installed: run `make test` (npm ci in tests/npm)"
        if in_ci():
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    server = Azurite(tmp_path_factory.mktemp("azurite"))
    server.start()
    try:
        problem = conditional_put_problem(server)
        if problem is not None:
            pytest.fail(f"azurite {problem}; tests/npm/package.json pins the version CI runs")
        yield server
    finally:
        server.kill()


@pytest.fixture
def azure_container(azurite: Azurite, monkeypatch: pytest.MonkeyPatch) -> AzureContainer:
    container = AzureContainer(azurite.connection_string, f"az-{uuid.uuid4().hex[:12]}")
    azurite.make_container(container.name)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string)
    for name in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return container
