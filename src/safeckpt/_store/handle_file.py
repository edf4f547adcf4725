"""A :class:`~safeckpt._store.base.ReadHandle` as a seekable binary file, for readers that want
one (``torch.load``, DCP's own reader): reads become ranged reads of the handle."""

from __future__ import annotations

import io
from typing import Any

from .base import ReadHandle


class HandleFile(io.RawIOBase):
    """Wrap in :class:`io.BufferedReader` for small reads; closing it does not close the handle."""

    def __init__(self, handle: ReadHandle) -> None:
        super().__init__()
        self._handle = handle
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._handle.size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._handle.read(self._position, len(view))
        view[: len(data)] = data
        self._position += len(data)
        return len(data)
