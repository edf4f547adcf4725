"""Reading one tensor's ``torch.save`` archive back, record by record: its ``data.pkl`` through
torch's weights-only unpickler onto a meta tensor, its bytes straight into their destination.
The writing half is :mod:`.writer`; the zip container is :mod:`.zipformat`'s.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..._format.checksums import crc32
from ..._util import torch_private
from .zipformat import (
    _DESCRIPTOR,
    _LOCAL,
    _SIG_LOCAL,
    _descriptor_size,
    _masked,
    _Member,
    _parse_directory,
    _tail_masks,
)

# Private, through the one door (None where torch lacks it): the unpickler torch.load(weights_only=True) uses.
_WeightsOnlyUnpickler = torch_private.WeightsOnlyUnpickler

_WINDOW = 4096  # bytes read at each end of a tensor archive: its headers, data.pkl, its directory


@dataclass(frozen=True)
class _Record:
    """Where one record's data lies in its archive."""

    header: int  # offset of its local header, from the archive's start
    start: int  # offset of its data
    size: int


class _Archive:
    """One tensor's ``torch.save`` archive inside a ``.distcp`` file, read front to back.

    Its first few KiB (the local headers, ``data.pkl``) come with one ``pread``;
    the tensor's bytes go with ``preadv`` straight into their destination; the
    central directory, which follows them, is read last to check where they were.
    Reading the directory first would make every archive cost a seek to its end
    and back, which on a cold cache is a synchronous disk read per tensor.
    """

    def __init__(self, fd: int, start: int, length: int, *, head: bytes | None = None) -> None:
        self._fd, self._start, self._length = fd, start, length
        self._head = self._pread(0, min(length, _WINDOW)) if head is None else head
        self._tail: tuple[int, bytes] | None = None
        self._members: dict[str, _Member] | None = None

    @property
    def head(self) -> bytes:
        """The archive's first bytes, read already (at least its first ``_WINDOW``, or all of it)."""
        return self._head

    def set_tail(self, at: int, tail: bytes) -> None:
        """Bytes ``[at, length)`` of the archive, read already (with the tensor, in one request)."""
        if at + len(tail) != self._length:
            raise ValueError("the tail must reach the archive's end")
        self._tail = (at, tail)

    def _pread(self, offset: int, n: int) -> bytes:
        data = os.pread(self._fd, n, self._start + offset)
        if len(data) != n:
            raise EOFError("the checkpoint file is shorter than its metadata says")
        return data

    def _read(self, offset: int, n: int) -> bytes:
        if offset < 0 or offset + n > self._length:
            raise ValueError("read outside the archive")
        return self.span(offset, offset + n)

    def walk(self) -> dict[str, _Record]:
        """The records whose local headers and sizes the head shows, in order.

        A record with a data descriptor (torch.save writes all but empty ones
        so) has no size in its header: the size is the ``k`` for which a
        descriptor follows ``k`` bytes later and holds ``k`` and their CRC32.
        """
        found: dict[str, _Record] = {}
        pos, head = 0, self._head
        while pos + _LOCAL.size <= len(head):
            fields = _LOCAL.unpack_from(head, pos)
            if fields[0] != _SIG_LOCAL or fields[3] != 0:
                break
            name_end = pos + _LOCAL.size + fields[9]
            start = name_end + fields[10]
            name = head[pos + _LOCAL.size : name_end].decode("utf-8", "replace")
            size = _descriptor_size(head, start) if fields[2] & 0x08 else fields[8]
            if size is None:  # the data runs past the head: the tensor itself, or unknown
                found[name] = _Record(pos, start, -1)
                break
            found[name] = _Record(pos, start, size)
            pos = start + size + (_DESCRIPTOR.size if fields[2] & 0x08 else 0)
        return found

    def span(self, begin: int, end: int) -> bytes:
        """Bytes ``[begin, end)`` of the archive, from what was read already where possible."""
        if end <= len(self._head):
            return self._head[begin:end]
        if self._tail is not None and begin >= self._tail[0]:
            tail_at, tail = self._tail
            return tail[begin - tail_at : end - tail_at]
        return self._pread(begin, end - begin)

    def checksum(self, record: _Record, data: memoryview) -> int:
        """CRC32 of the whole archive, with ``data`` as the bytes of ``record`` (read already)."""
        crc = crc32(self.span(0, record.start))
        crc = crc32(data, crc)
        return crc32(self.span(record.start + record.size, self._length), crc)

    def directory(self) -> dict[str, _Record]:
        """Every record, from the central directory at the archive's end."""
        if self._members is None:
            if self._tail is None:
                at = max(0, self._length - _WINDOW)
                self._tail = (at, self._pread(at, self._length - at))
            tail_at, tail = self._tail

            def read(offset: int, n: int) -> bytes:
                if offset >= tail_at and offset + n <= self._length:
                    return tail[offset - tail_at : offset - tail_at + n]
                return self._read(offset, n)

            self._members = _parse_directory(read, self._length)
        return {name: self._record(m) for name, m in self._members.items() if m.method == 0}

    def _record(self, member: _Member) -> _Record:
        header = _LOCAL.unpack(self._read(member.offset, _LOCAL.size))
        if header[0] != _SIG_LOCAL:
            raise ValueError("bad local header")
        start = member.offset + _LOCAL.size + header[9] + header[10]
        if start + member.size > self._length:
            raise ValueError("zip member out of bounds")
        return _Record(member.offset, start, member.size)

    def read(self, record: _Record) -> bytes:
        return self._read(record.start, record.size)

    def shape(self, layout: _Layout, record: _Record) -> _ArchiveShape | None:
        """After :meth:`directory`: what the archives like this one share (None: not cacheable)."""
        end = record.start + record.size
        if self._members is None or self._tail is None or self._tail[0] > end:
            return None
        if record.start > len(self._head):
            return None
        tail = self.span(end, self._length)
        masks = _tail_masks(tail, self._members, end)
        if masks is None:
            return None
        prefix = self._head[: record.start]
        return _ArchiveShape(self._length, prefix, layout, record, masks, _masked(tail, masks))

    def read_into(self, record: _Record, view: memoryview) -> None:
        if len(view) != record.size or record.start + record.size > self._length:
            raise ValueError("destination size differs from the stored tensor")
        preadv_exact(self._fd, [view], self._start + record.start)


