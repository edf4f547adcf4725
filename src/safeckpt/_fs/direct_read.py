"""Large reads of a cold file with ``O_DIRECT``, into aligned buffers the caller copies out of.

A buffered read of a file that is not in the page cache goes through the
kernel's readahead, a few MiB ahead of the reader. A large ``O_DIRECT``
request is split by the kernel into the disk's largest requests and queued at
once, and nothing is copied into the page cache: on local NVMe that is what
reaches the device's bandwidth. On a virtual disk either can be the faster
(``benchmarks/bench_limits.py`` times both as read limits). The bytes land
in a page-aligned 16 MiB buffer from the writer's pool
(:func:`~safeckpt._fs.direct_write.take_buffer`: ``O_DIRECT`` wants aligned
addresses, offsets and lengths, and an archive's data is only 64-byte
aligned; a pooled buffer's pages are mapped already), which the caller copies
into the tensors on its own thread while the next reads run.

A file whose first bytes are already in the page cache (written without
``O_DIRECT``, read moments ago) is read the buffered way, which is then a
memory copy; so is every file where ``O_DIRECT`` is refused (at open, or
with ``EINVAL`` at the first read: FUSE, tmpfs) or turned off with
a manager's ``direct_io=False``. Which path ran never changes the bytes: the caller
checks every CRC32 either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import queue
import threading
from typing import Any, Protocol

from .direct_write import (
    _O_DIRECT,
    _REFUSED,
    BUFFER_BYTES,
    copy_bytes,
    direct_io_available,
    give_back,
    take_buffer,
)

__all__ = ["DirectFileReader", "Early", "Staged", "open_direct", "read_aligned", "reads_direct"]

ALIGN = 4096  # the largest logical block size O_DIRECT asks alignment to, on the filesystems we know
_BUFFERS = 4  # two being read, one being copied out of, one spare


class Staged:
    """The bytes ``[offset, offset + length)`` of the file, in a buffer of the reader's.

    :meth:`copy_into` hands them out; :meth:`release` gives the buffer back
    (call it once, after the last copy).
    """

    def __init__(self, reader: DirectFileReader | None, buffer: mmap.mmap, skip: int, length: int) -> None:
        self._reader = reader  # None: the buffer is someone else's, read only
        self._buffer: mmap.mmap | None = buffer
        self.view = memoryview(buffer)[skip : skip + length]

    def copy_into(self, targets: list[Any]) -> None:
        """Fill each of ``targets`` (writable buffers, in file order) with the next bytes staged."""
        outs = [memoryview(target).cast("B") for target in targets]
        total = sum(len(out) for out in outs)
        if total != len(self.view):  # checked before anything is copied
            raise ValueError(f"staged {len(self.view)} bytes, the targets hold {total}")
        position = 0
        for out in outs:
            copy_bytes(out, self.view[position : position + len(out)])
            position += len(out)

    def release(self) -> None:
        if self._buffer is not None:
            self.view.release()
            if self._reader is not None:
                self._reader._give_back(self._buffer)
            self._buffer = None


class DirectFileReader:
    """``O_DIRECT`` reads of the file open at ``fd``, each within :attr:`window` bytes once rounded out.

    :meth:`for_file` says whether to read this way at all (None: read buffered).
    :meth:`read` may be called from several threads at once (two requests in
    flight keep the disk busy while a reading thread waits for the GIL), while
    other threads copy out of what it returned before; at most :attr:`buffers`
    reads may be unreleased at once (the next read waits for one).
    """

    window = BUFFER_BYTES  # the most one read spans, its range rounded out to ALIGN at both ends
    buffers = _BUFFERS  # reads returned and not yet released, at most (one more waits)

    def __init__(self, direct_fd: int, early: Early | None = None) -> None:
        self._fd = direct_fd
        self._early = early
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._taken = 0  # buffers taken from the pool (at most self.buffers)
        self._lock = threading.Lock()
        self.refused = False  # O_DIRECT failed at the first read: the caller reads buffered from now on
        self._read_once = False

    @classmethod
    def for_file(
        cls, fd: int, probe_offset: int, early: Early | None = None, *, enabled: bool = True
    ) -> DirectFileReader | None:
        """A reader for the file open at ``fd``, or None where buffered reads are the better choice.

        None when ``O_DIRECT`` is off or missing, when the page at
        ``probe_offset`` is in the page cache already (the file is warm), or
        when the filesystem refuses ``O_DIRECT`` at open. The new descriptor
        is opened through ``/proc/self/fd``: it is the same file as ``fd``
        (checked), never whatever is at the path now. ``early``: windows of
        this file read before it was asked for (:mod:`safeckpt._storage.prefetch`),
        taken in place of reading those ranges again.
        """
        if not reads_direct(fd, probe_offset, enabled=enabled):
            return None
        direct_fd = open_direct(fd)
        return None if direct_fd is None else cls(direct_fd, early)

    def read(self, offset: int, length: int) -> Staged | None:
        """The bytes ``[offset, offset + length)``, or None if the filesystem refused (then ``refused``)."""
        if self.refused:
            return None
        start = offset - offset % ALIGN
        end = -(-(offset + length) // ALIGN) * ALIGN
        if length < 0 or offset < 0:
            raise ValueError(f"a direct read needs a non-negative offset and length, not {offset}, {length}")
        if end - start > self.window:
            raise ValueError(
                f"a direct read of {length} bytes at {offset} spans {end - start}, larger than this "
                f"reader's {self.window}"
            )
        claimed = self._early.claim(offset, offset + length) if self._early is not None else None
        if claimed is not None:  # read already: the buffer stays the early reads' (nothing to give back)
            buffer, base = claimed
            return Staged(None, buffer, offset - base, length)
        first = not self._read_once  # asked before the read: another may finish first meanwhile
        buffer = self._take()
        try:
            got = self._read_into(memoryview(buffer)[: end - start], start)
        except OSError as e:
            self._give_back(buffer)
            if e.errno in _REFUSED and first:
                self.refused = True  # open took O_DIRECT, the read did not (FUSE): buffered from now on
                return None
            raise
        except BaseException:
            self._give_back(buffer)
            raise
        self._read_once = True
        if got < offset + length - start:
            self._give_back(buffer)
            raise EOFError("the checkpoint file is shorter than its metadata says")
        return Staged(self, buffer, offset - start, length)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        while True:  # the buffers given back go to the pool; those still staged (after an error) are dropped
            try:
                give_back(self._free.get_nowait())
            except queue.Empty:
                break

    def __enter__(self) -> DirectFileReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _read_into(self, view: memoryview, offset: int) -> int:
        return read_aligned(self._fd, view, offset)

    def _take(self) -> mmap.mmap:
        with contextlib.suppress(queue.Empty):
            return self._free.get_nowait()  # a buffer given back: its pages are mapped already
        with self._lock:
            if self._taken < self.buffers:
                self._taken += 1
                return take_buffer()
        return self._free.get()

    def _give_back(self, buffer: mmap.mmap) -> None:
        self._free.put(buffer)


class Early(Protocol):
    """Windows of a file read ahead of its reader (:class:`safeckpt._storage.prefetch.EarlyReads`)."""

    def claim(self, start: int, end: int) -> tuple[mmap.mmap, int] | None:
        """A buffer holding the bytes ``[start, end)`` (read only, not the reader's to give back) and
        the file offset of its first byte, or None."""
        ...


def reads_direct(fd: int, probe_offset: int, *, enabled: bool = True) -> bool:
    """Whether the file open at ``fd`` is read with ``O_DIRECT``: ``enabled``, the platform has it,
    and the page at ``probe_offset`` is not in the page cache (a warm file is read buffered)."""
    return enabled and direct_io_available() and not _cached(fd, probe_offset)


def open_direct(fd: int) -> int | None:
    """A new ``O_DIRECT`` descriptor of the file open at ``fd``, or None where it is refused.

    Opened through ``/proc/self/fd``: the same file as ``fd`` (checked), never
    whatever is at the path now.
    """
    if not _O_DIRECT:
        return None
    try:
        direct_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | _O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return None  # refused, or no /proc: the buffered reader needs neither
    same = os.fstat(direct_fd), os.fstat(fd)
    if (same[0].st_dev, same[0].st_ino) != (same[1].st_dev, same[1].st_ino):
        os.close(direct_fd)
        return None
    return direct_fd


def read_aligned(fd: int, view: memoryview, offset: int) -> int:
    """Aligned reads into ``view`` from ``offset`` until it is full or the file ends; the bytes read."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break  # end of file: the rounded-up end lies past it
        done += n
        if done % ALIGN:
            break  # a short, unaligned read happens only at the end of the file
    return done


def _cached(fd: int, offset: int) -> bool:
    """Whether the page at ``offset`` is in the page cache, asked without reading it (``mincore``).

    A read with ``RWF_NOWAIT`` would tell as well, but it starts the kernel's
    readahead when the page is missing, so the next question gets another answer.
    Where it cannot be asked (no ``mincore``, an empty file), the answer is yes:
    buffered reads are right either way.
    """
    if _mincore is None:
        return True
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        mapped = mmap.mmap(fd, offset - start + 1, access=mmap.ACCESS_COPY, offset=start)
    except (OSError, ValueError):
        return True
    first = ctypes.c_char.from_buffer(mapped)  # mapping faults nothing in: no page is read
    try:
        pages = -(-(offset - start + 1) // mmap.PAGESIZE)
        vector = (ctypes.c_ubyte * pages)()
        if (
            _mincore(ctypes.c_void_p(ctypes.addressof(first)), ctypes.c_size_t(offset - start + 1), vector)
            != 0
        ):
            return True
        return bool(vector[pages - 1] & 1)
    finally:
        del first  # the mapping cannot close while a ctypes object points into it
        mapped.close()


def _libc_mincore() -> Any:
    try:
        function = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    function.restype = ctypes.c_int
    return function


_mincore = _libc_mincore()
