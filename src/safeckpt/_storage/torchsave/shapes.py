"""What each archive of a ``.distcp`` file holds, known before its bytes are read.

:class:`~safeckpt._storage.reader.RawFileSystemReader` reads an archive's prefix,
tensor and tail in one request only if it knows the archive's layout first
(:class:`~safeckpt._storage.torchsave.reader._ArchiveShape`). :class:`ArchiveShapes` is that
knowledge for one reader: the shape DCP's metadata implies (the dtype and
sizes of the saved chunk give the archive safeckpt and ``torch.save`` write
for them), the shape of the last archive of the same length parsed in full,
and each ``data.pkl`` unpickled once (layers repeat the same shapes). Every
answer is a guess the reader checks against the bytes it reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.planner import ReadItem

from .reader import _Archive, _ArchiveShape, _Layout, _named, _read_layout, _Record
from .writer import expected_shape

__all__ = ["ArchiveShapes"]

_UNSEEN: Any = object()
_PREFIX_LENGTHS = 64  # distinct prefix lengths remembered: a handful in any real file


class ArchiveShapes:
    """One reader's guesses of archive shapes, and the layouts it has parsed (not thread-safe)."""

    def __init__(self) -> None:
        self.tensors: Mapping[str, Any] = {}  # DCP's metadata of each tensor, by name
        self._layouts: dict[bytes, _Layout] = {}  # data.pkl -> its layout
        self._by_prefix: dict[int, dict[tuple[int, bytes], _ArchiveShape]] = {}  # prefix length ->
        self._by_length: dict[int, _ArchiveShape] = {}
        self._expected: dict[tuple[Any, ...], _ArchiveShape | None] = {}  # (dtype, sizes) -> shape

    def guess(self, item: ReadItem, length: int) -> _ArchiveShape | None:
        """The shape an archive of ``length`` bytes holding ``item`` most likely has (None: unknown)."""
        return self.expected(item, length) or self._by_length.get(length)

    def expected(self, item: ReadItem, length: int) -> _ArchiveShape | None:
        """The shape the archive of ``item`` has if safeckpt or torch.save wrote it, from DCP's
        metadata (dtype, the saved chunk's sizes): a guess, checked against what is read."""
        index = item.storage_index
        tensor = self.tensors.get(index.fqn)
        chunks = getattr(tensor, "chunks", None)
        if tensor is None or not chunks:
            return None
        if len(chunks) == 1:  # a whole tensor: no search (this runs for each of 10,000 small tensors)
            chunk = chunks[0] if chunks[0].offsets == index.offset else None
        else:
            chunk = next((c for c in chunks if c.offsets == index.offset), None)
        if chunk is None:
            return None
        key = (tensor.properties.dtype, chunk.sizes)  # a torch.Size hashes as the tuple it is
        shape = self._expected.get(key, _UNSEEN)
        if shape is _UNSEEN:
            shape = self._expected[key] = expected_shape(key[0], tuple(chunk.sizes))
        return shape if shape is not None and shape.length == length else None

    def known(self, length: int, head: bytes) -> _ArchiveShape | None:
        """The shape of an archive parsed before whose first bytes are these (layers repeat)."""
        for start, shapes in self._by_prefix.items():
            if start <= len(head):
                shape = shapes.get((length, head[:start]))
                if shape is not None:
                    return shape
        return None

    def remember(self, shape: _ArchiveShape | None) -> None:
        if shape is not None and len(self._by_prefix) < _PREFIX_LENGTHS:
            self._by_prefix.setdefault(len(shape.prefix), {})[(shape.length, shape.prefix)] = shape
            self._by_length[shape.length] = shape  # the guess for the next archive of this length

    def locate(self, archive: _Archive, records: dict[str, _Record]) -> tuple[_Layout, _Record]:
        """The tensor's layout (from data.pkl) and its data record, among ``records``."""
        pickled = _named(records, "data.pkl")
        if pickled is None or pickled.size < 0:
            records = archive.directory()
            pickled = _named(records, "data.pkl")
            if pickled is None:
                raise ValueError("the tensor archive has no data.pkl")
        layout = self.layout(archive.read(pickled))
        record = _named(records, f"data/{layout.key}")
        if record is not None and record.size < 0:
            record = _Record(record.header, record.start, layout.nbytes)  # the walk stops at the tensor
        if record is None:
            record = _named(archive.directory(), f"data/{layout.key}")
        if record is None or record.size != layout.nbytes:
            raise ValueError(f"the tensor archive holds no {layout.nbytes}-byte record data/{layout.key}")
        return layout, record

    def layout(self, pickled: bytes) -> _Layout:
        """:func:`_read_layout`, once per distinct ``data.pkl`` (layers repeat the same shapes)."""
        layout = self._layouts.get(pickled)
        if layout is None:
            layout = self._layouts[pickled] = _read_layout(pickled)
        return layout
