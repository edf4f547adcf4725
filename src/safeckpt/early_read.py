"""A cold shard's first windows, read with ``O_DIRECT`` while the restore is still planning.

A restore spends 25-45 ms on this project's VM (the record, DCP's metadata,
the state's templates, DCP's load planning) before it asks for a tensor's
first byte, and the disk does nothing meanwhile. Read-ahead into the page
cache cannot help a file that is read with ``O_DIRECT`` (it would turn the
reader buffered). :class:`EarlyReads` instead reads the file's first few
16 MiB windows into pooled buffers on two threads as soon as the checkpoint is
chosen; the file's :class:`~safeckpt.direct_read.DirectFileReader` then takes
each buffer (:meth:`EarlyReads.claim`) in place of reading that range itself, and
:meth:`EarlyReads.close` gives back whatever nobody took.

Windows are found by the file's identity (device, inode, size, mtime), never
by its path, so a reader of any other file never sees them. Nothing here
changes what a restore reads: a window that failed, was refused or came back
short is simply not claimed (the reader reads the range itself and meets the
same error), and every archive's CRC32 is checked after it is copied out, as always.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from concurrent.futures import Future

from .direct_io import BUFFER_BYTES, give_back, take_buffer
from .direct_read import open_direct, read_aligned

__all__ = ["EarlyReads", "lookup"]

WINDOWS = 4  # 64 MiB: about what this project's disk reads while a 1 GiB restore plans
_THREADS = 2  # two requests in flight, as the reader keeps them

FileKey = tuple[int, int, int, int]

_lock = threading.Lock()
_open: dict[FileKey, EarlyReads] = {}


def _forget_in_child() -> None:
    # A forked child has none of the reading threads, and the lock may have been held by one.
    global _lock, _open
    _lock = threading.Lock()
    _open = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def file_key(info: os.stat_result) -> FileKey:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


class EarlyReads:
    """The first ``windows`` windows of the file open at ``direct_fd`` (``O_DIRECT``), being read.

    Call rule: the creator calls :meth:`close` once, after the reads that
    could claim them are done (it waits for any read still in flight).
    """

    def __init__(self, direct_fd: int, info: os.stat_result, *, windows: int = WINDOWS) -> None:
        self._fd = direct_fd
        self.key = file_key(info)
        count = min(windows, -(-info.st_size // BUFFER_BYTES))
        self._windows: dict[int, Future[tuple[mmap.mmap, int]]] = {
            k * BUFFER_BYTES: Future() for k in range(count)
        }
        self._claimed: set[int] = set()
        self._threads = [
            threading.Thread(target=self._read, args=(i,), name="safeckpt-early-read", daemon=True)
            for i in range(min(_THREADS, count))
        ]
        with _lock:
            if self.key in _open:  # another restore of the same file is under way: it reads its own
                self._windows = {}
                self._threads = []
            else:
                _open[self.key] = self
        for thread in self._threads:
            thread.start()

    @classmethod
    def start(cls, fd: int, info: os.stat_result) -> EarlyReads | None:
        """Start reading the first windows of the regular file open at ``fd`` (``info``: its
        ``fstat``) through a new ``O_DIRECT`` descriptor; None where ``O_DIRECT`` is refused."""
        direct_fd = open_direct(fd)
        if direct_fd is None or not info.st_size:
            if direct_fd is not None:
                os.close(direct_fd)
            return None
        return cls(direct_fd, info)

    def claim(self, start: int, end: int) -> tuple[mmap.mmap, int, int] | None:
        """The buffer of the window holding ``[start, end)``, its file offset and the bytes it holds,
        once read; None if no window holds that range or its read failed. The caller owns the buffer."""
        base = start - start % BUFFER_BYTES
        with _lock:
            window = self._windows.get(base)
            if window is None or base in self._claimed or end > base + BUFFER_BYTES:
                return None
            self._claimed.add(base)
        try:
            buffer, got = window.result()
        except BaseException:
            return None
        if end > base + got:
            give_back(buffer)  # short: the file ended (or changed); the reader finds out itself
            return None
        return buffer, base, got

    def close(self) -> None:
        """Wait for the reads in flight, give back every buffer nobody claimed, close the file."""
        with _lock:
            if _open.get(self.key) is self:
                del _open[self.key]
        for thread in self._threads:
            thread.join()
        for base, window in self._windows.items():
            if base not in self._claimed:
                with contextlib.suppress(BaseException):
                    give_back(window.result()[0])
        self._claimed.update(self._windows)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = -1

    def _read(self, first: int) -> None:
        bases = list(self._windows)[first::_THREADS]
        for k, base in enumerate(bases):
            buffer = None
            try:
                buffer = take_buffer()
                got = read_aligned(self._fd, memoryview(buffer), base)
            except BaseException as e:  # refused (EINVAL), an I/O error: the reader reads it again
                if buffer is not None:
                    give_back(buffer)
                for rest in bases[k:]:
                    self._windows[rest].set_exception(e)
                return
            self._windows[base].set_result((buffer, got))


def lookup(info: os.stat_result) -> EarlyReads | None:
    """The early reads of the file ``info`` describes, if a restore started them."""
    with _lock:
        return _open.get(file_key(info))
