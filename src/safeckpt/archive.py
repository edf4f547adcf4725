"""One tensor as a ``torch.save`` archive: written straight from the tensor's memory, read back
record by record (its ``data.pkl`` through torch's weights-only unpickler, its bytes into their
destination). The zip container itself is :mod:`safeckpt.zipformat`'s.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import torch

from .integrity import crc32
from .zipformat import (
    _DESCRIPTOR,
    _LOCAL,
    _SIG_LOCAL,
    _central_directory,
    _data_offset,
    _data_start,
    _descriptor_size,
    _Entry,
    _masked,
    _Member,
    _parse_directory,
    _Recording,
    _tail_masks,
    _Template,
    _write_directory,
    _write_record,
)

logger = logging.getLogger("safeckpt.storage")

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

_WINDOW = 4096  # bytes read at each end of a tensor archive: its headers, data.pkl, its directory


def raw_path_available() -> bool:
    """Whether the fast path works with this torch (else DCP's own code runs).

    It needs three private helpers, and a probe must show that an archive it
    writes is what ``torch.load`` reads back and what its own reader parses.
    """
    helpers = (_StorageInfo, _StoragePrefix, _torch_save_records, _WeightsOnlyUnpickler)
    return None not in helpers and _version_record() is not None


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
        _ArchiveWriter(version=version, templates=_TemplateCache()).write(ours, tensor)  # torch's own path
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


def expected_shape(dtype: torch.dtype, sizes: Sequence[int]) -> _ArchiveShape | None:
    """The shape of the archive safeckpt (and ``torch.save``) writes for a contiguous tensor of
    ``dtype`` and ``sizes``, without any tensor's bytes: what a reader can guess from DCP's
    metadata alone (the guess is checked against the bytes it reads). None where it cannot say.
    """
    version = _version_record()
    if version is None:
        return None
    try:
        tensor = torch.empty(tuple(sizes), dtype=dtype)  # never touched: a recording skips its bytes
        records = [*_ArchiveWriter(templates=_TemplateCache())._records(tensor)]
    except (RuntimeError, TypeError):  # a dtype no plain tensor has (quantized: no quantizer)
        return None
    records.append(("version", memoryview(version)))
    records.append((".data/serialization_id", memoryview(b"0" * 40)))
    data = next((i for i, (name, _) in enumerate(records) if name.startswith("data/")), None)
    if data is None or _layout_key(tensor) is None:
        return None
    recording = _Recording()
    entries = _write_entries(recording, records)
    entry = entries[data]
    start = _data_start(entry)
    end = start + entry.size
    head, tail = recording.span(0, start), recording.span(end, recording.tell())
    pickled = next(e for e in entries if e.name.endswith(b"/data.pkl"))
    layout = _read_layout(head[_data_start(pickled) : _data_start(pickled) + pickled.size])
    members = {e.name.decode(): _Member(e.offset, e.size, 0) for e in entries}
    masks = _tail_masks(tail, members, end)
    if masks is None:
        return None
    record = _Record(entry.offset, start, entry.size)
    return _ArchiveShape(recording.tell(), head, layout, record, masks, _masked(tail, masks))


def _write_entries(stream: IO[bytes], records: list[tuple[str, memoryview]]) -> list[_Entry]:
    start = stream.tell()
    entries = [_write_record(stream, start, f"archive/{name}".encode(), data) for name, data in records]
    _write_directory(stream, start, entries)
    return entries


def _write_archive(stream: IO[bytes], records: list[tuple[str, memoryview]]) -> int:
    start = stream.tell()
    _write_entries(stream, records)
    return stream.tell() - start


def _storage_bytes(tensor: torch.Tensor) -> memoryview:
    return _bytes_of(torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()))


class _TemplateCache:
    """Templates by layout, shared by every writer of the process (bounded: layouts repeat)."""

    def __init__(self, limit: int = 4096) -> None:
        self._lock = threading.Lock()
        self._templates: dict[Any, _Template] = {}
        self._limit = limit

    def get(self, key: Any) -> _Template | None:
        return self._templates.get(key)

    def put(self, key: Any, template: _Template) -> None:
        with self._lock:
            if len(self._templates) >= self._limit:
                self._templates.clear()
            self._templates[key] = template


_templates = _TemplateCache()


class _ArchiveWriter:
    """Writes tensors as ``torch.save`` archives.

    The first archive of a layout (the layers of a model repeat their shapes)
    is written from the records ``torch.serialization._save`` makes; every later
    one from its :class:`_Template` (``templates``: the process's shared cache
    unless given), so ``data.pkl`` is not pickled and no header is packed again.
    One writer per thread.
    """

    def __init__(self, *, version: bytes | None = None, templates: _TemplateCache | None = None) -> None:
        self._version = version
        self._templates = _templates if templates is None else templates

    def write(self, stream: IO[bytes], tensor: torch.Tensor) -> int:
        """Write ``tensor`` at the stream's position; return the archive's length.

        ``tensor`` must be a CPU tensor that owns its whole storage, under 4 GiB.
        """
        version = self._version or _version_record()
        assert version is not None
        serialization_id = f"{secrets.randbits(128):040d}".encode()  # 40 digits, as torch writes
        key = _layout_key(tensor)
        template = self._templates.get((key, version)) if key is not None else None
        if template is not None:
            return template.write(stream, _storage_bytes(tensor), serialization_id)
        records = [*self._records(tensor), ("version", memoryview(version))]
        records.append((".data/serialization_id", memoryview(serialization_id)))
        if key is None:
            return _write_archive(stream, records)
        # The first archive of a layout: written to memory (its small parts), made a template of.
        recording = _Recording()
        entries = _write_entries(recording, records)
        varying = [i for i, (name, _) in enumerate(records) if name.startswith("data/")]
        varying.append(len(records) - 1)  # the serialization id
        template = _Template(recording, entries, varying)
        self._templates.put((key, version), template)
        return template.write(stream, _storage_bytes(tensor), serialization_id)

    def _records(self, tensor: torch.Tensor) -> list[tuple[str, memoryview]]:
        """What ``torch.serialization._save`` writes for ``tensor``: data.pkl, markers, the storage."""
        assert _torch_save_records is not None
        recorder = _Records()
        _torch_save_records(tensor, recorder, pickle, 2, False)
        return recorder.records


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
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    unpickler = _WeightsOnlyUnpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    tensor = unpickler.load()
    if not isinstance(tensor, torch.Tensor) or len(found) != 1:
        raise pickle.UnpicklingError("a DCP tensor archive holds one tensor")
    key, _, nbytes = found[0]
    # The tensor's dtype, not the storage's: float8 (and newer dtypes) are saved on an
    # UntypedStorage, whose bytes must be reinterpreted, never cast from uint8.
    return _Layout(tensor, key, tensor.dtype, nbytes)
