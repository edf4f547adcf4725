"""DCP storage that moves tensor bytes once, in the format plain ``dcp.load`` reads.

DCP's ``FileSystemWriter`` writes every tensor with ``torch.save`` into the
rank's ``.distcp`` file: a small zip archive whose CRC32 miniz computes at about
1 GB/s, more CPU time than writing the bytes. Its ``FileSystemReader`` then
``torch.load``\\ s each archive into a fresh tensor through small buffered reads
and copies that into the destination: two copies of every byte.

:class:`RawFileSystemWriter` writes the same archives (``data.pkl`` pickled by
torch's own ``torch.serialization._save``, records 64-byte aligned, the version
and serialization-id records ``torch.save`` writes) straight from the tensor's
memory, with the CRC32 from zlib (four times faster than miniz's, computed a
chunk at a time just before the chunk is written, while it is in cache).
:class:`RawFileSystemReader` reads each archive front to back and each
tensor's bytes straight into the destination tensor when their layouts agree,
otherwise into one fresh buffer that it copies from, as DCP does. ``data.pkl``
is unpickled with torch's weights-only unpickler, the one
``torch.load(weights_only=True)`` uses, so nothing from the file can run code.

Whatever this module cannot do the fast way (stream transforms, the safetensors
format, a tensor of 4 GiB or more, a torch whose private serialization helpers
changed) it hands back to DCP's own code, so the on-disk format never depends
on which path ran. Checked against torch 2.13; every private helper it uses is
looked up defensively.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import logging
import os
import pickle
import queue
import secrets
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

try:  # private: the per-entry location DCP pickles into .metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
except ImportError:  # pragma: no cover - every torch >= 2.0 has them
    _StorageInfo = _StoragePrefix = None  # type: ignore[assignment,misc]

try:  # private: the pickling half of torch.save, which takes any writer with write_record()
    from torch.serialization import _save as _torch_save_records
except ImportError:  # pragma: no cover
    _torch_save_records = None  # type: ignore[assignment]

try:  # private: the unpickler torch.load(weights_only=True) uses
    from torch._weights_only_unpickler import Unpickler as _WeightsOnlyUnpickler
except ImportError:  # pragma: no cover
    _WeightsOnlyUnpickler = None  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)

__all__ = ["RawFileSystemReader", "RawFileSystemWriter", "raw_path_available"]

_SUFFIX = ".distcp"
_ALIGN = 64  # torch.save aligns every record's data to 64 bytes (so torch.load(mmap=True) works)
_ZIP32_LIMIT = 0xFFFFFFFF - (1 << 20)  # larger archives need zip64 entries: left to torch.save
_CHUNK = 1 << 20  # checksummed, then written while still in cache
_READERS = 2  # threads reading tensor bytes: a disk with one request in flight idles between them
_WINDOW = 4096  # bytes read at each end of a tensor archive: its headers, data.pkl, its directory
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


def raw_path_available() -> bool:
    """Whether the fast path works with this torch (else DCP's own code runs).

    It needs three private helpers, and a probe must show that an archive it
    writes is what ``torch.load`` reads back and what its own reader parses.
    """
    helpers = (_StorageInfo, _StoragePrefix, _torch_save_records, _WeightsOnlyUnpickler)
    return None not in helpers and _version_record() is not None


# --- writing -------------------------------------------------------------------------------


_version_lock = threading.Lock()
_version_cache: list[bytes | None] = []


def _version_record() -> bytes | None:
    """The ``version`` record ``torch.save`` writes for a tensor (None: the probe failed)."""
    with _version_lock:
        if not _version_cache:
            _version_cache.append(_probe())
        return _version_cache[0]


def _probe() -> bytes | None:
    """Learn the ``version`` record from torch itself, then round-trip one archive of ours."""
    if None in (_torch_save_records, _WeightsOnlyUnpickler):
        return None
    try:
        theirs = io.BytesIO()
        torch.save(torch.zeros(1), theirs)
        entries = _central_directory(theirs.getvalue())
        entry = next(e for name, e in entries.items() if name.endswith("/version"))
        version = theirs.getvalue()[_data_offset(theirs.getvalue(), entry) :][: entry.size]
        tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        ours = io.BytesIO()
        _ArchiveWriter(version=version).write(ours, tensor)
        if not torch.equal(torch.load(io.BytesIO(ours.getvalue()), weights_only=True), tensor):
            raise ValueError("torch.load read back other values")
        pickled = _central_directory(ours.getvalue())["archive/data.pkl"]
        layout = _read_layout(ours.getvalue()[_data_offset(ours.getvalue(), pickled) :][: pickled.size])
        if layout.tensor.shape != tensor.shape or layout.dtype != tensor.dtype:
            raise ValueError("data.pkl parsed to another layout")
        return version
    except Exception as e:  # an unexpected torch.save layout or helper signature: DCP's own path
        logger.warning("safeckpt: fast DCP storage disabled on torch %s (%s)", torch.__version__, e)
        return None


class _Records:
    """Takes the place of torch's ``PyTorchFileWriter`` in ``torch.serialization._save``."""

    def __init__(self) -> None:
        self.records: list[tuple[str, memoryview]] = []

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if isinstance(data, str):
            view = memoryview(data.encode())
        elif isinstance(data, torch.UntypedStorage):
            view = _bytes_of(torch.empty(0, dtype=torch.uint8).set_(data))
        else:
            view = memoryview(data).cast("B")
        if len(view) != nbytes:
            raise ValueError(f"record {name}: {len(view)} bytes, torch said {nbytes}")
        self.records.append((name, view))

    def write_record_metadata(self, name: str, nbytes: int) -> None:
        raise NotImplementedError("torch.serialization.skip_data() is not supported here")


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


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


class _ArchiveWriter:
    """Writes tensors as ``torch.save`` archives.

    ``data.pkl`` of a layout seen before (the layers of a model repeat their
    shapes) is reused rather than pickled again. One writer per thread.
    """

    def __init__(self, *, version: bytes | None = None) -> None:
        self._version = version
        self._pickled: dict[tuple[Any, ...], list[tuple[str, bytes | None]]] = {}

    def write(self, stream: IO[bytes], tensor: torch.Tensor) -> int:
        """Write ``tensor`` at the stream's position; return the archive's length.

        ``tensor`` must be a CPU tensor that owns its whole storage, under 4 GiB.
        """
        version = self._version or _version_record()
        assert version is not None
        serialization_id = f"{secrets.randbits(128):040d}".encode()  # 40 digits, as torch writes
        records = [*self._records(tensor), ("version", memoryview(version))]
        records.append((".data/serialization_id", memoryview(serialization_id)))
        start = stream.tell()
        entries = [_write_record(stream, start, f"archive/{name}".encode(), data) for name, data in records]
        _write_directory(stream, start, entries)
        return stream.tell() - start

    def _records(self, tensor: torch.Tensor) -> list[tuple[str, memoryview]]:
        """What ``torch.serialization._save`` writes for ``tensor``: data.pkl, markers, the storage."""
        key = _layout_key(tensor)
        cached = self._pickled.get(key) if key is not None else None
        if cached is None:
            assert _torch_save_records is not None
            recorder = _Records()
            _torch_save_records(tensor, recorder, pickle, 2, False)
            if key is not None:
                self._pickled[key] = [
                    (name, None if name.startswith("data/") else bytes(data))
                    for name, data in recorder.records
                ]
            return recorder.records
        storage = _bytes_of(torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()))
        return [(name, storage if data is None else memoryview(data)) for name, data in cached]


