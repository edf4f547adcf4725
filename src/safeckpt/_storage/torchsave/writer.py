"""One tensor as a ``torch.save`` archive, written straight from the tensor's memory, and the
shape such an archive has (:func:`expected_shape`). Reading one back is
:mod:`.reader`'s; the zip container itself is :mod:`.zipformat`'s.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import secrets
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..._util import torch_private
from .reader import _ArchiveShape, _read_layout, _Record, _WeightsOnlyUnpickler
from .zipformat import (
    ArchiveStream,
    _central_directory,
    _data_offset,
    _data_start,
    _Entry,
    _masked,
    _Member,
    _Recording,
    _tail_masks,
    _Template,
    _write_directory,
    _write_record,
)

logger = logging.getLogger("safeckpt._storage.writer")

# Private, through the one door (None where torch lacks them): the per-entry location DCP pickles
# into .metadata, and the pickling half of torch.save, which takes any writer with write_record().
_StorageInfo = torch_private.StorageInfo
_StoragePrefix = torch_private.StoragePrefix
_torch_save_records = torch_private.torch_save_records


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
    # numpy declares ndarray.__buffer__ only for Python >= 3.12 (it has the buffer protocol)
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


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


def _write_entries(stream: ArchiveStream, records: list[tuple[str, memoryview]]) -> list[_Entry]:
    start = stream.tell()
    entries = [_write_record(stream, start, f"archive/{name}".encode(), data) for name, data in records]
    _write_directory(stream, start, entries)
    return entries


def _write_archive(stream: ArchiveStream, records: list[tuple[str, memoryview]]) -> int:
    start = stream.tell()
    _write_entries(stream, records)
    return stream.tell() - start


def _storage_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of the tensor's whole storage, which it owns (it may be strided), without a copy."""
    if tensor.is_contiguous() and tensor.storage_offset() == 0:  # its own bytes: 2 us instead of 8
        with contextlib.suppress(TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16, float8)
            # numpy declares ndarray.__buffer__ only for Python >= 3.12 (it has the buffer protocol)
            return memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]
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
    One writer per thread; its archives share one serialization id (random, 40 digits as torch
    writes: nothing reads it back but torch.load's logging), so their tails are patched once.
    """

    def __init__(self, *, version: bytes | None = None, templates: _TemplateCache | None = None) -> None:
        self._version = version or _version_record()
        self._templates = _templates if templates is None else templates
        self._serialization_id = f"{secrets.randbits(128):040d}".encode()
        self._tails: dict[_Template, bytes] = {}  # each template's tail with that id in it

    def write(self, stream: ArchiveStream, tensor: torch.Tensor) -> int:
        """Write ``tensor`` at the stream's position; return the archive's length.

        ``tensor`` must be a CPU tensor that owns its whole storage, under 4 GiB.
        """
        version = self._version
        assert version is not None
        serialization_id = self._serialization_id
        key = _layout_key(tensor)
        template = self._templates.get((key, version)) if key is not None else None
        if template is not None:
            tail = self._tails.get(template)
            if tail is None:
                tail = self._tails[template] = template.records_tail(serialization_id)
            return template.write_with(stream, _storage_bytes(tensor), tail)
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


def write_tensor_archive(stream: ArchiveStream, tensor: torch.Tensor) -> int:
    """Write ``tensor`` as ``torch.save`` would, at the stream's position; return the archive's length.

    ``tensor`` must be a CPU tensor that owns its whole storage, under 4 GiB, and
    :func:`raw_path_available` must be true.
    """
    return _ArchiveWriter().write(stream, tensor)
