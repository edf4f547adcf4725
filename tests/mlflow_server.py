"""A real ``mlflow server`` on 127.0.0.1 for the test session (pytest plugin).

One server per session (it takes 6-18 s to start): sqlite backend, a file
artifact root served by the server, a free port, one worker and
``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`` (keeps it near 0.5 GB). Ready
when ``/health`` answers; stopped by its pid (its own process group) at the
end. Tests may ``kill()`` it and ``start()`` it again on the same port and
store, to play an outage.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

_START_TIMEOUT = 180.0  # generous: a loaded 2-core machine

# MLflow's telemetry thread sets and unsets an environment variable while requests iterate
# os.environ on other threads, which fails them now and then with KeyError (seen here). The
# tests reach no network anyway: no telemetry, set before any test module imports mlflow.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    """One ``mlflow server`` process (group); ``uri`` is its tracking URI."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self._proc is None, "already running"
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        mlflow_bin = Path(sys.executable).with_name("mlflow")
        command = [
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
        log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        try:
            # Its own session: the server forks workers, and one killpg stops them all.
            self._proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        finally:
            log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self._proc.returncode}:\n{self._log_tail()}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"mlflow server not ready within {_START_TIMEOUT:g} s:\n{self._log_tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop the server (its whole process group) by its pid and wait for it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return "(no log)"


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
