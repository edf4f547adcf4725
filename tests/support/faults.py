"""Fault injection through the :class:`~safeckpt._fs.fileops.FileOps` seam.

Import these from any test; they patch nothing process-wide::

    ops = FaultyFileOps(lock=SidecarLock(root / ".lock"))
    ops.fail("rmtree", errno.ENOTEMPTY, times=3)      # the next three rmtree calls raise
    ops.fail("rmtree", errno.EACCES, match="step_2")  # only on paths containing "step_2"
    ops.fail("exchange", errno.EINVAL, times=None)    # always: a filesystem without RENAME_EXCHANGE
    ops.fail("write_file", errno.ENOSPC, partial=True)  # half the data lands, then the error
    ops.fail("rmtree", errno.EBUSY, match=lambda paths: ...)  # any predicate on the call's paths
    ...
    assert ops.count("rmtree") == 4 and ops.sleeps == [0.05, 0.1, 0.2]

``FaultyFileOps`` performs the real operation unless a configured fault fires,
records every call (operation, paths, whether the root's sidecar lock was held
by the calling thread, the thread) and never really sleeps: ``sleep`` only
records how long it was asked to wait. ``LockRecordingFileOps(root)`` is the
same with the lock of ``root`` wired in. Both are thread-safe.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from safeckpt._format.layout import LOCK_NAME
from safeckpt._fs.fileops import FileOps
from safeckpt._fs.lock import SidecarLock

OPERATIONS = ("write_file", "fsync_dir", "replace", "exchange", "symlink", "rmtree", "sleep")
MUTATIONS = ("write_file", "replace", "exchange", "symlink", "rmtree")


@dataclass(frozen=True)
class Call:
    """One call through the seam."""

    op: str
    paths: tuple[Path, ...]
    """The paths the call names: ``(path,)``, ``(src, dst)``, ``(link,)``; ``()`` for sleep."""
    locked: bool | None
    """Whether the calling thread held the sidecar lock; None when no lock was given."""
    thread: str
    seconds: float | None = None
    """For ``sleep``: the wait asked for."""
    failed: bool = False
    """Whether a configured fault fired instead of the operation."""


@dataclass
class Fault:
    """Raise ``OSError(err)`` from ``op`` on matching paths, ``times`` times (None: always)."""

    op: str
    err: int
    times: int | None = 1
    match: str | Callable[[tuple[Path, ...]], bool] | None = None
    partial: bool = False
    """For ``write_file``: write the first half of the data, then raise (a torn write)."""
    fired: int = 0

    def matches(self, op: str, paths: tuple[Path, ...]) -> bool:
        if op != self.op or (self.times is not None and self.fired >= self.times):
            return False
        if self.match is None:
            return True
        if callable(self.match):
            return self.match(paths)
        return any(self.match in str(p) for p in paths)


class FaultyFileOps(FileOps):
    """Real file operations with injected ``OSError``s, a call log, and sleeps that do not sleep."""

    def __init__(self, *, lock: SidecarLock | None = None) -> None:
        self.lock = lock
        self.calls: list[Call] = []
        self.faults: list[Fault] = []
        self._guard = threading.Lock()

    # --- configuring --------------------------------------------------------------

    def fail(
        self,
        op: str,
        err: int,
        *,
        times: int | None = 1,
        match: str | Callable[[tuple[Path, ...]], bool] | None = None,
        partial: bool = False,
    ) -> Fault:
        """Make the next ``times`` calls of ``op`` (on paths containing ``match``) raise ``err``."""
        if op not in OPERATIONS:
            raise ValueError(f"unknown operation {op!r}; one of {OPERATIONS}")
        fault = Fault(op, err, times, match, partial)
        with self._guard:
            self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._guard:
            self.faults.clear()

    # --- reading the log ------------------------------------------------------------

    def calls_of(self, *ops: str) -> list[Call]:
        with self._guard:
            return [c for c in self.calls if c.op in ops]

    def count(self, op: str) -> int:
        return len(self.calls_of(op))

    @property
    def sleeps(self) -> list[float]:
        return [c.seconds for c in self.calls_of("sleep") if c.seconds is not None]

    # --- the seam ----------------------------------------------------------------------

    def _enter(self, op: str, paths: Iterable[Path], seconds: float | None = None) -> Fault | None:
        paths = tuple(Path(p) for p in paths)
        locked = None if self.lock is None else self.lock.held()
        with self._guard:
            fault = next((f for f in self.faults if f.matches(op, paths)), None)
            if fault is not None:
                fault.fired += 1
            self.calls.append(
                Call(op, paths, locked, threading.current_thread().name, seconds, fault is not None)
            )
        return fault

    @staticmethod
    def _raise(fault: Fault, paths: tuple[Path, ...]) -> None:
        raise OSError(fault.err, os.strerror(fault.err), *(str(p) for p in paths[:1]))

    def write_file(self, path: Path, data: bytes) -> None:
        fault = self._enter("write_file", (path,))
        if fault is not None:
            if fault.partial:
                with open(path, "wb") as f:
                    f.write(bytes(data[: len(data) // 2]))
            self._raise(fault, (path,))
        super().write_file(path, data)

    def fsync_dir(self, path: Path) -> None:
        if (fault := self._enter("fsync_dir", (path,))) is not None:
            self._raise(fault, (path,))
        super().fsync_dir(path)

    def replace(self, src: Path, dst: Path) -> None:
        if (fault := self._enter("replace", (src, dst))) is not None:
            self._raise(fault, (src, dst))
        super().replace(src, dst)

    def exchange(self, a: Path, b: Path) -> None:
        if (fault := self._enter("exchange", (a, b))) is not None:
            self._raise(fault, (a, b))
        super().exchange(a, b)

    def symlink(self, target: str, link: Path) -> None:
        if (fault := self._enter("symlink", (link,))) is not None:
            self._raise(fault, (link,))
        super().symlink(target, link)

    def rmtree(self, path: Path) -> None:
        if (fault := self._enter("rmtree", (path,))) is not None:
            self._raise(fault, (path,))
        super().rmtree(path)

    def sleep(self, seconds: float) -> None:
        # Never sleeps: tests count the waits instead of timing them.
        self._enter("sleep", (), seconds)


class LockRecordingFileOps(FaultyFileOps):
    """:class:`FaultyFileOps` that records, for each call, whether ``root``'s sidecar lock was held.

    The lock object is the one every user of ``root`` in this process shares, so
    ``held()`` answers for the manager's, the deleter's and the writer's threads.
    """

    def __init__(self, root: Path) -> None:
        super().__init__(lock=SidecarLock(Path(root) / LOCK_NAME))
        self.root = Path(root)
