"""Checksums of checkpoint files, and reads that treat a checkpoint as untrusted input.

The checksum is CRC32 with the zip polynomial: the one every record of a
``.distcp`` archive already carries, so a save computes each byte's checksum
once. zlib-ng computes it many times faster than zlib's own; ``crc32_combine``
joins the CRC of a tensor's bytes with the CRCs of the bytes around it without
reading the tensor again.

A file's checksum is a list of segments ``(offset, length, crc)`` that cover it
from its first byte to its last. A ``.distcp`` file has one segment per DCP
item (a tensor's archive, or a byte item), so a reader verifies exactly the
items it reads; every other file has one segment.

Files are opened through :mod:`safeckpt._fs.safe_open`: a symlink, FIFO or
device in a checkpoint is an error, never a hang.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._store.base import ReadHandle
from .._store.loc import Loc
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from . import kept

try:  # hardware CRC32 (PCLMULQDQ), same values as zlib.crc32
    from zlib_ng.zlib_ng import crc32, crc32_combine
except ImportError:  # pragma: no cover - zlib-ng is a dependency; isal is as fast
    try:
        # the same functions as zlib-ng's; isal has no type information
        from isal.isal_zlib import crc32, crc32_combine  # type: ignore[no-redef]
    except ImportError:
        from zlib import crc32

        crc32_combine = None  # type: ignore[assignment]

ALGORITHM = "crc32"
READ_CHUNK = 8 << 20


def combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC of ``a + b`` from ``crc(a)``, ``crc(b)`` and ``len(b)``."""
    if crc32_combine is not None:
        return crc32_combine(crc1, crc2, len2)
    return _combine_slow(crc1, crc2, len2)  # pragma: no cover


def _gf2_times(mat: list[int], vec: int) -> int:
    total, i = 0, 0
    while vec:
        if vec & 1:
            total ^= mat[i]
        vec >>= 1
        i += 1
    return total


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _combine_slow(crc1: int, crc2: int, len2: int) -> int:
    """zlib's crc32_combine, for a Python without zlib-ng or isal."""
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]
    even = _gf2_square(odd)
    odd = _gf2_square(even)
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


@dataclass(frozen=True)
class Segment:
    offset: int
    length: int
    crc: int


@dataclass(frozen=True)
class FileChecksum:
    """Segments that cover a file of ``size`` bytes, in order, without gaps."""

    segments: tuple[Segment, ...]

    @property
    def size(self) -> int:
        return self.segments[-1].offset + self.segments[-1].length if self.segments else 0

    def to_json(self) -> dict[str, Any]:
        return {ALGORITHM: [[s.offset, s.length, s.crc] for s in self.segments]}

    @classmethod
    def whole(cls, data: bytes | memoryview) -> FileChecksum:
        return cls((Segment(0, len(data), crc32(data)),))

    @classmethod
    def from_json(cls, data: Any, *, size: int, where: str) -> FileChecksum:
        """Parse and check a record's checksum entry; it must cover exactly ``size`` bytes."""
        try:
            rows = data[ALGORITHM]
            segments = []
            position = 0
            for row in rows:
                offset, length, crc = row
                # JSON gives exact ints (a bool is not one); checked as types, one call per segment
                if type(offset) is not int or type(length) is not int or type(crc) is not int:
                    raise TypeError("segment values must be integers")
                if offset != position or length < 0 or not 0 <= crc <= 0xFFFFFFFF:
                    raise ValueError(f"segment {row} does not follow the one before it")
                segments.append(Segment(offset, length, crc))
                position += length
            if position != size:
                raise ValueError(f"the segments cover {position} bytes, the file has {size}")
        except (KeyError, TypeError, ValueError) as e:
            raise IncompleteCheckpointError(
                f"the checksums recorded for {where} are not valid ({e}); the record was damaged. "
                "Restore another checkpoint.",
                path=where,
            ) from e
        return cls(tuple(segments))

    def segment_at(self, offset: int, length: int) -> Segment | None:
        """The segment that starts at ``offset`` and is ``length`` bytes long, if there is one."""
        found = self.run_at(offset, length, 1)
        return None if found is None else found[0]

    def run_at(self, offset: int, length: int, count: int) -> tuple[Segment, ...] | None:
        """The ``count`` consecutive segments from ``offset`` on, each ``length`` bytes long, if
        the file has exactly those."""
        lo, hi = 0, len(self.segments)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.segments[mid].offset < offset:
                lo = mid + 1
            else:
                hi = mid
        found = self.segments[lo : lo + count]
        if len(found) != count:
            return None
        for i, segment in enumerate(found):
            if segment.offset != offset + i * length or segment.length != length:
                return None
        return found


