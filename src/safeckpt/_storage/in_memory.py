"""A tensor's ``torch.save`` archive that is in memory already (downloaded from object storage):
parsed where it lies, the tensor's bytes copied once, straight into their destination.

DCP's way with bytes in hand (``torch.load`` of a copy of them, then ``copy_``) moves each
tensor three times. This reads ``data.pkl`` and the central directory as the file reader does
(:mod:`.torchsave.reader`), and copies the tensor's own record into every target it feeds.
"""

from __future__ import annotations

import pickle
import struct

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from . import placement
from .torchsave.reader import _WINDOW, _Archive
from .torchsave.shapes import ArchiveShapes
from .torchsave.writer import _bytes_of, raw_path_available

_NOT_PARSED = (ValueError, EOFError, pickle.UnpicklingError, struct.error, KeyError)


class _InMemory(_Archive):
    """An archive whose every byte is in ``data``: the reads the file reader makes are slices."""

    def __init__(self, data: memoryview) -> None:
        self._data = data
        super().__init__(-1, 0, len(data), head=bytes(data[: min(len(data), _WINDOW)]))

    def _pread(self, offset: int, n: int) -> bytes:
        if offset < 0 or offset + n > len(self._data):
            raise EOFError("the tensor archive is shorter than its records say")
        return bytes(self._data[offset : offset + n])


def place_archive(
    data: memoryview, items: list[ReadItem], planner: LoadPlanner, shapes: ArchiveShapes
) -> bool:
    """Copy the tensor archived in ``data`` (checked already) into the target of each of ``items``.

    A whole tensor stored as its target holds it is one copy of its bytes; any other (a part of
    it, another dtype or layout) goes through a writable copy of the record. False, and nothing
    placed: an archive this cannot parse (torch's private helpers are missing, or it is not
    ``torch.save``'s), which the caller then loads with ``torch.load``."""
    if not raw_path_available():
        return False
    archive = _InMemory(data)
    try:  # the central directory says where the records are, never a guess from the head
        layout, record = shapes.locate(archive, archive.directory())
    except _NOT_PARSED:
        return False
    if not all(placement.fits(layout, item) for item in items):
        return False
    targets = []
    for item in items:
        target = placement.fillable(planner.resolve_tensor(item))
        wanted = placement.saved(layout, item).size()
        if target.size() != wanted:
            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {wanted}")
        targets.append(target)
    stored = data[record.start : record.start + record.size]
    whole = placement.saved(layout, items[0])
    if len(items) == 1 and placement.reads_straight_into(targets[0], whole, layout):
        if record.size:
            _bytes_of(targets[0])[:] = stored
    else:
        writable = stored if not stored.readonly else bytearray(stored)  # torch.frombuffer shares it
        empty = torch.empty(0, dtype=torch.uint8)
        storage = torch.frombuffer(writable, dtype=torch.uint8) if record.size else empty
        for item, target in zip(items, targets, strict=True):
            placement.place(storage, layout, item, target)
    for item, target in zip(items, targets, strict=True):
        planner.commit_tensor(item, target)
    return True
