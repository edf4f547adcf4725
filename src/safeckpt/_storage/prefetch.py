"""A cold shard's first windows, read with ``O_DIRECT`` while the restore is still planning.

A restore reads and plans (the record, DCP's metadata,
the state's templates, DCP's load planning) before it asks for a tensor's
first byte, and the disk does nothing meanwhile. Read-ahead into the page
cache cannot help a file that is read with ``O_DIRECT`` (it would turn the
reader buffered). :class:`EarlyReads` instead reads the file's first few
16 MiB windows into pooled buffers on two threads as soon as the checkpoint is
chosen. The file's :class:`~safeckpt._fs.direct_read.DirectFileReader` copies any
range that lies inside one of them out of it (:meth:`EarlyReads.claim`)
instead of reading it again; :meth:`EarlyReads.close`, once the restore has
read, gives every buffer back.

The buffers stay the early reads' own until then, so a window can serve
several reads (a batch of small tensors ends inside one) and is given back
exactly once. Windows are found by the file's identity (device, inode, size,
mtime), never by its path, and only by the thread that started them (the
restore's own: a second restore of the same file at the same time reads for
itself). Nothing here changes what a restore reads: a window that failed, was
refused or came back short serves nothing (the reader reads the range itself
and meets the same error), and every archive's CRC32 is checked after it is
copied out, as always.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from .._format.layout import DATA_SUFFIX
from .._fs.direct_read import open_direct, read_aligned, reads_direct
from .._fs.direct_write import BUFFER_BYTES, give_back, take_buffer
from .._fs.safe_open import open_regular
from .._util.forksafe import reset_in_child

__all__ = ["EarlyReads", "advise", "lookup", "prefetch"]

PREFETCH_BYTES = 256 << 20  # what a disk reads while a restore plans: more only competes with the cache
WINDOWS = 4  # 64 MiB: about what this project's disk reads while a 1 GiB restore plans
_THREADS = 2  # two requests in flight, as the reader keeps them

_Key = tuple[int, int, int, int, int]  # device, inode, size, mtime, the thread that started them

_lock = threading.Lock()
_open: dict[_Key, EarlyReads] = {}


def _forget_in_child() -> None:
    # A forked child has none of the reading threads, and the lock may have been held by one.
    global _lock, _open
    _lock = threading.Lock()
    _open = {}


def _key(info: os.stat_result) -> _Key:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, threading.get_ident())


class EarlyReads:
    """The first ``windows`` windows of the file open at ``direct_fd`` (``O_DIRECT``), being read.

    Call rule: the thread that creates it calls :meth:`close` once, after
    every read that could claim a window has finished with it.
    """

    def __init__(self, direct_fd: int, info: os.stat_result, *, windows: int = WINDOWS) -> None:
        self._fd = direct_fd
        self.key = _key(info)
        count = min(windows, -(-info.st_size // BUFFER_BYTES))
        self._windows: dict[int, Future[tuple[mmap.mmap, int]]] = {
            k * BUFFER_BYTES: Future() for k in range(count)
        }
        self._threads: list[threading.Thread] = []
        with _lock:
            if self.key in _open:  # this thread restores the file already (it cannot): read nothing
                self._windows = {}
        try:
            for i in range(min(_THREADS, len(self._windows))):
                thread = threading.Thread(
                    target=self._read, args=(i,), name="safeckpt-early-read", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        except BaseException:
            self.close()
            raise
        if self._windows:
            reset_in_child(_forget_in_child)
            with _lock:
                _open[self.key] = self

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

    def claim(self, start: int, end: int) -> tuple[mmap.mmap, int] | None:
        """The buffer of the window that holds the bytes ``[start, end)``, once read, and the file
        offset of its first byte; None if no window holds them all or its read failed. The buffer
        stays this object's: read from it, and be done before :meth:`close`."""
        base = start - start % BUFFER_BYTES
        window = self._windows.get(base)
        if window is None or end > base + BUFFER_BYTES:
            return None
        try:
            buffer, got = window.result()
        except BaseException:  # refused, an I/O error: the reader reads the range itself
            return None
        if end > base + got:
            return None  # past the end of the file: the reader finds out itself
        return buffer, base

    def close(self) -> None:
        """Wait for the reads in flight, give every buffer back, close the file."""
        with _lock:
            if _open.get(self.key) is self:
                del _open[self.key]
        for thread in self._threads:
            thread.join()
        windows, self._windows = self._windows, {}
        for window in windows.values():
            if window.done() and window.exception() is None:
                with contextlib.suppress(Exception):  # a view left by a failed read: the buffer is dropped
                    give_back(window.result()[0])
        with contextlib.suppress(OSError):
            if self._fd >= 0:
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
    """The early reads this thread started of the file ``info`` describes, if any."""
    with _lock:
        return _open.get(_key(info))


# --- the hint, for either kind of file -----------------------------------------------------


def prefetch(
    directory: Path, rank: int, *, direct_io: bool = True, limit: int = PREFETCH_BYTES
) -> Callable[[], None]:
    """Start the disk on ``rank``'s shard file now; returns what to call once the restore has read.

    A restore spends tens of milliseconds (record, metadata, DCP's planning)
    before it reads a tensor; the disk can work meanwhile. A cold file, which
    the reader will read with ``O_DIRECT``, has its first windows read into
    pooled buffers that the reader takes (:mod:`safeckpt._storage.prefetch`;
    read-ahead into the page cache would turn the reader buffered); the
    function returned gives back what it did not take. A warm one gets
    ``POSIX_FADV_WILLNEED`` for its first ``limit`` bytes, on a thread (it may
    block while it queues the reads). A hint: a file that is missing or not
    regular is left alone, and the read that follows checks everything as always.
    """
    path = directory / f"__{rank}_0{DATA_SUFFIX}"
    try:
        fd, info = open_regular(path)
    except Exception:
        return _nothing
    try:
        direct = reads_direct(fd, 0, enabled=direct_io)  # the reader will read it with O_DIRECT: it is cold
        early = EarlyReads.start(fd, info) if direct else None  # its own O_DIRECT descriptor
    except Exception:
        os.close(fd)
        return _nothing
    if direct:
        os.close(fd)
        return _nothing if early is None else early.close

    def hint() -> None:
        try:
            advise(fd, 0, min(info.st_size, limit), "POSIX_FADV_WILLNEED")
        finally:
            os.close(fd)

    if not hasattr(os, "posix_fadvise"):
        os.close(fd)
        return _nothing
    threading.Thread(target=hint, name="safeckpt-prefetch", daemon=True).start()
    return _nothing


def _nothing() -> None:
    pass


def advise(fd: int, offset: int, length: int, advice: str) -> None:
    """``posix_fadvise`` where the platform has it; a hint, so failures are ignored."""
    if hasattr(os, "posix_fadvise") and hasattr(os, advice):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, getattr(os, advice))