def _layout_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """What ``data.pkl`` of a plain dense tensor depends on; None where more may matter."""
    if (
        type(tensor) is not torch.Tensor
        or tensor.requires_grad
        or tensor.layout != torch.strided
        or tensor.is_conj()
        or tensor.is_neg()
        or any(name is not None for name in getattr(tensor, "names", ()))  # named tensors (older torch)
        or tensor.__dict__
    ):
        return None
    nbytes = tensor.untyped_storage().nbytes()
    return (tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), nbytes)


def write_tensor_archive(stream: IO[bytes], tensor: torch.Tensor) -> int:
    """Write ``tensor`` as ``torch.save`` would, at the stream's position; return the archive's length.

    ``tensor`` must be a CPU tensor that owns its whole storage, under 4 GiB, and
    :func:`raw_path_available` must be true.
    """
    return _ArchiveWriter().write(stream, tensor)


def _write_record(stream: IO[bytes], start: int, name: bytes, data: memoryview) -> _Entry:
    offset = stream.tell() - start
    extra = _padding(offset + _LOCAL.size + len(name))
    flags = _FLAGS if len(data) else _FLAGS_EMPTY
    stream.write(_LOCAL.pack(_SIG_LOCAL, 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra)))
    stream.write(name)
    stream.write(extra)
    # Checksum a chunk, then write it while it is still in cache: on a disk-bound write the
    # checksum then costs next to nothing. (A helper thread checksumming in parallel was slower
    # on 2 cores: it took the CPU the kernel's writeback needs.)
    crc = 0
    for begin in range(0, len(data), _CHUNK):
        chunk = data[begin : begin + _CHUNK]
        crc = zlib.crc32(chunk, crc)
        stream.write(chunk)
    if len(data):
        stream.write(_DESCRIPTOR.pack(_SIG_DESCRIPTOR, crc, len(data), len(data)))
    return _Entry(name, offset, len(data), crc)


