"""A write stream that moves a file's bytes to disk through aligned buffers, ``O_DIRECT`` where it can.

A buffered write copies every byte into the page cache, and the fsync that
follows then waits for the kernel's writeback of all of it, which is often
much longer than writing the same bytes with ``O_DIRECT`` (both are write
limits in ``benchmarks/bench_limits.py``). The
stream copies what it is given into page-aligned 16 MiB buffers (a memcpy,
the cheapest step) and a background thread writes each full buffer with one
``pwrite`` on an ``O_DIRECT`` descriptor while the next one fills, so the copy,
the checksums computed by the caller and the disk all overlap. What is left at
the end (less than one buffer: all of a small file) goes through an ordinary
descriptor of the same file, so no block is padded and nothing is truncated;
the two descriptors never touch the same page.

Where the filesystem refuses ``O_DIRECT`` (tmpfs, FUSE, some network
filesystems, macOS), at open or at the first write, the full buffers go
through the ordinary descriptor too: the bytes and the durability never
depend on which path ran. ``direct=False`` (a manager's ``direct_io=False``) turns it off.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .._util.forksafe import reset_in_child

__all__ = [
    "BUFFER_BYTES",
    "DirectFileWriter",
    "aligned_buffer",
    "copy_bytes",
    "direct_io_available",
    "give_back",
    "take_buffer",
]

_BUFFER = 16 << 20  # one pwrite per 16 MiB: large enough that syscalls cost nothing, page-aligned
BUFFER_BYTES = _BUFFER
_GIL_FREE = 64 << 10  # larger copies release the GIL (smaller ones: headers)
_BUFFERS = 3  # one filling, one being written, one spare so the filler never waits on a fast disk
# Free buffers kept: two files written side by side keep theirs, and so does a restore (the direct
# reader's 4 and the early reads' 4, safeckpt._storage.prefetch): 128 MiB of the process's memory.
_POOL = 8
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)

_pool_lock = threading.Lock()
_pool: list[mmap.mmap] = []  # free buffers, reused between files and by the direct reader (a first
# touch costs page faults: 40 ms per 64 MiB on this project's VM, more than reading them from disk)


def direct_io_available() -> bool:
    """Whether this platform has ``O_DIRECT`` at all (a filesystem may still refuse it)."""
    return bool(_O_DIRECT)


def aligned_buffer(size: int) -> mmap.mmap:
    """A new page-aligned buffer of ``size`` bytes, in transparent huge pages where the kernel gives them.

    The kernel builds an ``O_DIRECT`` request from physically contiguous
    memory. 4 KiB pages, scattered by a fragmented allocator, split a 16 MiB
    request into pieces of 512 KiB to 2 MiB; 2 MiB pages never give less than
    the disk's largest request, so a large transfer takes fewer requests, each
    with its fixed cost. The mapping is private: a shared anonymous one
    is shmem, whose huge pages are off by default. Where there are none
    (``MADV_HUGEPAGE`` missing or refused) it is an ordinary mapping.

    A forked child does not inherit it (``MADV_DONTFORK``): ``O_DIRECT`` into
    a private mapping while the process forks (a DataLoader starting its
    workers beside a background save) can corrupt the transfer on older
    kernels, and a copy-on-write parent would copy every page it fills next.
    """
    private = getattr(mmap, "MAP_PRIVATE", 0)  # with fileno -1, Python adds MAP_ANONYMOUS itself
    buffer = mmap.mmap(-1, size, flags=private) if private else mmap.mmap(-1, size)
    for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
        with contextlib.suppress(AttributeError, OSError):  # not on this platform: as without it
            buffer.madvise(getattr(mmap, advice))
    return buffer


def _forget_pool_in_child() -> None:
    # The child has none of the pool's memory (MADV_DONTFORK): keep the objects (closing them would
    # unmap whatever the child maps at those addresses later) and start an empty pool.
    global _pool, _pool_lock
    _orphaned.extend(_pool)
    _pool = []
    _pool_lock = threading.Lock()  # it may have been held by a thread the child does not have


_orphaned: list[mmap.mmap] = []  # a forked child's inherited pool, never touched


def take_buffer() -> mmap.mmap:
    """A page-aligned buffer of ``BUFFER_BYTES`` from the process's pool (or a new one)."""
    with _pool_lock:
        if _pool:
            return _pool.pop()
    return aligned_buffer(_BUFFER)


def give_back(buffer: mmap.mmap) -> None:
    """Return a buffer from :func:`take_buffer` (no view of it may be left)."""
    reset_in_child(_forget_pool_in_child)
    with _pool_lock:
        if len(_pool) < _POOL:
            _pool.append(buffer)
            return
    buffer.close()


