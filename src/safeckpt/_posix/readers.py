"""DCP storage readers for a checkpoint directory on a POSIX filesystem.

The reader checks every item it reads against the checkpoint's CRC32 segments
(:class:`~safeckpt._storage.reader.RawFileSystemReader`); DCP's ``.metadata``
comes from the caller (``metadata``), which reads it through the restricted
unpickler: this layer never unpickles anything itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

from .._storage.reader import RawFileSystemReader, for_this_load


class PosixDcpReader(RawFileSystemReader):
    """Tensors read straight into their destination, each item checked; ``.metadata`` from ``metadata()``."""

    def __init__(self, *args: Any, metadata: Callable[[], dcp_metadata.Metadata], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        return for_this_load(self._metadata(), self.load_id)


class PosixDcpOwnReader(PosixDcpReader):
    """DCP's own reader (``dcp_io="torch"``), each item's bytes checked before DCP reads them."""

    def read_data(self, plan: Any, planner: Any) -> Any:
        self.verify_items(plan.items)
        return FileSystemReader.read_data(self, plan, planner)
