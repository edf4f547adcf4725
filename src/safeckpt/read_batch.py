"""Many tensor archives of known shapes read with one ``preadv``, as one large sequential read.

One request per archive leaves a disk one request deep and idle while each
archive is handled: on this project's disk, 2-4 MB reads ran at 1.5 GB/s
where one ``readv`` of the whole file ran at 2.3. The bytes of an archive
whose shape (:class:`~safeckpt.archive._ArchiveShape`) can be guessed go to
their places without reading its head first: its prefix and tail into small
buffers, the tensor's bytes into the destination. The guess comes from DCP's
metadata (the dtype and sizes of the saved chunk: the archive safeckpt and
``torch.save`` write for them, :func:`~safeckpt.archive.expected_shape`), or
from an archive of the same length parsed in full before. A run of
consecutive such archives then becomes one request of up to 64 MiB, which the
kernel splits and queues at once.

The guess is checked after the read, before anything is committed: the
prefix read must equal the shape's, the tail must match it but for its CRCs
(:meth:`~safeckpt.archive._ArchiveShape.matches_tail`). An archive that fails
this is read again on its own, the slow way, by the caller; the CRC32 of every
archive is checked by the caller either way.

A cold file is read with ``O_DIRECT`` where it can be
(:class:`~safeckpt.direct_read.DirectFileReader`): the batch's bytes come back
staged in an aligned buffer, and the caller copies them to their places with
:func:`place` on its own thread while the next batch is read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .archive import _ArchiveShape, _bytes_of, preadv_exact
from .direct_read import DirectFileReader, Staged
from .integrity import crc32

__all__ = ["Planned", "place", "read_all"]

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

    def checksum(self) -> int:
        """CRC32 of the archive's bytes as read."""
        return crc32(self.tail, crc32(self.data, crc32(self.prefix)))

    def as_guessed(self) -> bool:
        """The bytes read are laid out as the shape says (else the caller reads it again)."""
        return bytes(self.prefix) == self.shape.prefix and self.shape.matches_tail(bytes(self.tail))


def read_all(fd: int, planned: Sequence[Planned], direct: DirectFileReader | None = None) -> Staged | None:
    """Read consecutive ``planned`` archives (each starts where the one before ends) in one go.

    With ``direct``, the bytes are returned staged for :func:`place`; a run
    larger than ``direct``'s buffers (one large tensor) is streamed through
    them to its places here. None: the bytes are in their places (also where
    the filesystem refuses ``O_DIRECT``: they are then read buffered).
    """
    start, end = planned[0].offset, planned[-1].offset + planned[-1].length
    if direct is not None and not direct.refused:
        if end - start <= direct.capacity:
            staged = direct.read(start, end - start)
            if staged is not None:
                return staged
        elif _stream(direct, _buffers(planned), start, end):
            return None
    preadv_exact(fd, _buffers(planned), start)
    return None


def _stream(direct: DirectFileReader, buffers: list[Any], start: int, end: int) -> bool:
    """``[start, end)`` into ``buffers`` one direct read at a time; False if refused before any."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    position = start
    while position < end:
        n = min(direct.capacity, end - position)
        staged = direct.read(position, n)
        if staged is None:
            return False  # refused: only ever at the first read, so nothing was placed yet
        chunk, views = _cut(views, n)
        try:
            staged.copy_into(chunk)
        finally:
            staged.release()
        position += n
    return True


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


def place(staged: Staged, planned: Sequence[Planned]) -> None:
    """Copy what :func:`read_all` staged to each archive's buffers, then free the staging buffer."""
    try:
        staged.copy_into(_buffers(planned))
    finally:
        staged.release()


def _buffers(planned: Sequence[Planned]) -> list[Any]:
    buffers: list[Any] = []
    for p in planned:
        buffers += [p.prefix, p.data, p.tail]
    return buffers