class DirectFileWriter:
    """Writes a new file at ``path`` (created, truncated) from the bytes passed to :meth:`write`.

    ``tell``, ``write``, ``flush`` and ``close`` as a binary file has them;
    ``close(fsync=True)`` returns once every byte is durable. A failure of the
    background write is raised by the next ``write`` or by ``close``. Not
    thread-safe: one writer per thread, as a file object. ``direct`` says
    whether any byte went through ``O_DIRECT``.
    """

    def __init__(self, path: str | Path, *, direct: bool = True) -> None:
        self.path = Path(path)
        self._wants_direct = direct and bool(_O_DIRECT)
        self.direct = False
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _CLOEXEC, 0o644)
        self._direct_fd = -1
        self._position = 0  # bytes accepted
        self._written = 0  # file offset of the buffer being filled
        self._buffer: mmap.mmap | None = None
        self._filled = 0
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._owned: list[mmap.mmap] = []
        self._work: queue.SimpleQueue[tuple[mmap.mmap, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started with the first full buffer
        self._error: BaseException | None = None
        self._closed = False

    # --- the file interface --------------------------------------------------------------

    def tell(self) -> int:
        return self._position

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            if self._buffer is None:
                self._buffer = self._next_buffer()
            n = min(len(view), _BUFFER - self._filled)
            copy_bytes(memoryview(self._buffer)[self._filled : self._filled + n], view[:n])
            self._filled += n
            view = view[n:]
            if self._filled == _BUFFER:
                self._submit()
        self._position += total
        return total

    def flush(self) -> None:
        """Nothing to do before close: full buffers are already on their way to the disk."""
        self._raise_failure()

    def close(self, *, fsync: bool = True) -> None:
        """Write what is left, wait for the background writes, fsync (``fsync``), close."""
        self._close(complete=True, fsync=fsync)

    def abort(self) -> None:
        """Close without finishing the file and without raising (the caller has an error already)."""
        with contextlib.suppress(Exception):  # the caller's own error is the one to report
            self._close(complete=False, fsync=False)

    def __enter__(self) -> DirectFileWriter:
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def _close(self, *, complete: bool, fsync: bool) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_thread()
            if complete:
                self._raise_failure()
                if self._buffer is not None and self._filled:  # the rest: less than one buffer
                    _pwrite_all(self._fd, memoryview(self._buffer)[: self._filled], self._written, self.path)
                if fsync:
                    os.fsync(self._fd)  # the inode's data, whichever descriptor wrote it
        finally:
            self._stop_thread()
            for fd in (self._direct_fd, self._fd):
                if fd >= 0:
                    os.close(fd)
            for buffer in self._owned:  # every buffer this writer took, whichever queue holds it
                give_back(buffer)
            self._owned.clear()

    # --- buffers and the background thread -----------------------------------------------

    def _next_buffer(self) -> mmap.mmap:
        self._raise_failure()
        if len(self._owned) < _BUFFERS:
            buffer = take_buffer()
            self._owned.append(buffer)
            return buffer
        buffer = self._free.get()  # back-pressure: wait for the disk
        self._raise_failure()
        return buffer

    def _submit(self) -> None:
        assert self._buffer is not None and self._filled == _BUFFER
        if self._thread is None:
            self._thread = threading.Thread(target=self._drain, name="safeckpt-direct-write", daemon=True)
            self._thread.start()
        self._work.put((self._buffer, self._written))
        self._written += _BUFFER
        self._buffer = None
        self._filled = 0

    def _stop_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._work.put(None)
            self._thread.join()

    def _drain(self) -> None:
        while (job := self._work.get()) is not None:
            buffer, offset = job
            if self._error is None:
                try:
                    self._write_full(memoryview(buffer), offset)
                except BaseException as e:  # raised on the caller's thread
                    self._error = e
            self._free.put(buffer)

    def _write_full(self, view: memoryview, offset: int) -> None:
        """One full, aligned buffer: through ``O_DIRECT`` while the filesystem takes it."""
        if self._wants_direct and self._direct_fd < 0:
            try:
                self._direct_fd = os.open(self.path, os.O_WRONLY | _O_DIRECT | _CLOEXEC)
            except OSError as e:
                if e.errno not in _REFUSED:
                    raise
                self._wants_direct = False
        if self._direct_fd >= 0:
            try:
                _pwrite_all(self._direct_fd, view, offset, self.path)
                self.direct = True
                return
            except OSError as e:
                # Accepted at open, refused at the write (FUSE passes O_DIRECT on to the file
                # behind ours): everything goes through the ordinary descriptor from now on.
                if e.errno not in _REFUSED or self.direct:
                    raise
                os.close(self._direct_fd)
                self._direct_fd = -1
                self._wants_direct = False
        _pwrite_all(self._fd, view, offset, self.path)

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error


def copy_bytes(out: memoryview, data: memoryview) -> None:
    """``out[:] = data``, with the GIL released for a large copy (into or out of an aligned buffer).

    A slice assignment holds the GIL while it copies, and the training thread
    waits for the GIL after every step: an async save copying this way slows
    a compute loop more than buffered writes do (whose copy runs inside
    ``write``, without the GIL). numpy's copy releases it.
    """
    if len(out) < _GIL_FREE:
        out[:] = data
        return
    np.copyto(np.frombuffer(out, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8))


def _pwrite_all(fd: int, view: memoryview, offset: int, path: Path) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset}", str(path))
        view, offset = view[n:], offset + n
