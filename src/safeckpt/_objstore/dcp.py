"""DCP's storage for a checkpoint directory on an object store: the same files as on disk, every
byte checked.

Writing: DCP's writers (safeckpt's raw one, or DCP's own with ``dcp_io="torch"``)
on a :class:`ObjectFileSystem`, whose streams are multipart uploads, each part
sent with its CRC32; the raw writer checksums every item as it goes out, as on
disk. It writes a rank's tensors as up to ``max_concurrency`` objects of at
least one part each, side by side: a service serves more bandwidth from several
objects than from ranges of one, and a restore then reads each in few GETs.
``.metadata`` is written whole by DCP's ``finish``.

Reading: :class:`ObjectDcpReader` fetches the wanted ranges of every file of the
load through one window of parallel GETs (:mod:`.fetch`), checks every CRC32
segment it covers against the record's checksums before a byte reaches the
state, and hands the items to DCP's planner as DCP's own reader does.
"""

from __future__ import annotations

import bisect
import contextlib
import io
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._format.checksums import FileChecksum, corrupt, crc32
from .._storage.in_memory import place_archive
from .._storage.placement import narrow
from .._storage.reader import for_this_load
from .._storage.torchsave.shapes import ArchiveShapes
from .._storage.writer import RawFileSystemWriter
from .._store.handle_file import HandleFile
from .client import NotFound
from .fetch import Fetch
from .fetch import plan as plan_gets
from .transfer import RangeReader


class ObjectFileSystem(FileSystemBase):
    """DCP's file operations on one bucket; DCP's paths are object keys."""

    def __init__(self, store: Any) -> None:
        self.store = store

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        key = str(path)
        if mode == "wb":
            stream = self.store.upload(key)
            try:
                yield stream
            except BaseException:
                stream.abort()
                raise
            stream.close()
        elif mode == "rb":
            settings = self.store.settings
            reader = RangeReader(
                self.store.client, key, part_size=settings.part_size, concurrency=settings.max_concurrency
            )
            yield io.BufferedReader(HandleFile(reader), buffer_size=1 << 20)
        else:
            raise ValueError(f"unsupported mode {mode!r}")

    def concat_path(self, path: Any, suffix: str) -> str:
        return self.store.aliases.spread.key(f"{path}/{suffix}")  # a save's data files are spread

    def rename(self, path: Any, new_path: Any) -> None:
        got = self.store.client.get(str(path))
        self.store.client.put(str(new_path), got.data)
        self.store.client.delete(str(path))

    def init_path(self, path: Any) -> str:
        return str(path)

    def mkdir(self, path: Any) -> None:
        pass  # prefixes need no making

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # chosen by the store, never from a checkpoint id

    def exists(self, path: Any) -> bool:
        try:
            self.store.client.head(str(path))
        except NotFound:
            return False
        return True

    def rm_file(self, path: Any) -> None:
        self.store.client.delete(str(path))


class _RawWriter(RawFileSystemWriter):
    def __init__(self, store: Any, base: str, reuse: Any = None, share: Any = None) -> None:
        # sync_files off: an object is durable once its upload completes (no fsync, no os.sync()).
        super().__init__(
            base,
            direct_io=False,
            reuse=reuse,
            share=share,
            sync_files=False,
            single_file_per_rank=True,
            thread_count=store.settings.max_concurrency,
            min_file_bytes=store.settings.part_size,
        )
        self.fs = ObjectFileSystem(store)  # type: ignore[assignment]  # DCP types it as its local one
        self._objects = store
        self.path = base

    def _data_stream(self, path: Any) -> Any:
        return self._objects.upload(str(path))


class _TorchWriter(FileSystemWriter):
    def __init__(self, store: Any, base: str) -> None:
        super().__init__(base, sync_files=False, single_file_per_rank=True, thread_count=1)
        self.fs = ObjectFileSystem(store)  # type: ignore[assignment]  # DCP types it as its local one
        self.path = base


def writer(store: Any, base: str, *, dcp_own: bool, reuse: Any = None, share: Any = None) -> Any:
    """DCP's storage writer for the directory at key prefix ``base``; ``reuse``: see
    :class:`safeckpt._storage.reuse.Reuse` (untrained tensors in files of their own)."""
    return _TorchWriter(store, base) if dcp_own else _RawWriter(store, base, reuse, share)


