"""The zip container of a ``torch.save`` archive: local headers, data descriptors, the central
directory, as miniz (``torch.save``) writes them. No tensors here, only records of bytes.

Every record's CRC32 is the zip polynomial's, computed with :mod:`safeckpt._format.checksums`'s
hardware CRC32; :class:`_ChecksummedStream` also keeps the CRC32 segments of the whole file
(one per DCP item) for the checkpoint's record, without a second pass over the data.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any, Protocol

from ..._format.checksums import SegmentRecorder, crc32

_ALIGN = 64  # torch.save aligns every record's data to 64 bytes (so torch.load(mmap=True) works)
_FLAGS = 0x0808  # sizes in a data descriptor after the data; UTF-8 names (as miniz writes)
_FLAGS_EMPTY = 0x0800  # an empty record has no data descriptor
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<IIII")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR = struct.Struct("<IIQI")
_EOCD = struct.Struct("<IHHHHIIH")
_SIG_LOCAL, _SIG_DESCRIPTOR, _SIG_CENTRAL = 0x04034B50, 0x08074B50, 0x02014B50
_SIG_EOCD64, _SIG_LOCATOR, _SIG_EOCD = 0x06064B50, 0x07064B50, 0x06054B50
_DESCRIPTOR_SIG = struct.pack("<I", _SIG_DESCRIPTOR)
_LOCAL_SIG, _CENTRAL_SIG = struct.pack("<I", _SIG_LOCAL), struct.pack("<I", _SIG_CENTRAL)
_EOCD64_SIG, _EOCD_SIG = struct.pack("<I", _SIG_EOCD64), struct.pack("<I", _SIG_EOCD)
_CHUNK = 1 << 20  # checksummed, then written while still in cache
_SMALL = 64 << 10  # smaller writes are joined into one


class ArchiveStream(Protocol):
    """What an archive is written to: a binary file, a :class:`_Recording` or a
    :class:`_ChecksummedStream`."""

    def write(self, data: Any, /) -> int: ...

    def tell(self) -> int: ...


def _padding(offset: int) -> bytes:
    """The extra field that aligns the data after a local header ending at ``offset``.

    As torch's writer does: an ``FB`` field of ``Z`` bytes, present even when no padding is needed.
    """
    pad = -(offset + 4) % _ALIGN
    return b"FB" + struct.pack("<H", pad) + b"Z" * pad


@dataclass
class _Entry:
    name: bytes
    offset: int  # of the local header, from the archive's start
    size: int
    crc: int

    @property
    def flags(self) -> int:
        return _FLAGS if self.size else _FLAGS_EMPTY


def _write_record(stream: ArchiveStream, start: int, name: bytes, data: memoryview) -> _Entry:
    offset = stream.tell() - start
    extra = _padding(offset + _LOCAL.size + len(name))
    flags = _FLAGS if len(data) else _FLAGS_EMPTY
    header = _LOCAL.pack(_SIG_LOCAL, 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra
    if len(data) < _SMALL:  # header, data and descriptor in one write
        crc = crc32(data)
        tail = _DESCRIPTOR.pack(_SIG_DESCRIPTOR, crc, len(data), len(data)) if len(data) else b""
        stream.write(b"".join((header, data, tail)))
        return _Entry(name, offset, len(data), crc)
    stream.write(header)
    crc = _write_data(stream, data)
    stream.write(_DESCRIPTOR.pack(_SIG_DESCRIPTOR, crc, len(data), len(data)))
    return _Entry(name, offset, len(data), crc)


def _write_data(stream: ArchiveStream, data: memoryview) -> int:
    """Write a record's bytes; their CRC32 (0 into a :class:`_Recording`, which keeps no large data)."""
    if len(data) < _SMALL:
        stream.write(data)
        return crc32(data)
    if isinstance(stream, _Recording):  # a template masks or patches this CRC: do not compute it
        stream.skip(len(data))
        return 0
    # Checksum a chunk, then write it while it is still in cache: on a disk-bound write the
    # checksum then costs next to nothing. (A helper thread checksumming in parallel was slower
    # on 2 cores: it took the CPU the kernel's writeback needs.)
    checked = stream if isinstance(stream, _ChecksummedStream) else None
    raw = stream.write if checked is None else checked.write_unchecksummed
    crc = 0
    for begin in range(0, len(data), _CHUNK):
        chunk = data[begin : begin + _CHUNK]
        crc = crc32(chunk, crc)
        raw(chunk)
    if checked is not None:
        checked.absorb(crc, len(data))  # the file's segment CRC, without a second pass over the data
    return crc


