"""A real ``mlflow server`` on 127.0.0.1 for the test session (pytest plugin).

One server per session (it takes 6-18 s to start): sqlite backend, a file
artifact root served by the server, a free port, one worker and
``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`` (keeps it near 0.5 GB). Ready
when ``/health`` answers; stopped by its pid (its own process group) at the
end. Tests may ``kill()`` it and ``start()`` it again on the same port and
store, to play an outage.
"""

from __future__ import annotations

import os
import signal
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from server_process import ServerProcess

_START_TIMEOUT = 180.0  # generous: a loaded 2-core machine

# MLflow's telemetry thread sets and unsets an environment variable while requests iterate
# os.environ on other threads, which fails them now and then with KeyError (seen here). The
# tests reach no network anyway: no telemetry, set before any test module imports mlflow.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


class MlflowServer(ServerProcess):
    """One ``mlflow server`` process (group); ``uri`` is its tracking URI."""

    name = "mlflow server"
    start_timeout = _START_TIMEOUT

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.uri = f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")

    def command(self) -> list[str]:
        mlflow_bin = Path(sys.executable).with_name("mlflow")
        return [
            str(mlflow_bin) if mlflow_bin.exists() else "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self.workdir / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.workdir / "artifacts"),
        ]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                return bool(response.status == 200)
        except urllib.error.URLError:
            return False


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """A running MLflow tracking server (session-wide). A test that kills it starts it again."""
    pytest.importorskip("mlflow")
    server = MlflowServer(tmp_path_factory.mktemp("mlflow_server"))
    server.start()
    try:
        yield server
    finally:
        server.kill(signal.SIGTERM)
