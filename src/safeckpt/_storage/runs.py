"""Runs of small tensor archives of one shape, read into one buffer and checked and copied together.

A state of 10,000 small tensors is 10,000 archives of a few KiB each. Handled
one by one (:class:`~safeckpt._storage.batching.Planned`: three buffers, a prefix and
a tail compared, a copy), Python spends many times longer on each than
the disk needs to read it. Consecutive archives of one length whose shape is
known (:class:`~safeckpt._storage.torchsave.reader._ArchiveShape`) are instead read into one
buffer, one row per archive, and handled with a few torch calls per run: the
prefix and the masked tail of every row compared at once, the tensors' bytes
gathered and copied into their targets with one ``_foreach_copy_``. Only the
CRC32 of each archive (checked by the caller against its recorded segment)
is still a call per archive.

A row that is not laid out as the shape says is left to the caller, which
reads that archive again on its own and parses it in full, as for a wrong
guess in :mod:`safeckpt._storage.batching`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from .._format.checksums import crc32
from .._util.torch_private import foreach_copy_
from .torchsave.reader import _ArchiveShape, _Layout

__all__ = ["RUN_ARCHIVE_BYTES", "RUN_BYTES", "RUN_MIN", "PlannedRun", "runs_as"]

# Larger archives are read straight into their targets: their copy, not the work per archive, costs.
RUN_ARCHIVE_BYTES = 64 << 10
RUN_BYTES = 8 << 20  # one run; the next ones read while it is checked
# Fewer archives are handled one by one: a run's few torch calls cost what about that many archives
# cost alone, and a batch of large archives is not cut short for a pair of layer norms.
RUN_MIN = 8


@dataclass
class PlannedRun:
    """Consecutive archives of ``shape``, each feeding the whole of one target, read as one buffer."""

    offset: int  # of the first archive
    shape: _ArchiveShape
    items: list[Any]  # one ReadItem per archive, in file order
    targets: list[torch.Tensor]  # each of the shape's sizes
    buffer: torch.Tensor = field(init=False)  # uint8, one row of shape.length bytes per archive

    def __post_init__(self) -> None:
        self.buffer = torch.empty(len(self.items) * self.shape.length, dtype=torch.uint8)

    @property
    def archive_length(self) -> int:
        return self.shape.length

    @property
    def length(self) -> int:
        return len(self.items) * self.shape.length

    def buffers(self) -> list[Any]:
        return [self.buffer.numpy()]

    def rows(self) -> torch.Tensor:
        return self.buffer.view(len(self.items), self.shape.length)

    def as_guessed(self) -> list[bool]:
        """For each archive: its bytes as read are laid out as the shape says."""
        prefix, template, masked = _patterns(self.shape)
        rows = self.rows()
        start = len(self.shape.prefix)
        tail = start + self.shape.record.size
        same = (rows[:, :start] == prefix).all(dim=1)
        same &= ((rows[:, tail:] == template) | masked).all(dim=1)
        return same.tolist()

    def checksums(self) -> list[int]:
        """The CRC32 of each archive's bytes as read."""
        # numpy declares ndarray.__buffer__ only for Python >= 3.12 (it has the buffer protocol)
        view = memoryview(self.buffer.numpy())  # type: ignore[arg-type]
        n = self.shape.length
        return [crc32(view[i : i + n]) for i in range(0, len(view), n)]

    def copy_out(self, guessed: list[bool]) -> None:
        """Copy each archive's tensor into its target, for the archives whose ``guessed`` is true."""
        layout = self.shape.layout
        start = len(self.shape.prefix)
        data = self.rows()[:, start : start + self.shape.record.size]
        targets = self.targets
        if not all(guessed):
            keep = [i for i, ok in enumerate(guessed) if ok]
            data = data[keep]
            targets = [targets[i] for i in keep]
        if targets:
            # Views made outside autograd's tracking: 1 us each instead of 5.
            with torch.inference_mode():
                saved = data.contiguous().view(layout.dtype).view(len(targets), *layout.tensor.size())
                foreach_copy_(targets, list(saved.unbind(0)))


def runs_as(layout: _Layout) -> bool:
    """Whether archives of ``layout`` can go in a run: a dense tensor whose bytes are all stored."""
    return layout.dense and _viewable(layout.dtype)


@functools.cache
def _viewable(dtype: torch.dtype) -> bool:
    """Bytes can be viewed as ``dtype`` (``Tensor.view(dtype)`` takes it)."""
    try:
        torch.empty(8, dtype=torch.uint8).view(dtype)
    except (RuntimeError, TypeError):
        return False
    return True


def _patterns(shape: _ArchiveShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shape's prefix and tail template as tensors, and which tail bytes the comparison ignores.

    Made again for each run (two small copies): a shape holds a tensor, so it cannot key a cache.
    """
    prefix = torch.frombuffer(bytearray(shape.prefix), dtype=torch.uint8) if shape.prefix else _EMPTY
    template = torch.frombuffer(bytearray(shape.template), dtype=torch.uint8) if shape.template else _EMPTY
    masked = torch.zeros(len(shape.template), dtype=torch.bool)
    for begin, end in shape.masks:
        masked[begin:end] = True
    return prefix, template, masked


_EMPTY = torch.empty(0, dtype=torch.uint8)
