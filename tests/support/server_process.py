"""A test server as a child process on 127.0.0.1: started in its own session on a free port,
ready when its probe answers, stopped by its pid (its whole process group). Tests may ``kill()``
it and ``start()`` it again on the same port, to play an outage.

Subclasses give the command, the environment and the readiness probe.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    name = "server"
    start_timeout = 60.0

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.log_path = workdir / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        return None  # the test process's own

    def cwd(self) -> Path | None:
        return None  # the test process's own

    def ready(self) -> bool:
        """Whether the server answers (an ``OSError`` counts as not yet)."""
        raise NotImplementedError

    def start(self) -> None:
        assert self._proc is None, "already running"
        log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        try:
            # Its own session: one killpg stops it and any worker it forks.
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=self.cwd(),
                start_new_session=True,
            )
        finally:
            log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self._proc.returncode}:\n{self._log_tail()}")
            with contextlib.suppress(OSError):
                if self.ready():
                    return
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"{self.name} not ready within {self.start_timeout:g} s:\n{self._log_tail()}")

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