@dataclass(frozen=True)
class _ArchiveShape:
    """What every archive of one tensor layout shares, so that only the first is parsed in full.

    The bytes before the tensor's data are identical (headers, ``data.pkl``), and
    so is the tail after it except for the ranges ``masks`` covers (CRCs, and the
    ``version`` and ``serialization_id`` records' bytes, which nothing reads):
    an archive whose prefix and masked tail equal these has the same records,
    the same central directory and the same layout.
    """

    length: int
    prefix: bytes
    layout: _Layout
    record: _Record
    masks: tuple[tuple[int, int], ...]
    template: bytes  # the tail with ``masks`` zeroed

    def matches_tail(self, tail: bytes) -> bool:
        return len(tail) == len(self.template) and _masked(tail, self.masks) == self.template


def preadv_exact(fd: int, buffers: Sequence[Any], offset: int) -> None:
    """Fill every buffer from ``offset`` on, in order, with as few ``preadv`` calls as the kernel allows."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            raise EOFError("the checkpoint file is shorter than its metadata says")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]


def _named(records: dict[str, _Record], name: str) -> _Record | None:
    """The record ``<archive>/<name>`` (torch.save names the archive after the first entry)."""
    prefix = next(iter(records), "").split("/", 1)[0]
    return records.get(f"{prefix}/{name}")


@dataclass
class _Layout:
    """What ``data.pkl`` says about a tensor, without its bytes (a meta tensor)."""

    tensor: torch.Tensor  # on the meta device
    key: str
    dtype: torch.dtype
    nbytes: int

    @property
    def dense(self) -> bool:
        """The stored bytes are the whole tensor, contiguous from the storage's first byte."""
        full = self.tensor
        return (
            full.is_contiguous()
            and full.storage_offset() == 0
            and full.numel() * full.element_size() == self.nbytes
        )


def _read_layout(pickled: bytes) -> _Layout:
    """Unpickle ``data.pkl`` with torch's weights-only unpickler onto a meta storage."""
    assert _WeightsOnlyUnpickler is not None
    found: list[tuple[str, torch.dtype, int]] = []

    def persistent_load(saved_id: Any) -> Any:
        kind, storage_type, key, _location, numel = saved_id
        if kind not in ("storage", b"storage") or found:
            raise pickle.UnpicklingError("a DCP tensor archive holds exactly one storage")
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        found.append((str(key), dtype, nbytes))
        untyped = torch.UntypedStorage(nbytes, device="meta")
        return torch_private.typed_storage(untyped, dtype)

    unpickler = _WeightsOnlyUnpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = persistent_load
    tensor = unpickler.load()
    if not isinstance(tensor, torch.Tensor) or len(found) != 1:
        raise pickle.UnpicklingError("a DCP tensor archive holds one tensor")
    key, _, nbytes = found[0]
    # The tensor's dtype, not the storage's: float8 (and newer dtypes) are saved on an
    # UntypedStorage, whose bytes must be reinterpreted, never cast from uint8.
    return _Layout(tensor, key, tensor.dtype, nbytes)