def _write_directory(stream: IO[bytes], start: int, entries: Sequence[_Entry]) -> None:
    directory = stream.tell() - start
    for e in entries:
        sizes = (e.crc, e.size, e.size, len(e.name))
        stream.write(_CENTRAL.pack(_SIG_CENTRAL, 0, 0, e.flags, 0, 0, 0, *sizes, 0, 0, 0, 0, 0, e.offset))
        stream.write(e.name)
    end = stream.tell() - start
    size, n = end - directory, len(entries)
    # miniz (torch.save) always ends with a zip64 end record and its locator, then the classic one.
    stream.write(_EOCD64.pack(_SIG_EOCD64, _EOCD64.size - 12, 0x031E, 0x2D, 0, 0, n, n, size, directory))
    stream.write(_LOCATOR.pack(_SIG_LOCATOR, 0, end, 1))
    stream.write(_EOCD.pack(_SIG_EOCD, 0, 0, n, n, size, directory, 0))


class RawFileSystemWriter(FileSystemWriter):
    """A ``FileSystemWriter`` that writes tensors without ``torch.save``'s slow CRC (same files).

    Same arguments and call order as ``FileSystemWriter`` (``write_data`` on
    every rank, ``finish`` on the coordinator). Files are fsynced when
    ``sync_files`` is set; ``.metadata`` is written by DCP's own ``finish``.

    """

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if not self._fast_path_usable():
            return super().write_data(plan, planner)
        prefix = plan.storage_data.prefix
        if self.single_file_per_rank:
            buckets = _split(plan.items, max(1, self.thread_count))
        else:
            buckets = [[item] for item in plan.items]
        jobs: queue.Queue[tuple[str, list[WriteItem]]] = queue.Queue()
        for i, bucket in enumerate(buckets):
            jobs.put((f"{prefix}{i}{_SUFFIX}", bucket))
        results: list[WriteResult] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def work() -> None:
            while True:
                try:
                    file_name, items = jobs.get_nowait()
                except queue.Empty:
                    return
                try:
                    written = self._write_file(file_name, items, planner)
                except BaseException as e:
                    with lock:
                        errors.append(e)
                    return
                with lock:
                    results.extend(written)

        _run_threads(work, min(max(1, self.thread_count), len(buckets)))
        if errors:
            raise errors[0]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _fast_path_usable(self) -> bool:
        if not raw_path_available() or _StoragePrefix is None:
            return False
        if getattr(getattr(self, "transforms", None), "extensions", ()):
            return False
        fmt = getattr(self, "serialization_format", None)
        return fmt is None or getattr(fmt, "value", fmt) == "torch_save"

    def _write_file(self, file_name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        path = self.fs.concat_path(self.path, file_name)
        results = []
        with self.fs.create_stream(path, "wb") as stream:
            archives = _ArchiveWriter()
            # Byte items first, then tensors, as DCP orders them.
            for item in sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO):
                results.append(_write_item(stream, file_name, item, planner.resolve_data(item), archives))
            stream.flush()
            if self.sync_files:
                os.fsync(stream.fileno())
        return results


def _write_item(
    stream: IO[bytes], file_name: str, item: WriteItem, data: Any, archives: _ArchiveWriter
) -> WriteResult:
    offset = stream.tell()
    if item.type == WriteItemType.BYTE_IO:
        stream.write(data.getbuffer())
    else:
        tensor = data.detach().cpu()
        if tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()  # as DCP does: never save the rest of a larger storage
        if tensor.nbytes >= _ZIP32_LIMIT:
            torch.save(tensor, stream)
        else:
            archives.write(stream, tensor)
    length = stream.tell() - offset
    assert _StorageInfo is not None
    return WriteResult(
        index=item.index, size_in_bytes=length, storage_data=_StorageInfo(file_name, offset, length)
    )