class ObjectDcpReader(FileSystemReader):
    """Every item checked against ``checksums`` (None: not checked); ``.metadata`` from ``metadata()``."""

    def __init__(
        self,
        store: Any,
        base: str,
        *,
        checksums: Mapping[str, FileChecksum] | None,
        step: int | None,
        metadata: Callable[[], dcp_metadata.Metadata],
        directory: str | None = None,
        keys: Mapping[str, str] | None = None,
    ) -> None:
        """``keys``: the object key of each file read elsewhere than under ``base`` (a file this
        checkpoint shares with an earlier one: in the area that first wrote it)."""
        super().__init__(base)
        self._keys = dict(keys or {})
        self.fs = ObjectFileSystem(store)  # type: ignore[assignment]  # DCP types it as its local one
        self.path = base
        self._store = store
        self._checksums = checksums
        self._step = step
        self._metadata = metadata
        self._shown = str(store.where(directory)) if directory is not None else base
        self._shapes = ArchiveShapes()  # data.pkl -> layout, parsed once per distinct one

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        return for_this_load(self._metadata(), self.load_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        # Every file's GETs planned as one list and fetched through one window (see .fetch):
        # placing one item overlaps the GETs of the next, across files.
        files = [self._file(name, items) for name, items in per_file.items()]
        settings = self._store.settings
        gets = plan_gets(
            [(f.key, f.spans) for f in files],
            part_size=settings.part_size,
            concurrency=settings.max_concurrency,
        )
        window = 2 * settings.max_concurrency
        with Fetch(self._store.client, gets, concurrency=settings.max_concurrency, window=window) as fetch:
            for f in files:
                self._place(f, fetch, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _file(self, name: str, items: list[ReadItem]) -> _File:
        key = self._keys.get(name) or str(self.fs.concat_path(self.path, name))
        shown = f"{self._shown}/{name}"  # how errors name the file: as the user names the checkpoint
        checksum = None if self._checksums is None else self._checksums.get(name)
        segments = None if checksum is None else _Segments(checksum, shown, self._step)
        spans = []  # (start, end) of each item, widened to the checksum segments it touches
        for item in items:
            info = self.storage_data[item.storage_index]
            start, end = info.offset, info.offset + info.length
            spans.append((start, end) if segments is None else segments.cover(start, end))
        order = sorted(range(len(items)), key=lambda i: spans[i])  # in offset order, as fetched
        return _File(key, [items[i] for i in order], [spans[i] for i in order], segments)

    def _place(self, file: _File, fetch: Fetch, planner: LoadPlanner) -> None:
        for item, (start, end) in zip(file.items, file.spans, strict=True):
            data = fetch.wait(file.key, start, end)
            if file.segments is not None:
                file.segments.verify(start, data)
            info = self.storage_data[item.storage_index]
            view = data[info.offset - start : info.offset - start + info.length]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(view))
            elif not place_archive(view, [item], planner, self._shapes):
                self._load_as_dcp_does(item, view, planner)

    def _load_as_dcp_does(self, item: ReadItem, view: memoryview, planner: LoadPlanner) -> None:
        tensor = torch.load(io.BytesIO(view), map_location="cpu", weights_only=True)
        tensor = narrow(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"{item.storage_index}: sizes {target.size()} and {tensor.size()} differ")
        target.copy_(tensor)
        planner.commit_tensor(item, target)


class _File(NamedTuple):
    """One file of a load: its object, its items and their spans in offset order, its checksums."""

    key: str
    items: list[ReadItem]
    spans: list[tuple[int, int]]
    segments: _Segments | None


class _Segments:
    """One file's CRC32 segments (in offset order, back to back), found by bisection."""

    def __init__(self, checksum: FileChecksum, shown: str, step: int | None) -> None:
        self._segments = sorted(checksum.segments, key=lambda s: s.offset)
        self._offsets = [s.offset for s in self._segments]
        self._shown = shown
        self._step = step

    def _range(self, start: int, end: int) -> tuple[int, int]:
        """Indices ``[i, j)`` of the segments that overlap ``[start, end)``."""
        i = max(0, bisect.bisect_right(self._offsets, start) - 1)
        j = bisect.bisect_left(self._offsets, end)
        return i, j

    def cover(self, start: int, end: int) -> tuple[int, int]:
        """``[start, end)`` widened to whole segments; a range they do not cover is damage."""
        i, j = self._range(start, end)
        found = self._segments[i:j]
        if not found or found[0].offset > start or found[-1].offset + found[-1].length < end:
            raise corrupt(self._shown, start, step=self._step)
        return found[0].offset, found[-1].offset + found[-1].length

    def verify(self, start: int, data: memoryview) -> None:
        i, j = self._range(start, start + len(data))
        for segment in self._segments[i:j]:
            part = data[segment.offset - start : segment.offset - start + segment.length]
            if len(part) != segment.length or crc32(part) != segment.crc:
                raise corrupt(self._shown, segment.offset, step=self._step)
