"""Many tensor archives of known shapes read with one ``preadv``, as one large sequential read.

One request per archive leaves a disk one request deep and idle while each
archive is handled: far slower than one ``readv`` of the whole file. The bytes
of an archive whose shape (:class:`~safeckpt._storage.torchsave.reader._ArchiveShape`) can be guessed go to
their places without reading its head first: its prefix and tail into small
buffers, the tensor's bytes into the destination. The guess comes from DCP's
metadata (the dtype and sizes of the saved chunk: the archive safeckpt and
``torch.save`` write for them, :func:`~safeckpt._storage.torchsave.writer.expected_shape`), or
from an archive of the same length parsed in full before. A run of
consecutive such archives then becomes one request of up to 64 MiB, which the
kernel splits and queues at once.

The guess is checked after the read, before anything is committed: the
prefix read must equal the shape's, the tail must match it but for its CRCs
(:meth:`~safeckpt._storage.torchsave.reader._ArchiveShape.matches_tail`). An archive that fails
this is read again on its own, the slow way, by the caller; the CRC32 of every
archive is checked by the caller either way.

A cold file is read with ``O_DIRECT`` where it can be
(:class:`~safeckpt._fs.direct_read.DirectFileReader`): a batch's bytes come back
staged in aligned buffers, one full buffer per request, and
:class:`ReadAhead` copies them to their places on the caller's thread while
the next requests read.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .._format.checksums import crc32
from .._fs.direct_read import ALIGN, DirectFileReader
from .torchsave.reader import _ArchiveShape, preadv_exact
from .torchsave.writer import _bytes_of

__all__ = ["Planned", "ReadAhead", "Reads", "windows"]

BATCH_BYTES = 64 << 20  # one request: the kernel splits it into the disk's largest requests
_IOV_MAX = getattr(os, "sysconf", lambda _name: 1024)("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
BATCH_ARCHIVES = max(1, min(_IOV_MAX, 1024) // 3)  # three buffers per archive


@dataclass
class Planned:
    """One archive of a known shape, and where each of its parts goes."""

    offset: int
    length: int
    items: list[Any]  # the ReadItems it feeds
    shape: _ArchiveShape
    targets: list[torch.Tensor]
    straight: bool  # the tensor's bytes go straight into ``targets[0]``
    storage: torch.Tensor | None = None  # else here, then copied
    prefix: bytearray = field(init=False)
    tail: bytearray = field(init=False)
    data: memoryview = field(init=False)

    def __post_init__(self) -> None:
        record = self.shape.record
        self.prefix = bytearray(record.start)
        self.tail = bytearray(self.length - record.start - record.size)
        if self.straight:
            self.data = _bytes_of(self.targets[0])
        else:
            self.storage = torch.empty(record.size, dtype=torch.uint8)
            self.data = _bytes_of(self.storage)

    def buffers(self) -> list[Any]:
        """Where the archive's bytes go, in file order."""
        return [self.prefix, self.data, self.tail]

    def checksum(self) -> int:
        """CRC32 of the archive's bytes as read."""
        return crc32(self.tail, crc32(self.data, crc32(self.prefix)))

    def as_guessed(self) -> bool:
        """The bytes read are laid out as the shape says (else the caller reads it again)."""
        return bytes(self.prefix) == self.shape.prefix and self.shape.matches_tail(bytes(self.tail))


class Reads(Protocol):
    """Bytes of the file to read into buffers: an archive (:class:`Planned`) or a run of them
    (:class:`~safeckpt._storage.runs.PlannedRun`)."""

    offset: int

    @property
    def length(self) -> int: ...

    def buffers(self) -> list[Any]: ...


