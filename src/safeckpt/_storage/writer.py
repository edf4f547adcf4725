"""DCP storage that moves tensor bytes once, in the format plain ``dcp.load`` reads.

DCP's ``FileSystemWriter`` writes every tensor with ``torch.save`` into the
rank's ``.distcp`` file: a small zip archive whose CRC32 miniz computes slowly,
more CPU time than writing the bytes. Its ``FileSystemReader`` then
``torch.load``\\ s each archive into a fresh tensor through small buffered reads
and copies that into the destination: two copies of every byte.

:class:`RawFileSystemWriter` writes the same archives (``data.pkl`` pickled by
torch's own ``torch.serialization._save``, records 64-byte aligned, the version
and serialization-id records ``torch.save`` writes) straight from the tensor's
memory, with the CRC32 from zlib-ng computed a chunk at a time just before the
chunk is written, while it is in cache. Archives of a layout seen before are
written from a template of the first (:class:`~safeckpt._storage.torchsave.zipformat._Template`),
and the file goes to disk through :class:`~safeckpt._fs.direct_write.DirectFileWriter`
(aligned buffers, ``O_DIRECT`` where the filesystem takes it). Reading them
back is :class:`~safeckpt._storage.reader.RawFileSystemReader`'s (also importable
from here).

Whatever this module cannot do the fast way (stream transforms, the safetensors
format, a tensor of 4 GiB or more, a torch whose private serialization helpers
changed) it hands back to DCP's own code, so the on-disk format never depends
on which path ran. Checked against torch 2.13; every private helper it uses is
looked up defensively.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._format.checksums import FileChecksum
from .._format.content_digest import as_archived, digest
from .._format.contents import FileContents, ItemDigest
from .._format.layout import DATA_SUFFIX
from .._fs.direct_write import DirectFileWriter
from ..errors import SaveFailedError
from .prefetch import prefetch
from .reader import RawFileSystemReader
from .reuse import EarlierFile, Grouping, Index, Reuse, group
from .torchsave.writer import _ArchiveWriter, _StorageInfo, _StoragePrefix, raw_path_available
from .torchsave.zipformat import _ChecksummedStream

logger = logging.getLogger(__name__)


__all__ = ["RawFileSystemReader", "RawFileSystemWriter", "prefetch", "raw_path_available"]

_ZIP32_LIMIT = 0xFFFFFFFF - (1 << 20)  # larger archives need zip64 entries: left to torch.save

# --- writing -------------------------------------------------------------------------------


class RawFileSystemWriter(FileSystemWriter):
    """A ``FileSystemWriter`` that writes tensors without ``torch.save``'s slow CRC (same files).

    Same arguments and call order as ``FileSystemWriter`` (``write_data`` on
    every rank, ``finish`` on the coordinator). Files are fsynced when
    ``sync_files`` is set; ``.metadata`` is written by DCP's own ``finish``.

    """

    def __init__(
        self,
        *args: Any,
        direct_io: bool = True,
        reuse: Reuse | None = None,
        share: Callable[[EarlierFile], bool] | None = None,
        min_file_bytes: int = 0,
        **kwargs: Any,
    ) -> None:
        """``reuse``: the untrained tensors, grouped into files of their own, and the previous
        commit's files of them; ``share(file)`` makes such a file part of this checkpoint without
        writing it (the store's way: a hard link), and says whether it could (see :mod:`.reuse`).
        ``min_file_bytes``: with ``single_file_per_rank``, the tensors go into up to ``thread_count``
        files, one per ``min_file_bytes`` of them (0: always ``thread_count``); their sizes are as
        even as a largest-first split of the tensors makes them."""
        super().__init__(*args, **kwargs)
        self._min_file_bytes = min_file_bytes
        self._direct_io = direct_io  # O_DIRECT for the data files where the filesystem takes it
        self._reuse = reuse
        self._share = share
        self.checksums: dict[str, FileChecksum] = {}
        """CRC32 segments of each file this rank wrote (one per item), for the record."""
        self.contents: dict[str, FileContents] = {}
        """Each data file of untrained tensors this rank wrote or shared, by item digest."""
        self._digests: dict[Index, str] = {}
        self._checksums_lock = threading.Lock()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._reuse is not None and self._reuse.live:
            planner = cast(SavePlanner, _LiveChecked(planner, self._reuse.live, self._reuse.digests))
        if not self._fast_path_usable():
            return super().write_data(plan, planner)
        prefix = plan.storage_data.prefix
        untrained, trained = self._untrained(plan.items)
        if self.single_file_per_rank:
            buckets = _split(trained, self._file_count(trained))
        else:
            buckets = [[item] for item in trained]
        names = [f"{prefix}{i}{DATA_SUFFIX}" for i in range(len(buckets))]
        results: list[WriteResult] = []
        files = list(zip(names, buckets, strict=True))
        if untrained:
            grouping = self._group_untrained(untrained, planner, set(names))
            for earlier, items in grouping.shared:
                results.extend(_shared_results(earlier, items))
            # After every name a trained file can take (their count varies with the trained bytes):
            # the next save's grouping then never finds an earlier shared name among its own.
            n = max(len(buckets), self.thread_count)
            for items in grouping.written:
                while f"{prefix}{n}{DATA_SUFFIX}" in self.contents:  # a shared file's name
                    n += 1
                files.append((f"{prefix}{n}{DATA_SUFFIX}", items))
                n += 1
        jobs: queue.Queue[tuple[str, list[WriteItem]]] = queue.Queue()
        for job in files:
            jobs.put(job)
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

        if files:
            _run_threads(work, min(max(1, self.thread_count), len(files)))
        if errors:
            raise errors[0]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _file_count(self, items: Sequence[WriteItem]) -> int:
        most = max(1, self.thread_count)
        if not self._min_file_bytes:
            return most
        tensor_bytes = sum(_item_size(i) for i in items if i.type != WriteItemType.BYTE_IO)
        return max(1, min(most, tensor_bytes // self._min_file_bytes))

    def _untrained(self, items: Sequence[WriteItem]) -> tuple[list[WriteItem], list[WriteItem]]:
        """The items of tensors nothing trains (grouped apart, see :mod:`.reuse`), and the rest."""
        keys = self._reuse.untrained if self._reuse is not None else frozenset()
        if not keys:
            return [], list(items)
        untrained = [i for i in items if i.type != WriteItemType.BYTE_IO and i.index.fqn in keys]
        chosen = {id(i) for i in untrained}
        return untrained, [i for i in items if id(i) not in chosen]

    def _group_untrained(self, items: list[WriteItem], planner: SavePlanner, names: set[str]) -> Grouping:
        """Digest the untrained items save() did not (here, from the staged copy), share the
        earlier files that hold exactly these bytes, and group the rest into files to write."""
        assert self._reuse is not None
        given = self._reuse.digests  # taken at save() (a live tensor's only digest)
        self._digests = {
            _index(i): given[i.index.fqn]
            if i.index.fqn in given
            else digest(cast(torch.Tensor, planner.resolve_data(i)))
            for i in items
        }
        share = self._share

        def shared(earlier: EarlierFile) -> bool:
            if share is None or earlier.name in names or not share(earlier):
                return False
            with self._checksums_lock:
                self.checksums[earlier.name] = earlier.checksum
                self.contents[earlier.name] = FileContents(earlier.contents.items, earlier.origin)
            return True

        return group(items, self._digests, self._reuse.earlier, share=shared, index=_index)

    def _fast_path_usable(self) -> bool:
        if not raw_path_available() or _StoragePrefix is None:
            return False
        if getattr(getattr(self, "transforms", None), "extensions", ()):
            return False
        fmt = getattr(self, "serialization_format", None)
        return fmt is None or getattr(fmt, "value", fmt) == "torch_save"

    def _data_stream(self, path: Any) -> Any:
        """Where a data file's bytes go: a file (``O_DIRECT`` where the filesystem takes it). A store
        that is not a filesystem gives its own stream (``write``, ``tell``, ``close(fsync=)``)."""
        return DirectFileWriter(path, direct=self._direct_io)

    def _write_file(self, file_name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        path = self.fs.concat_path(self.path, file_name)
        results = []
        with self._data_stream(path) as stream:
            archives = _ArchiveWriter()
            checked = _ChecksummedStream(stream)
            # Byte items first, then tensors, as DCP orders them.
            for item in sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO):
                results.append(_write_item(checked, file_name, item, planner.resolve_data(item), archives))
                checked.cut()
            checked.flush()
            stream.close(fsync=self.sync_files)
        with self._checksums_lock:
            self.checksums[file_name] = checked.recorder.result()
            if self._reuse is not None and items and all(_index(i) in self._digests for i in items):
                ordered = sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO)
                self.contents[file_name] = FileContents(
                    tuple(ItemDigest(*_index(i), self._digests[_index(i)]) for i in ordered)
                )
        return results


class _LiveChecked:
    """A planner whose data for an untrained tensor ``save()`` did not copy (``live``) is a copy of
    the live tensor taken now, given only if it has the digest ``save()`` saw: the bytes written
    are the bytes at ``save()``, never a later value."""

    def __init__(self, planner: SavePlanner, live: frozenset[str], digests: Mapping[str, str]) -> None:
        self._planner = planner
        self._live = live
        self._digests = digests

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def resolve_data(self, item: WriteItem) -> Any:
        data = self._planner.resolve_data(item)
        key = item.index.fqn
        if key not in self._live:
            return data
        copy = cast(torch.Tensor, data).detach().clone()
        if digest(copy) != self._digests[key]:
            raise SaveFailedError(
                f"{key} is a tensor nothing trains, so save() took its digest instead of a copy "
                "(it had not changed since the previous save); it has changed since, before its "
                "bytes could be written. Nothing of this save is committed, and no later value "
                "was stored; the next save copies it. Change frozen weights before save(), not "
                "while a save is being written."
            )
        return copy


def _write_item(
    stream: _ChecksummedStream, file_name: str, item: WriteItem, data: Any, archives: _ArchiveWriter
) -> WriteResult:
    offset = stream.tell()
    if item.type == WriteItemType.BYTE_IO:
        stream.write(data.getbuffer())
    else:
        tensor = as_archived(data)  # as DCP does: never save the rest of a larger storage
        if tensor.nbytes >= _ZIP32_LIMIT:
            torch.save(tensor, cast(IO[bytes], stream))  # torch calls only write and flush on it
        else:
            archives.write(stream, tensor)
    length = stream.tell() - offset
    assert _StorageInfo is not None
    return WriteResult(
        index=item.index, size_in_bytes=length, storage_data=_StorageInfo(file_name, offset, length)
    )


def _index(item: WriteItem) -> Index:
    return item.index.fqn, tuple(item.index.offset or ())


def _shared_results(earlier: EarlierFile, items: list[WriteItem]) -> list[WriteResult]:
    """Where each item is in a shared file: where the earlier checkpoint wrote it."""
    assert _StorageInfo is not None
    return [
        WriteResult(
            index=item.index,
            size_in_bytes=segment.length,
            storage_data=_StorageInfo(earlier.name, segment.offset, segment.length),
        )
        for item, segment in zip(items, earlier.checksum.segments, strict=True)
    ]


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
