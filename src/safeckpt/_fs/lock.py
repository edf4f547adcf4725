"""The sidecar lock of a checkpoint root: a thread lock plus ``flock`` on ``<root>/.lock``.

Every record write or amend, every commit and every removal attempt holds it, so
a ``safeckpt prune`` from the command line and a training job never interleave.
Within one process all users of a root share one lock object (a reentrant
thread lock and one open file), so nested acquisition by the same thread is
free and two managers on one root serialise on the thread lock first.

Guarantee: between ``acquire`` and ``release`` no other thread of this process
and no other process that uses this lock changes the root. On NFS ``flock`` is
emulated with POSIX byte-range locks by the Linux client, which still excludes
other hosts; a filesystem that supports neither makes ``acquire`` raise.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
import weakref
from pathlib import Path
from types import TracebackType

from ..errors import LockTimeoutError


class _RootLock:
    """Process-wide state for one root; shared through :func:`_root_lock`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.thread_lock = threading.RLock()
        self.depth = 0  # guarded by thread_lock
        self.owner: int | None = None
        # A box, not an attribute, so the finalizer does not keep this object alive.
        self._fd_box: list[int] = []
        weakref.finalize(self, _close_fds, self._fd_box)

    @property
    def fd(self) -> int | None:
        return self._fd_box[0] if self._fd_box else None

    def close_fd(self) -> None:
        _close_fds(self._fd_box)

    def open_fd(self) -> int:
        if not self._fd_box:
            self._fd_box.append(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644))
        return self._fd_box[0]


def _close_fds(box: list[int]) -> None:
    while box:
        # Runs at collection or exit, when the mount (NFS, FUSE) may already be gone (ENOTCONN).
        with contextlib.suppress(OSError):
            os.close(box.pop())


_registry: weakref.WeakValueDictionary[str, _RootLock] = weakref.WeakValueDictionary()
_registry_guard = threading.Lock()


def _root_lock(path: Path) -> _RootLock:
    key = os.path.realpath(path)
    with _registry_guard:
        lock = _registry.get(key)
        if lock is None:
            lock = _RootLock(Path(key))
            _registry[key] = lock
        return lock


class SidecarLock:
    """Reentrant lock of one root, across threads and processes.

    ``timeout`` bounds the wait for another process; the thread lock wait is
    bounded by the same value. Use as a context manager.
    """

    def __init__(self, lock_path: Path, *, timeout: float = 300.0) -> None:
        self._lock = _root_lock(lock_path)
        self.path = lock_path
        self.timeout = timeout

    def close(self) -> None:
        """Close the lock file if no thread holds the lock (the next acquire reopens it).

        A lock file left open keeps a `.nfsXXXX` entry alive on NFS once the root
        is removed, and makes an unmount busy.
        """
        lock = self._lock
        with lock.thread_lock:
            if lock.depth == 0:
                lock.close_fd()

    def held(self) -> bool:
        """Whether the calling thread holds this lock (for assertions and tests)."""
        return self._lock.owner == threading.get_ident() and self._lock.depth > 0

    def acquire(self) -> None:
        lock = self._lock
        deadline = time.monotonic() + self.timeout
        if not lock.thread_lock.acquire(timeout=self.timeout):
            raise self._timeout_error()
        try:
            if lock.depth == 0:
                self._flock(deadline)
                lock.owner = threading.get_ident()
            lock.depth += 1
        except BaseException:
            lock.thread_lock.release()
            raise

    def release(self) -> None:
        lock = self._lock
        if lock.owner != threading.get_ident():
            raise RuntimeError("SidecarLock released by a thread that does not hold it")
        lock.depth -= 1
        if lock.depth == 0:
            lock.owner = None
            assert lock.fd is not None
            fcntl.flock(lock.fd, fcntl.LOCK_UN)
        lock.thread_lock.release()

    def _flock(self, deadline: float) -> None:
        delay = 0.001
        while True:
            fd = self._lock.open_fd()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
            else:
                if self._names_our_file(fd):
                    return
                # The lock file was removed or replaced (the root deleted by hand): a lock on the
                # old file excludes nobody who opens the new one. Lock the file the path names.
                fcntl.flock(fd, fcntl.LOCK_UN)
                self._lock.close_fd()
                continue
            if time.monotonic() >= deadline:
                raise self._timeout_error()
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _names_our_file(self, fd: int) -> bool:
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)

    def _timeout_error(self) -> LockTimeoutError:
        return LockTimeoutError(
            f"could not take the sidecar lock {self.path} within {self.timeout:g} s: another "
            "process (a training job or a `safeckpt` command) holds it. Wait for it to finish, "
            "or raise lock_timeout if it is expected to hold the lock this long.",
            path=str(self.path),
        )

    def __enter__(self) -> SidecarLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
