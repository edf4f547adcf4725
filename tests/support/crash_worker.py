"""A training process that SIGKILLs itself at a chosen point (used by test_crash.py).

It counts every filesystem operation safeckpt makes through the FileOps seam
and kills itself at the N-th, or after a delay; each completed commit it knows
of is appended to a log with an unbuffered write, so the test knows what was
durable before the kill.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import threading
from pathlib import Path

import torch

from safeckpt import CheckpointManager, Retention
from safeckpt._fs.fileops import FileOps


class KillAtOps(FileOps):
    def __init__(self, kill_at: int | None, *, no_exchange: bool = False, log_fd: int | None = None) -> None:
        self.kill_at = kill_at
        self.no_exchange = no_exchange
        self.log_fd = log_fd
        self.count = 0
        self._lock = threading.Lock()

    def _tick(self) -> None:
        with self._lock:
            self.count += 1
            if self.count == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def write_file(self, path: Path, data: bytes) -> None:
        self._tick()
        super().write_file(path, data)
        self._tick()

    def fsync_dir(self, path: Path) -> None:
        self._tick()
        super().fsync_dir(path)

    def replace(self, src: Path, dst: Path) -> None:
        self._tick()
        super().replace(src, dst)
        self._log_commit(src, dst)

    def _log_commit(self, src: Path, dst: Path) -> None:
        """The rename of a staging directory into step_<N> is the commit: from it on, resume must
        take step N (or a later one), whether or not ``latest`` moved."""
        match = re.fullmatch(r"step_(\d+)", dst.name)
        if match and src.parent.name == ".staging" and self.log_fd is not None:
            os.write(self.log_fd, f"renamed {match.group(1)}\n".encode())

    def exchange(self, a: Path, b: Path) -> None:
        self._tick()
        if self.no_exchange:  # like NFS: replacing a step takes two renames
            raise OSError(errno.EINVAL, "no RENAME_EXCHANGE")
        super().exchange(a, b)
        self._log_commit(a, b)

    def symlink(self, target: str, link: Path) -> None:
        self._tick()
        super().symlink(target, link)

    def rmtree(self, path: Path) -> None:
        self._tick()
        super().rmtree(path)


def make_state(numel: int) -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(numel), "b": torch.zeros(7)}


def train(
    root: str,
    log: str,
    *,
    async_save: bool,
    steps: int,
    numel: int,
    kill_at: int | None = None,
    kill_after: float | None = None,
    no_exchange: bool = False,
) -> int:
    """Save steps 1..steps (each tensor filled with the step; even steps saved twice, the
    second save replacing the first), keep_last=2; returns the number of operations."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    ops = KillAtOps(kill_at, no_exchange=no_exchange, log_fd=fd)
    if kill_after is not None:
        timer = threading.Timer(kill_after, os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()
    state = make_state(numel)
    with CheckpointManager(
        root, async_save=async_save, retention=Retention(keep_last=2), file_ops=ops, drain_timeout=5
    ) as mgr:
        start = mgr.restore(state).step or 0
        for step in range(start + 1, steps + 1):
            for tensor in state.values():
                tensor.fill_(float(step))
            mgr.save(step, state, metrics={"loss": 1.0 / step})
            if async_save and step % 2:
                continue
            mgr.wait()
            os.write(fd, f"committed {step}\n".encode())
            if step % 2 == 0:
                mgr.save(step, state, metrics={"loss": 0.5 / step})
                mgr.wait()
    os.write(fd, f"committed {mgr.latest_step or 0}\n".encode())  # close() waited for everything
    os.close(fd)
    return ops.count