def _split(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Byte items round-robin, tensors largest-first into the lightest bin (as DCP splits them)."""
    if bins == 1:
        return [list(items)]
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensor_items = [i for i in items if i.type != WriteItemType.BYTE_IO]
    for n, item in enumerate(byte_items):
        buckets[n % bins].append(item)
    for item in sorted(tensor_items, key=_item_size, reverse=True):
        lightest = sizes.index(min(sizes))
        buckets[lightest].append(item)
        sizes[lightest] += _item_size(item)
    return [b for b in buckets if b]


def _item_size(item: WriteItem) -> int:
    assert item.tensor_data is not None
    numel = 1
    for s in item.tensor_data.size:
        numel *= s
    return numel * torch.empty(0, dtype=item.tensor_data.properties.dtype).element_size()


def _run_threads(work: Callable[[], None], n: int) -> None:
    threads = [threading.Thread(target=work, name=f"safeckpt-dcp-write-{i}") for i in range(1, n)]
    for t in threads:
        t.start()
    try:
        work()
    finally:
        for t in threads:
            t.join()


# --- reading -------------------------------------------------------------------------------


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

    def __init__(self, fd: int, start: int, length: int) -> None:
        self._fd, self._start, self._length = fd, start, length
        self._head = self._pread(0, min(length, _WINDOW))
        self._members: dict[str, _Member] | None = None

    def _pread(self, offset: int, n: int) -> bytes:
        data = os.pread(self._fd, n, self._start + offset)
        if len(data) != n:
            raise EOFError("the checkpoint file is shorter than its metadata says")
        return data

    def _read(self, offset: int, n: int) -> bytes:
        if offset < 0 or offset + n > self._length:
            raise ValueError("read outside the archive")
        if offset + n <= len(self._head):
            return self._head[offset : offset + n]
        return self._pread(offset, n)

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

    def directory(self) -> dict[str, _Record]:
        """Every record, from the central directory at the archive's end."""
        if self._members is None:
            tail_at = max(0, self._length - _WINDOW)
            tail = self._pread(tail_at, self._length - tail_at)

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

    def read_into(self, record: _Record, view: memoryview) -> None:
        if len(view) != record.size or record.start + record.size > self._length:
            raise ValueError("destination size differs from the stored tensor")
        position = self._start + record.start
        while view:
            n = os.preadv(self._fd, [view], position)
            if n == 0:
                raise EOFError("the checkpoint file is shorter than its metadata says")
            view, position = view[n:], position + n


def _descriptor_size(data: bytes, start: int) -> int | None:
    """Size of the record whose data starts at ``start``, from the descriptor after it; None if unseen."""
    at = data.find(_DESCRIPTOR_SIG, start)
    while at != -1 and at + _DESCRIPTOR.size <= len(data):
        _, crc, csize, usize = _DESCRIPTOR.unpack_from(data, at)
        size = at - start
        if csize == usize == size and zlib.crc32(data[start:at]) == crc:
            return size
        at = data.find(_DESCRIPTOR_SIG, at + 1)
    return None


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
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    unpickler = _WeightsOnlyUnpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    tensor = unpickler.load()
    if not isinstance(tensor, torch.Tensor) or len(found) != 1:
        raise pickle.UnpicklingError("a DCP tensor archive holds one tensor")
    key, dtype, nbytes = found[0]
    return _Layout(tensor, key, dtype, nbytes)


class RawFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` that reads each tensor's bytes once, into the destination if it can.

    Byte items (non-tensor values) and items written with stream transforms go
    through DCP's own code (and so through the load planner's ``load_bytes``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._layouts: dict[bytes, _Layout] = {}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not raw_path_available():
            return super().read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            path = self.fs.concat_path(self.path, relative_path)
            items.sort(key=lambda i: self.storage_data[i.storage_index].offset)
            with self.fs.create_stream(path, "rb") as stream, ThreadPoolExecutor(_READERS) as pool:
                fd = _fileno(stream)
                if fd is None:
                    return super().read_data(plan, planner)
                _advise(fd, 0, 0, "POSIX_FADV_SEQUENTIAL")
                started = [(item, self._start_item(stream, fd, item, planner, pool)) for item in items]
                for item, reading in started:
                    if reading is not None:
                        target, done = reading
                        done.result()
                        planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _start_item(
        self, stream: IO[bytes], fd: int, item: ReadItem, planner: LoadPlanner, pool: ThreadPoolExecutor
    ) -> tuple[torch.Tensor, concurrent.futures.Future[None]] | None:
        """Find the item's tensor and start reading it on ``pool``; None when done already (bytes)."""
        info = self.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
            self._read_item_as_dcp(stream, item, planner)
            return None
        archive = _Archive(fd, info.offset, info.length)
        layout, record = self._locate(archive, archive.walk())
        saved = _narrow(layout.tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != saved.size():
            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {saved.size()}")
        return target, pool.submit(self._read_checked, archive, record, layout, item, target)

    def _read_checked(
        self, archive: _Archive, record: _Record, layout: _Layout, item: ReadItem, target: torch.Tensor
    ) -> None:
        """Read the tensor, then check the central directory (it follows the data) agrees."""
        self._read_tensor(archive, record, layout, item, target)
        checked_layout, checked = self._locate(archive, archive.directory())
        if (checked, checked_layout.key) != (record, layout.key):
            # The head misled the walk (it cannot happen with torch.save's archives): read again
            # from where the central directory says.
            self._read_tensor(archive, checked, checked_layout, item, target)

    def _locate(self, archive: _Archive, records: dict[str, _Record]) -> tuple[_Layout, _Record]:
        """The tensor's layout (from data.pkl) and its data record, among ``records``."""
        pickled = _named(records, "data.pkl")
        if pickled is None or pickled.size < 0:
            records = archive.directory()
            pickled = _named(records, "data.pkl")
            if pickled is None:
                raise ValueError("the tensor archive has no data.pkl")
        layout = self._layout(archive.read(pickled))
        record = _named(records, f"data/{layout.key}")
        if record is not None and record.size < 0:
            record = _Record(record.header, record.start, layout.nbytes)  # the walk stops at the tensor
        if record is None:
            record = _named(archive.directory(), f"data/{layout.key}")
        if record is None or record.size != layout.nbytes:
            raise ValueError(f"the tensor archive holds no {layout.nbytes}-byte record data/{layout.key}")
        return layout, record

    @staticmethod
    def _read_tensor(
        archive: _Archive, record: _Record, layout: _Layout, item: ReadItem, target: torch.Tensor
    ) -> None:
        saved = _narrow(layout.tensor, item.storage_offsets, item.lengths)
        if _reads_straight_into(target, saved, layout):
            archive.read_into(record, _bytes_of(target))
            return
        storage = torch.empty(record.size, dtype=torch.uint8)
        archive.read_into(record, _bytes_of(storage))
        meta = layout.tensor
        full = torch.empty(0, dtype=layout.dtype).set_(
            storage.untyped_storage(), meta.storage_offset(), meta.size(), meta.stride()
        )
        target.copy_(_narrow(full, item.storage_offsets, item.lengths))

    def _layout(self, pickled: bytes) -> _Layout:
        """:func:`_read_layout`, once per distinct ``data.pkl`` (layers repeat the same shapes)."""
        layout = self._layouts.get(pickled)
        if layout is None:
            layout = self._layouts[pickled] = _read_layout(pickled)
        return layout

    def _read_item_as_dcp(self, stream: IO[bytes], item: ReadItem, planner: LoadPlanner) -> None:
        """DCP's own handling of one item (byte items, transformed streams)."""
        one = LoadPlan([item])
        super().read_data(one, planner).wait()


def _reads_straight_into(target: torch.Tensor, saved: torch.Tensor, layout: _Layout) -> bool:
    """The stored bytes are exactly the target's bytes: same dtype, both dense, nothing narrowed."""
    full = layout.tensor
    return (
        target.device.type == "cpu"
        and target.dtype == layout.dtype
        and target.is_contiguous()
        and full.is_contiguous()
        and full.storage_offset() == 0
        and saved.size() == full.size()
        and full.numel() * full.element_size() == layout.nbytes
        and target.layout == torch.strided
        and not target.is_conj()
        and not target.is_neg()
    )


def _narrow(tensor: torch.Tensor, offsets: Iterable[int], lengths: Iterable[int]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start != 0 or length != tensor.size(dim):
            tensor = torch.narrow(tensor, dim, start, length)
    return tensor


def _fileno(stream: IO[bytes]) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def _advise(fd: int, offset: int, length: int, advice: str) -> None:
    """``posix_fadvise`` where the platform has it; a hint, so failures are ignored."""
    if hasattr(os, "posix_fadvise") and hasattr(os, advice):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, getattr(os, advice))