class _Template:
    """The bytes of an archive of records with fixed names and sizes, but for those that vary.

    Made from one archive written to a :class:`_Recording`: ``head`` is every byte before the
    record ``varying[0]``'s data (the tensor), ``tail`` every byte after it. An
    archive of the same layout is then written as ``head``, the tensor's bytes,
    and ``tail`` with the CRC32s of the tensor and of the other ``varying``
    records, and those records' bytes, patched in: three writes instead of
    fifty, and no header packed again.
    """

    def __init__(self, written: _Recording, entries: Sequence[_Entry], varying: Sequence[int]) -> None:
        data = entries[varying[0]]
        data_end = _data_start(data) + data.size
        self.head = written.span(0, _data_start(data))
        self.data_size = data.size
        self.length = written.tell()
        self._tail = written.span(data_end, self.length)
        if any(entries[i].offset < data_end for i in varying[1:]):
            raise ValueError("only records after the tensor's may vary")
        directory = _directory_offset(entries)
        self._patches: list[tuple[list[int], int | None, int]] = []  # (CRC positions, data position, size)
        for i in varying:
            entry = entries[i]
            at = [directory + sum(_CENTRAL.size + len(e.name) for e in entries[:i]) + 16 - data_end]
            if entry.size:
                at.append(_data_start(entry) + entry.size + 4 - data_end)  # its data descriptor's CRC
            position = None if i == varying[0] else _data_start(entry) - data_end
            self._patches.append((at, position, entry.size))

    def write(self, stream: ArchiveStream, data: memoryview, *records: bytes) -> int:
        """Write an archive of this layout holding ``data`` (and these varying records); its length."""
        return self.write_with(stream, data, self.records_tail(*records))

    def write_with(self, stream: ArchiveStream, data: memoryview, records_tail: bytes) -> int:
        """:meth:`write`, with the other varying records patched in already (:meth:`records_tail`)."""
        if len(data) != self.data_size:
            raise ValueError(f"a template for {self.data_size} bytes got {len(data)}")
        small = len(data) < _SMALL
        if not small:
            stream.write(self.head)
        crc = crc32(data) if small else _write_data(stream, data)
        out = bytearray(records_tail)
        for at in self._patches[0][0]:
            struct.pack_into("<I", out, at, crc)
        stream.write(b"".join((self.head, data, out)) if small else out)  # a small archive: one write
        return self.length

    def tail(self, crc: int, *records: bytes) -> bytearray:
        """The tail for a tensor of CRC32 ``crc`` and these bytes of the other varying records."""
        out = bytearray(self.records_tail(*records))
        for at in self._patches[0][0]:
            struct.pack_into("<I", out, at, crc)
        return out

    def records_tail(self, *records: bytes) -> bytes:
        """The tail with these bytes of the varying records after the tensor, and their CRC32s, in
        place; the tensor's CRC32 still to patch (a writer whose records stay the same makes it once)."""
        out = bytearray(self._tail)
        for (crc_at, position, size), data in zip(self._patches[1:], records, strict=True):
            assert position is not None
            if len(data) != size:
                raise ValueError(f"a varying record of {size} bytes got {len(data)}")
            for at in crc_at:
                struct.pack_into("<I", out, at, crc32(data))
            out[position : position + size] = data
        return bytes(out)


def _data_start(entry: _Entry) -> int:
    """Where the data of a record written by :func:`_write_record` starts, from the archive's start."""
    header_end = entry.offset + _LOCAL.size + len(entry.name)
    return header_end + len(_padding(header_end))


def _directory_offset(entries: Sequence[_Entry]) -> int:
    last = entries[-1]
    return _data_start(last) + last.size + (_DESCRIPTOR.size if last.size else 0)


class _Recording:
    """A write stream that keeps in memory what a template needs: everything written, but for
    the bytes of large records, which :func:`_write_data` only counts (:meth:`skip`)."""

    def __init__(self) -> None:
        self._parts: list[tuple[int, bytes | None, int]] = []  # (position, bytes or None, length)
        self._position = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._parts.append((self._position, bytes(view), len(view)))
        self._position += len(view)
        return len(view)

    def skip(self, n: int) -> int:
        """Count ``n`` bytes without reading them (a tensor's: nothing reads them back)."""
        self._parts.append((self._position, None, n))
        self._position += n
        return n

    def tell(self) -> int:
        return self._position

    def span(self, begin: int, end: int) -> bytes:
        """Bytes ``[begin, end)``, which must not touch a large write."""
        out = []
        for position, kept, length in self._parts:
            lo, hi = max(begin, position), min(end, position + length)
            if lo >= hi:
                continue
            if kept is None:
                raise ValueError("a template's head or tail holds part of a large record")
            out.append(kept[lo - position : hi - position])
        return b"".join(out)


