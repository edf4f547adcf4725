"""Opening files of a root as untrusted input: regular files only, never a hang.

Every open here is ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat``: a
symlink, FIFO or device where a checkpoint file should be is an error, never a
hang, and a size that disagrees with what is expected is found before a byte
is read. A small file replaced by a rename on NFS is read again after ESTALE.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path
from types import TracebackType

from ..errors import IncompleteCheckpointError, UnsafeCheckpointError

READ_CHUNK = 8 << 20


def open_regular(path: Path) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading if it is a regular file (never a symlink, FIFO or device)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _not_regular(path, "a symbolic link") from e
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(path, "not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, info


class RegularFile:
    """An open regular file: opened without following a link, its size as opened."""

    def __init__(self, fd: int, size: int, *, own: bool = True) -> None:
        self._fd = fd
        self._own = own
        self.size = size

    @classmethod
    def open(cls, path: Path) -> RegularFile:
        fd, info = open_regular(path)
        return cls(fd, info.st_size)

    @classmethod
    def borrow(cls, fd: int) -> RegularFile:
        """A file the caller opened and keeps open (``close`` leaves it open): what is read is
        what the caller reads, even if its path names another file by now."""
        return cls(fd, os.fstat(fd).st_size, own=False)

    def read(self, offset: int, length: int) -> bytes:
        return read_fd(self._fd, offset, length)

    def close(self) -> None:
        if self._fd >= 0 and self._own:
            os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> RegularFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _not_regular(path: Path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path} is {what}; a checkpoint holds only regular files, so safeckpt does not read it. "
        "Restore another checkpoint, or replace the file.",
        path=str(path),
    )


def is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (lstat: a symlink to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


_STALE_WAITS = (0.01, 0.02, 0.03, 0.04)  # an NFS reader meets ESTALE only during a replacement


def read_small(path: Path, *, limit: int, what: str) -> bytes:
    """The bytes of a small regular file (a record, a pointer); larger than ``limit`` is damage.

    Such files are replaced by a rename. On NFS, a reader whose open or read
    meets the replacement gets ESTALE; the path names the new file by then, so
    it is read again (after each of ``_STALE_WAITS``; the last try's error is raised).
    """
    for wait in _STALE_WAITS:
        try:
            return _read_small_once(path, limit=limit, what=what)
        except OSError as e:
            if e.errno != errno.ESTALE:
                raise
        time.sleep(wait)
    return _read_small_once(path, limit=limit, what=what)


def _read_small_once(path: Path, *, limit: int, what: str) -> bytes:
    fd, info = open_regular(path)
    try:
        if info.st_size > limit:
            raise IncompleteCheckpointError(
                f"{path} has {info.st_size} bytes, more than any {what} has ({limit}); it is damaged "
                "or not safeckpt's. Restore another checkpoint.",
                path=str(path),
            )
        return read_fd(fd, 0, info.st_size)
    finally:
        os.close(fd)


def read_fd(fd: int, offset: int, n: int) -> bytes:
    parts = []
    while n > 0:
        chunk = os.pread(fd, min(n, READ_CHUNK), offset)
        if not chunk:
            break
        parts.append(chunk)
        offset += len(chunk)
        n -= len(chunk)
    return b"".join(parts)