class SegmentRecorder:
    """Running CRC of what a writer puts into one file, cut into one segment per item.

    ``feed`` for bytes written as they are; ``absorb`` for bytes whose CRC the
    caller computed already (a tensor's data, checksummed for its zip record).
    """

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self._start = 0
        self._length = 0
        self._crc = 0

    def feed(self, data: bytes | memoryview) -> None:
        self._crc = crc32(data, self._crc)
        self._length += len(data)

    def absorb(self, crc: int, length: int) -> None:
        self._crc = combine(self._crc, crc, length)
        self._length += length

    def cut(self) -> None:
        """End the current segment (an item is complete)."""
        self.segments.append(Segment(self._start, self._length, self._crc))
        self._start += self._length
        self._length, self._crc = 0, 0

    def result(self) -> FileChecksum:
        if self._length:
            self.cut()
        return FileChecksum(tuple(self.segments))


# --- names and opens ----------------------------------------------------------------------------


# --- verified reads -----------------------------------------------------------------------------


def corrupt(path: object, offset: int, *, step: int | None, detail: str = "") -> CorruptCheckpointError:
    where = f"step {step}, " if step is not None else ""
    return CorruptCheckpointError(
        f"{path} ({where}bytes from offset {offset}) does not match the checksum written with it"
        f"{': ' + detail if detail else ''}. The file changed after it was saved (disk or network "
        "corruption, or an edit); safeckpt never loads it. Restore another checkpoint.",
        path=str(path),
        step=step,
        offset=offset,
    )


def read_verified(path: Loc, *, size: int | None, checksum: FileChecksum | None, step: int | None) -> bytes:
    """A whole file, checked against its recorded size (before reading) and checksum; inside a
    :func:`~safeckpt._format.kept.keeping` scope, read once for the same size and checksum."""
    promise = (size, checksum)
    if checksum is not None:
        data = kept.verified_bytes(path, promise)
        if data is not None:
            return data
    data = _read_checked(path, size=size, checksum=checksum, step=step)
    if checksum is not None:
        kept.keep_bytes(path, promise, data)
    return data


def _read_checked(path: Loc, *, size: int | None, checksum: FileChecksum | None, step: int | None) -> bytes:
    with path.store.open_read(path.key) as handle:
        if size is not None and handle.size != size:
            raise IncompleteCheckpointError(
                f"{path} has {handle.size} bytes, the record says {size}: the checkpoint was "
                "damaged after it was written. Restore another one.",
                path=str(path),
                step=step,
            )
        data = handle.read(0, handle.size)
    if checksum is not None:
        view = memoryview(data)
        for segment in checksum.segments:
            if crc32(view[segment.offset : segment.offset + segment.length]) != segment.crc:
                raise corrupt(path, segment.offset, step=step)
    return data


def verify_file(
    path: Loc,
    checksum: FileChecksum,
    *,
    step: int | None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Read all of ``path`` and check every segment; raises on the first mismatch."""
    with path.store.open_read(path.key) as handle:
        verify_handle(handle, path, checksum, step=step, progress=progress)


def verify_handle(
    handle: ReadHandle,
    name: object,
    checksum: FileChecksum,
    *,
    step: int | None,
    progress: Callable[[int], None] | None = None,
    sink: Callable[[bytes], object] | None = None,
) -> None:
    """:func:`verify_file` on a file already open (``name`` is what errors call it); ``sink`` gets
    every chunk as it is read (a copy: its segment is checked when the segment ends)."""
    if handle.size != checksum.size:
        raise IncompleteCheckpointError(
            f"{name} has {handle.size} bytes, its checksums cover {checksum.size}",
            path=str(name),
            step=step,
        )
    for segment in checksum.segments:
        crc, position, left = 0, segment.offset, segment.length
        while left:
            chunk = handle.read(position, min(left, READ_CHUNK))
            if not chunk:
                raise IncompleteCheckpointError(f"{name} ended early", path=str(name), step=step)
            crc = crc32(chunk, crc)
            if sink is not None:
                sink(chunk)
            position += len(chunk)
            left -= len(chunk)
            if progress is not None:
                progress(len(chunk))
        if crc != segment.crc:
            raise corrupt(name, segment.offset, step=step)


def checksum_file(path: Loc) -> FileChecksum:
    """One segment over the whole file (files safeckpt did not write itself, e.g. ``.metadata``)."""
    with path.store.open_read(path.key) as handle:
        crc, position = 0, 0
        while position < handle.size:
            chunk = handle.read(position, min(handle.size - position, READ_CHUNK))
            if not chunk:
                break
            crc = crc32(chunk, crc)
            position += len(chunk)
    return FileChecksum((Segment(0, position, crc),))


def parse_checksums(
    raw: Mapping[str, Any] | None, files: Mapping[str, int], *, where: str
) -> dict[str, FileChecksum] | None:
    """The record's checksums, each checked against the file's recorded size (None: none recorded)."""
    if raw is None:
        return None
    return {
        name: FileChecksum.from_json(entry, size=files.get(name, -1), where=f"{where}: {name}")
        for name, entry in raw.items()
    }