class _ChecksummedStream:
    """A write stream that keeps the CRC32 segments of what passes through (one per DCP item).

    Small writes (headers, ``data.pkl``, the central directory, whole archives of
    small tensors) are joined and written together, up to ``_SMALL`` bytes: a
    cut between items checksums what is pending and leaves it pending.
    """

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._pending = bytearray()
        self._fed = 0  # bytes of _pending the recorder has seen
        self.recorder = SegmentRecorder()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= _SMALL:
            self._flush_pending()
            self.recorder.feed(view)
            return self._stream.write(view)
        self._pending += view
        if len(self._pending) >= _SMALL:
            self._flush_pending()
        return len(view)

    def write_unchecksummed(self, data: memoryview) -> int:
        """Write bytes whose CRC the caller hands to :meth:`absorb` right after."""
        self._flush_pending()
        return self._stream.write(data)

    def absorb(self, crc: int, length: int) -> None:
        self.recorder.absorb(crc, length)

    def cut(self) -> None:
        """End the current segment (one per DCP item) at the current position."""
        self._feed_pending()
        self.recorder.cut()

    def tell(self) -> int:
        return self._stream.tell() + len(self._pending)

    def flush(self) -> None:
        self._flush_pending()
        self._stream.flush()

    def _feed_pending(self) -> None:
        if self._fed < len(self._pending):
            self.recorder.feed(memoryview(self._pending)[self._fed :])
            self._fed = len(self._pending)

    def _flush_pending(self) -> None:
        if self._pending:
            self._feed_pending()
            self._stream.write(self._pending)
            self._pending = bytearray()
            self._fed = 0


def _write_directory(stream: ArchiveStream, start: int, entries: Sequence[_Entry]) -> None:
    directory = stream.tell() - start
    parts = []
    for e in entries:
        sizes = (e.crc, e.size, e.size, len(e.name))
        parts.append(_CENTRAL.pack(_SIG_CENTRAL, 0, 0, e.flags, 0, 0, 0, *sizes, 0, 0, 0, 0, 0, e.offset))
        parts.append(e.name)
    size, n = sum(map(len, parts)), len(entries)
    end = directory + size
    # miniz (torch.save) always ends with a zip64 end record and its locator, then the classic one.
    parts.append(_EOCD64.pack(_SIG_EOCD64, _EOCD64.size - 12, 0x031E, 0x2D, 0, 0, n, n, size, directory))
    parts.append(_LOCATOR.pack(_SIG_LOCATOR, 0, end, 1))
    parts.append(_EOCD.pack(_SIG_EOCD, 0, 0, n, n, size, directory, 0))
    stream.write(b"".join(parts))


@dataclass(frozen=True)
class _Member:
    offset: int  # of the local header, from the archive's start
    size: int
    method: int


def _central_directory(archive: bytes | memoryview) -> dict[str, _Member]:
    """Members of a whole archive held in memory (the version probe)."""
    return _parse_directory(lambda off, n: bytes(archive[off : off + n]), len(archive))