class ReadAhead:
    """Batches of planned archives read on ``pool`` ahead of the caller, handed back in file order.

    :meth:`add` starts reading a batch; :meth:`next` waits for the oldest one
    and returns it with every byte in place. Without ``direct`` (or once it
    is refused) a batch is one ``preadv`` into its places. With ``direct`` its
    byte range is cut into windows of one staging buffer each
    (:func:`windows`), whatever the archives' sizes: every request but a
    batch's last is a full 16 MiB, where reading archive by archive gave 8 MiB
    on average and streamed a large tensor one read at a time. The reads run
    on the pool's threads, and each thread copies its window into place
    (:func:`_read_in_place`) while the caller checks what came before. At most ``direct.buffers``
    windows are read or staged at once, so that no read waits for a buffer a
    later window holds.
    """

    def __init__(self, fd: int, pool: Executor, direct: DirectFileReader | None = None) -> None:
        self._fd = fd
        self._pool = pool
        self._direct = direct
        self._batches: collections.deque[_Batch] = collections.deque()
        self._waiting: collections.deque[_Window] = collections.deque()  # not submitted yet
        self._in_flight = 0  # windows submitted and not yet copied out

    def __len__(self) -> int:
        return len(self._batches)

    def add(self, planned: Sequence[Reads]) -> None:
        """Start reading ``planned`` (consecutive archives: each starts where the one before ends)."""
        batch = _Batch(list(planned))
        if self._direct is None or self._direct.refused:
            batch.whole = self._pool.submit(preadv_exact, self._fd, _buffers(batch.planned), batch.start)
        else:
            views = [memoryview(b).cast("B") for b in _buffers(batch.planned) if len(b)]
            for start, end in windows(batch.start, batch.end, self._direct.window):
                targets, views = _cut(views, end - start)
                window = _Window(start, end - start, targets)
                batch.windows.append(window)
                self._waiting.append(window)
            self._submit()
        self._batches.append(batch)

    def next(self) -> list[Reads] | None:
        """The oldest batch, its bytes in place (None when none is left)."""
        if not self._batches:
            return None
        batch = self._batches.popleft()
        if batch.whole is not None:
            batch.whole.result()
            return batch.planned
        refused = False
        for window in batch.windows:
            self._submit()
            assert window.reading is not None  # every window before it is done: it was submitted
            if not window.reading.result():
                refused = True  # O_DIRECT refused at the first read: the whole batch is read again
            self._in_flight -= 1
        self._submit()
        if refused:
            preadv_exact(self._fd, _buffers(batch.planned), batch.start)
        return batch.planned

    def _submit(self) -> None:
        direct = self._direct
        while direct is not None and self._waiting and self._in_flight < direct.buffers:
            window = self._waiting.popleft()
            window.reading = self._pool.submit(_read_in_place, direct, window)
            self._in_flight += 1


def _read_in_place(direct: DirectFileReader, window: _Window) -> bool:
    """Read ``window`` direct and copy it into its places, on a reading thread: the copy releases the
    GIL, so it runs beside the caller's checks of the batch before instead of after them. False:
    the filesystem refused ``O_DIRECT`` (nothing was copied)."""
    staged = direct.read(window.offset, window.length)
    if staged is None:
        return False
    try:
        staged.copy_into(window.targets)
    finally:
        staged.release()
    return True


@dataclass
class _Window:
    """Bytes of a batch read with one direct request, and the views they go to."""

    offset: int
    length: int
    targets: list[memoryview]
    reading: Future[bool] | None = None  # True once read and copied into place


@dataclass
class _Batch:
    planned: list[Reads]
    whole: Future[None] | None = None  # a buffered read of all of it
    windows: list[_Window] = field(default_factory=list)

    @property
    def start(self) -> int:
        return self.planned[0].offset

    @property
    def end(self) -> int:
        return self.planned[-1].offset + self.planned[-1].length


def windows(start: int, end: int, size: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut at multiples of ``ALIGN``, each piece spanning at most ``size`` bytes
    (a multiple of ``ALIGN``) once rounded out to ``ALIGN``, all but the last exactly ``size``.

    Pieces meet at aligned offsets, so no page is read twice.
    """
    pieces: list[tuple[int, int]] = []
    base = start - start % ALIGN
    while start < end:
        cut = min(end, base + size)
        pieces.append((start, cut))
        start = base = cut
    return pieces


def _cut(views: list[memoryview], n: int) -> tuple[list[memoryview], list[memoryview]]:
    """The first ``n`` bytes of ``views`` and the rest, as views."""
    head: list[memoryview] = []
    while n:
        view = views[0]
        if len(view) <= n:
            head.append(views.pop(0))
            n -= len(view)
        else:
            head.append(view[:n])
            views[0] = view[n:]
            n = 0
    return head, views


def _buffers(planned: Sequence[Reads]) -> list[Any]:
    buffers: list[Any] = []
    for p in planned:
        buffers += p.buffers()
    return buffers