def _parse_directory(read: Callable[[int, int], bytes], length: int) -> dict[str, _Member]:
    """The central directory of a zip archive of ``length`` bytes, read through ``read(offset, n)``."""
    if length < _EOCD.size:
        raise ValueError("too short to be a zip archive")
    tail = read(length - _EOCD.size, _EOCD.size)
    sig, _, _, _, count, size, directory, _ = _EOCD.unpack(tail)
    if sig != _SIG_EOCD:  # a comment after the end record: torch.save never writes one
        raise ValueError("no zip end record where torch.save puts it")
    if 0xFFFF in (count,) or 0xFFFFFFFF in (size, directory):
        locator = _LOCATOR.unpack(read(length - _EOCD.size - _LOCATOR.size, _LOCATOR.size))
        if locator[0] != _SIG_LOCATOR:
            raise ValueError("zip64 locator missing")
        end64 = _EOCD64.unpack(read(locator[2], _EOCD64.size))
        if end64[0] != _SIG_EOCD64:
            raise ValueError("zip64 end record missing")
        count, size, directory = end64[7], end64[8], end64[9]
    if directory + size > length:
        raise ValueError("zip directory out of bounds")
    raw = read(directory, size)
    members: dict[str, _Member] = {}
    pos = 0
    for _ in range(count):
        fields = _CENTRAL.unpack_from(raw, pos)
        if fields[0] != _SIG_CENTRAL:
            raise ValueError("bad zip directory entry")
        method, csize, usize = fields[4], fields[8], fields[9]
        name_len, extra_len, comment_len, local = fields[10], fields[11], fields[12], fields[16]
        name = raw[pos + _CENTRAL.size : pos + _CENTRAL.size + name_len].decode("utf-8")
        extra = raw[pos + _CENTRAL.size + name_len : pos + _CENTRAL.size + name_len + extra_len]
        if 0xFFFFFFFF in (csize, usize, local):
            csize, usize, local = _zip64_sizes(extra, csize, usize, local)
        if csize != usize:
            raise ValueError(f"compressed zip member {name}")
        members[name] = _Member(local, usize, method)
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    return members


def _tail_masks(tail: bytes, members: dict[str, _Member], at: int) -> tuple[tuple[int, int], ...] | None:
    """The byte ranges of an archive's tail (from ``at``, the end of the tensor's data) that may
    differ between archives of one layout: every CRC and the data of the records after the tensor
    (``version``, ``serialization_id``). Everything else (headers, names, offsets, sizes, the
    central directory's structure) is what the reader must find identical. None: not laid out as
    ``torch.save`` lays it out (the reader then parses every such archive in full).
    """
    by_offset = {m.offset - at: m for m in members.values()}
    masks: list[tuple[int, int]] = []
    pos = 0
    if tail[:4] == _DESCRIPTOR_SIG:  # the tensor's data descriptor
        masks.append((4, 8))
        pos = _DESCRIPTOR.size
    while tail[pos : pos + 4] == _LOCAL_SIG:
        member = by_offset.get(pos)
        if member is None or pos + _LOCAL.size > len(tail):
            return None
        fields = _LOCAL.unpack_from(tail, pos)
        start = pos + _LOCAL.size + fields[9] + fields[10]
        masks.append((start, start + member.size))
        pos = start + member.size
        if fields[2] & 0x08:
            masks.append((pos + 4, pos + 8))
            pos += _DESCRIPTOR.size
    while tail[pos : pos + 4] == _CENTRAL_SIG:
        if pos + _CENTRAL.size > len(tail):
            return None
        fields = _CENTRAL.unpack_from(tail, pos)
        masks.append((pos + 16, pos + 20))
        pos += _CENTRAL.size + fields[10] + fields[11] + fields[12]
    if pos > len(tail) or tail[pos : pos + 4] not in (_EOCD64_SIG, _EOCD_SIG):
        return None
    return tuple(masks)


def _masked(tail: bytes, masks: tuple[tuple[int, int], ...]) -> bytes:
    """``tail`` with the ``masks`` ranges zeroed."""
    out = bytearray(tail)
    for begin, end in masks:
        out[begin:end] = bytes(end - begin)
    return bytes(out)


def _zip64_sizes(extra: bytes, csize: int, usize: int, local: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            values = list(struct.unpack_from(f"<{n // 8}Q", extra, pos + 4))
            if usize == 0xFFFFFFFF:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF:
                csize = values.pop(0)
            if local == 0xFFFFFFFF:
                local = values.pop(0)
            return csize, usize, local
        pos += 4 + n
    raise ValueError("zip64 sizes missing")


def _data_offset(archive: bytes | memoryview, member: _Member) -> int:
    header = _LOCAL.unpack(bytes(archive[member.offset : member.offset + _LOCAL.size]))
    return member.offset + _LOCAL.size + header[9] + header[10]


def _descriptor_size(data: bytes, start: int) -> int | None:
    """Size of the record whose data starts at ``start``, from the descriptor after it; None if unseen."""
    at = data.find(_DESCRIPTOR_SIG, start)
    while at != -1 and at + _DESCRIPTOR.size <= len(data):
        _, crc, csize, usize = _DESCRIPTOR.unpack_from(data, at)
        size = at - start
        if csize == usize == size and crc32(data[start:at]) == crc:
            return size
        at = data.find(_DESCRIPTOR_SIG, at + 1)
    return None
