"""Reading back the files :mod:`safeckpt._storage.writer` writes (or DCP's own), every CRC32 checked.

:class:`RawFileSystemReader` reads a rank's ``.distcp`` file front to back:
consecutive archives whose shape it can guess with one large ``preadv``
(:mod:`safeckpt._storage.batching`), runs of many small archives of one shape as one
buffer checked and copied with a few torch calls (:mod:`safeckpt._storage.runs`),
the others one request each, and each tensor's bytes straight into the
destination tensor when their layouts agree, otherwise into one fresh buffer
that it copies from, as DCP does; a cold file with ``O_DIRECT``
(:mod:`safeckpt._fs.direct_read`) in whole 16 MiB windows, each copied into place
while the next ones read. ``data.pkl`` is unpickled with torch's weights-only
unpickler, the one ``torch.load(weights_only=True)`` uses, so nothing from
the file can run code. Where torch's private helpers are missing (or switched
off, :mod:`safeckpt._util.torch_private`), each item is read, checked and
``torch.load``-ed as DCP's own reader loads it, through the same open file;
what it cannot read at all (stream transforms, safetensors) goes to DCP's own reader.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._format.checksums import FileChecksum, Segment, corrupt, crc32, verify_handle
from .._fs.direct_read import DirectFileReader
from .._fs.safe_open import RegularFile, open_regular
from .._store.base import ItemInfos
from . import placement
from .batching import BATCH_ARCHIVES, BATCH_BYTES, Planned, ReadAhead
from .prefetch import advise
from .prefetch import lookup as early_lookup
from .runs import RUN_ARCHIVE_BYTES, RUN_BYTES, RUN_MIN, PlannedRun, runs_as
from .torchsave.reader import _WINDOW, _Archive, _ArchiveShape, _Layout, preadv_exact
from .torchsave.shapes import ArchiveShapes
from .torchsave.writer import _bytes_of, raw_path_available

__all__ = ["RawFileSystemReader", "for_this_load"]


def for_this_load(metadata: Any, load_id: str) -> Any:
    """DCP's ``.metadata`` (read and checked once by the caller) as a reader returns it to DCP:
    stamped with this load's id, as DCP's own ``read_metadata`` does."""
    from torch.distributed.checkpoint import metadata as dcp_metadata

    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata

_AHEAD = 2  # batches read ahead of the one being checked (each up to batching.BATCH_BYTES)


class RawFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` that reads each tensor's bytes once, into the destination if it can,
    and checks every item it reads against the CRC32 segment recorded for it.

    ``checksums`` (file name -> segments, from the checkpoint's record) turns
    verification on; None reads a checkpoint written before checksums existed.
    Byte items are read and checked here and handed to the planner's
    ``load_bytes``; items with stream transforms go through DCP's own code after
    their bytes are checked.
    """

    def __init__(
        self,
        *args: Any,
        checksums: Mapping[str, FileChecksum] | None = None,
        step: int | None = None,
        direct_io: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._direct_io = direct_io  # O_DIRECT for a cold file where the filesystem takes it
        self._shapes = ArchiveShapes()
        self._checksums = checksums
        self._step = step
        self._whole_verified: set[str] = set()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        raw = raw_path_available()
        infos = plan.storage_data
        if not isinstance(infos, ItemInfos) or len(infos) != len(plan.items):
            # Looked up once here (each lookup hashes a key in Python), unless the plan did already.
            infos = [self.storage_data[item.storage_index] for item in plan.items]
        per_file: dict[str, list[tuple[ReadItem, Any]]] = {}  # each item with its storage info
        for item, info in zip(plan.items, infos, strict=True):
            per_file.setdefault(info.relative_path, []).append((item, info))
        for relative_path, items in per_file.items():
            path = self.fs.concat_path(self.path, relative_path)
            fd, _ = open_regular(Path(path))
            try:
                advise(fd, 0, 0, "POSIX_FADV_SEQUENTIAL")
                if raw:
                    self._read_file(fd, items, planner)
                else:
                    self._read_file_public(fd, items, planner)
            finally:
                os.close(fd)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_file(self, fd: int, items: list[tuple[ReadItem, Any]], planner: LoadPlanner) -> None:
        """Byte items, then the tensor archives in file order, front to back.

        Runs of archives whose shape can be guessed go in batches, one large
        ``preadv`` each (:mod:`safeckpt._storage.batching`); any other archive is read on
        its own: its head, then one ``preadv`` of the tensor's bytes into their
        destination and of the rest of the archive, parsed and checked in full.
        """
        archives: dict[int, list[ReadItem]] = {}  # offset -> the items it feeds (reshards: several)
        lengths: dict[int, int] = {}  # offset -> the archive's length
        for item, info in items:
            if item.type is LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
                self._read_other(fd, item, planner)
            else:
                archives.setdefault(info.offset, []).append(item)
                lengths[info.offset] = info.length
        order = sorted(archives)
        # Up to _AHEAD batches are read ahead on a thread while the one before is checked and committed
        # here, so the disk never waits for Python (two buffered reads at once interleave and slow a
        # disk down). A cold file is read with O_DIRECT (direct_read) on two threads, two requests in
        # flight: a reading thread that has to wait for the GIL after its read (up to the 5 ms switch
        # interval while this thread runs Python) would leave the disk idle meanwhile.
        direct = (
            DirectFileReader.for_file(fd, order[0], early_lookup(os.fstat(fd)), enabled=self._direct_io)
            if order
            else None
        )
        readers = 2 if direct is not None else 1
        position = 0
        runs: dict[int, PlannedRun] = {}  # planned already, by the position of their first archive
        with contextlib.ExitStack() as stack:
            if direct is not None:
                stack.callback(direct.close)  # after the pool below has stopped reading
            pool = stack.enter_context(ThreadPoolExecutor(readers, thread_name_prefix="safeckpt-read"))
            reads = ReadAhead(fd, pool, direct)
            while True:
                while len(reads) < _AHEAD and position < len(order):
                    run = runs.pop(position, None) or self._plan_run(
                        order, position, archives, lengths, planner
                    )
                    if run is not None:
                        reads.add([run])
                        position += len(run.items)
                    elif planned := self._plan_batch(order, position, archives, lengths, planner, runs):
                        reads.add(planned)
                        position += len(planned)
                    else:  # an archive whose shape cannot be guessed: read on its own, parsed in full
                        offset = order[position]
                        self._read_archive(fd, offset, lengths[offset], archives[offset], planner)
                        position += 1
                batch = reads.next()
                if batch is None:
                    return
                if isinstance(batch[0], PlannedRun):
                    self._finish_run(fd, batch[0], planner)
                else:
                    self._finish_batch(fd, cast(list[Planned], batch), planner)

    def _read_file_public(self, fd: int, items: list[tuple[ReadItem, Any]], planner: LoadPlanner) -> None:
        """Where torch's private serialization helpers are off (:func:`raw_path_available` false):
        each item's bytes read from ``fd``, checked, and loaded as DCP's own reader loads them
        (``torch.load(weights_only=True)``, then a copy into the destination). Every check and read
        goes through the one open file, so the bytes checked are the bytes loaded even when the
        checkpoint is replaced meanwhile (DCP's reader would open the path again)."""
        for item, info in sorted(items, key=lambda pair: pair[1].offset):
            if item.type is LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
                self._read_other(fd, item, planner)
                continue
            data = placement.pread_exact(fd, info.length, info.offset)
            segment = self._segment(item, fd)
            if segment is not None and crc32(data) != segment.crc:
                raise corrupt(Path(self.path) / info.relative_path, info.offset, step=self._step)
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            saved = placement.narrow(tensor, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != saved.size():
                sizes = f"{target.size()} vs {saved.size()}"
                raise AssertionError(f"req {item.storage_index} mismatch sizes {sizes}")
            target.copy_(saved)
            planner.commit_tensor(item, target)

    def _plan_run(
        self,
        order: list[int],
        k: int,
        archives: dict[int, list[ReadItem]],
        lengths: dict[int, int],
        planner: LoadPlanner,
    ) -> PlannedRun | None:
        """The run from ``order[k]`` (:meth:`_run_items`), each archive read whole into a CPU tensor
        of its shape that ``copy_`` fills as ``_foreach_copy_`` does (None: fewer than ``RUN_MIN``)."""
        probe = self._run_items(order, k, archives, lengths, RUN_MIN)
        if probe is None:
            return None
        shape, items = probe
        size = shape.layout.tensor.size()
        if not placement.runs_into(placement.fillable(planner.resolve_tensor(items[0])), size):
            return None  # (CUDA targets, say) found without scanning the rest of the run
        shape, items = cast(
            tuple[_ArchiveShape, list[ReadItem]], self._run_items(order, k, archives, lengths)
        )
        targets: list[torch.Tensor] = []
        for item in items:
            target = placement.fillable(planner.resolve_tensor(item))
            if not placement.runs_into(target, size):
                break  # the batch path takes it: a plain copy_, or DCP's error for a wrong size
            targets.append(target)
        if len(targets) < RUN_MIN:
            return None
        return PlannedRun(order[k], shape, items[: len(targets)], targets)

    def _run_items(
        self,
        order: list[int],
        k: int,
        archives: dict[int, list[ReadItem]],
        lengths: dict[int, int],
        most: int | None = None,
    ) -> tuple[_ArchiveShape, list[ReadItem]] | None:
        """By DCP's metadata alone: the consecutive small archives from ``order[k]`` of one length and
        one guessed shape, each read whole by one item, at most ``RUN_BYTES`` or ``most`` of them
        (None: fewer than ``RUN_MIN``)."""
        first = archives[order[k]]
        length = lengths[order[k]]
        if len(first) != 1 or length > RUN_ARCHIVE_BYTES or k + RUN_MIN > len(order):
            return None
        if order[k + RUN_MIN - 1] - order[k] != (RUN_MIN - 1) * length:
            return None  # not RUN_MIN archives of this length back to back: no need to guess any
        shape = self._shapes.guess(first[0], length)
        if shape is None or not runs_as(shape.layout):
            return None
        size = shape.layout.tensor.size()
        whole = torch.Size([0] * len(size))
        items: list[ReadItem] = []
        end = order[k]
        if most is None:
            most = max(RUN_MIN, RUN_BYTES // length)
        for j in range(k, min(len(order), k + most)):
            offset = order[j]
            group = archives[offset]
            if offset != end or len(group) != 1 or lengths[offset] != length:
                break
            item = group[0]
            if item.lengths != size or item.storage_offsets != whole:
                break  # a part of the saved tensor (a reshard): planned archive by archive
            if self._shapes.guess(item, length) is not shape:
                break  # another dtype or shape whose archive has the same length
            items.append(item)
            end += length
        return (shape, items) if len(items) >= RUN_MIN else None

    def _finish_run(self, fd: int, run: PlannedRun, planner: LoadPlanner) -> None:
        """Check each archive of a run read already (its layout, its CRC32), then commit them all;
        an archive not laid out as guessed is read again on its own, in full."""
        guessed = run.as_guessed()
        segments = self._run_segments(run)
        if segments is not None:
            for ok, crc, segment, item in zip(guessed, run.checksums(), segments, run.items, strict=True):
                if ok and segment is not None and crc != segment.crc:
                    info = self.storage_data[item.storage_index]
                    raise corrupt(Path(self.path) / info.relative_path, info.offset, step=self._step)
        # The others first: an error there (a changed archive) comes before anything of the run is copied.
        for i, (ok, item) in enumerate(zip(guessed, run.items, strict=True)):
            if not ok:
                offset = run.offset + i * run.archive_length
                self._read_archive(fd, offset, run.archive_length, [item], planner)
        run.copy_out(guessed)
        for ok, item, target in zip(guessed, run.items, run.targets, strict=True):
            if ok:
                planner.commit_tensor(item, target)

    def _run_segments(self, run: PlannedRun) -> Sequence[Segment | None] | None:
        """The recorded segment of each archive of ``run`` (None: nothing to check against)."""
        if self._segment(run.items[0]) is None:
            return None  # no checksums, or one for the whole file (checked already)
        assert self._checksums is not None
        relative_path = self.storage_data[run.items[0].storage_index].relative_path
        found = self._checksums[relative_path].run_at(run.offset, run.archive_length, len(run.items))
        return found if found is not None else [self._segment(item) for item in run.items]

    def _plan_batch(
        self,
        order: list[int],
        k: int,
        archives: dict[int, list[ReadItem]],
        lengths: dict[int, int],
        planner: LoadPlanner,
        runs: dict[int, PlannedRun],
    ) -> list[Planned]:
        """The consecutive archives from ``order[k]`` whose shapes are known (maybe none), of at most
        ``BATCH_BYTES`` unless its first archive alone is larger. It stops where a run of small
        archives starts, and leaves that run in ``runs`` under its position."""
        planned: list[Planned] = []
        size = 0
        end: int | None = None
        for offset in order[k : k + BATCH_ARCHIVES]:
            group = archives[offset]
            length = lengths[offset]
            shape = self._shapes.guess(group[0], length)
            if shape is None or (end is not None and offset != end):
                break
            if planned and size + length > BATCH_BYTES:
                break
            if planned and length <= RUN_ARCHIVE_BYTES:
                run = self._plan_run(order, k + len(planned), archives, lengths, planner)
                if run is not None:
                    runs[k + len(planned)] = run
                    break
            if not all(placement.fits(shape.layout, item) for item in group):
                break  # not this shape after all: the slow path finds out what it is
            targets = [placement.fillable(planner.resolve_tensor(item)) for item in group]
            saved = [placement.saved(shape.layout, item) for item in group]
            if any(t.size() != s.size() for t, s in zip(targets, saved, strict=True)):
                break
            straight = len(group) == 1 and placement.reads_straight_into(targets[0], saved[0], shape.layout)
            planned.append(Planned(offset, length, group, shape, targets, straight))
            size += length
            end = offset + length
        return planned

    def _finish_batch(self, fd: int, planned: list[Planned], planner: LoadPlanner) -> None:
        """Check each archive of a batch read already (its layout, its CRC32), then commit it."""
        for p in planned:
            if not p.as_guessed():  # another layout than the guess: read it again, in full
                self._read_archive(fd, p.offset, p.length, p.items, planner)
                continue
            info = self.storage_data[p.items[0].storage_index]
            segment = self._segment(p.items[0], fd)
            if segment is not None and p.checksum() != segment.crc:
                raise corrupt(Path(self.path) / info.relative_path, info.offset, step=self._step)
            for item, target in zip(p.items, p.targets, strict=True):
                if not p.straight:
                    assert p.storage is not None
                    placement.place(p.storage, p.shape.layout, item, target)
                planner.commit_tensor(item, target)

    def _read_other(self, fd: int, item: ReadItem, planner: LoadPlanner) -> None:
        """A byte item (checked, then handed to ``load_bytes``) or one with stream transforms."""
        info = self.storage_data[item.storage_index]
        if item.type != LoadItemType.BYTE_IO:
            self.verify_items([item])
            super().read_data(LoadPlan([item]), planner).wait()
            return
        segment = self._segment(item, fd)
        data = placement.pread_exact(fd, info.length, info.offset)
        if segment is not None and crc32(data) != segment.crc:
            raise corrupt(Path(self.path) / info.relative_path, info.offset, step=self._step)
        planner.load_bytes(item, io.BytesIO(data))

    def _read_archive(
        self, fd: int, offset: int, length: int, items: list[ReadItem], planner: LoadPlanner
    ) -> None:
        """Read one tensor archive into every item it feeds, parsing and checking all of it."""
        head = placement.pread_exact(fd, min(length, _WINDOW), offset)
        info = self.storage_data[items[0].storage_index]
        where = (Path(self.path) / info.relative_path, info.offset)
        segment = self._segment(items[0], fd)
        archive = _Archive(fd, offset, length, head=head)
        shape = self._shapes.known(length, head)
        if shape is not None:
            layout, record = shape.layout, shape.record
        else:
            layout, record = self._shapes.locate(archive, archive.walk())
        targets = [self._target(item, layout, planner) for item in items]
        straight = len(items) == 1 and placement.reads_straight_into(
            targets[0], placement.saved(layout, items[0]), layout
        )
        if straight:
            data = _bytes_of(targets[0])
        else:
            storage = torch.empty(record.size, dtype=torch.uint8)
            data = _bytes_of(storage)
        tail = b""
        begin, end = record.start, record.start + record.size
        if begin > len(head):  # data.pkl larger than the head: read this archive the slow way
            archive.read_into(record, data)
        else:
            in_head = min(end, len(head)) - begin
            data[:in_head] = head[begin : begin + in_head]
            rest = bytearray(length - max(end, len(head)))
            preadv_exact(fd, [data[in_head:], rest], offset + len(head))
            tail = head[end:] + bytes(rest) if len(head) > end else bytes(rest)
            archive.set_tail(end, tail)
        # The central directory must agree with the walk (a tail laid out as that of an archive of
        # the same shape, checked already, does).
        agrees = shape is not None and shape.matches_tail(tail)
        if not agrees:
            checked_layout, checked_record = self._shapes.locate(archive, archive.directory())
            agrees = (checked_record, checked_layout.key) == (record, layout.key)
            if agrees and shape is None:
                self._shapes.remember(archive.shape(layout, record))
        if not agrees:
            # The head misled the walk (it cannot happen with torch.save's archives): read again
            # from where the central directory says.
            layout, record = checked_layout, checked_record
            storage = torch.empty(record.size, dtype=torch.uint8)
            data = _bytes_of(storage)
            archive.read_into(record, data)
            straight = False
        if segment is not None and archive.checksum(record, data) != segment.crc:
            raise corrupt(where[0], where[1], step=self._step)
        for item, target in zip(items, targets, strict=True):
            if not straight:
                placement.place(storage, layout, item, target)
            planner.commit_tensor(item, target)

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._shapes.tensors = getattr(metadata, "state_dict_metadata", None) or {}

    def _target(self, item: ReadItem, layout: _Layout, planner: LoadPlanner) -> torch.Tensor:
        target = placement.fillable(planner.resolve_tensor(item))
        saved = placement.saved(layout, item)
        if target.size() != saved.size():
            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {saved.size()}")
        return target

    def _segment(self, item: ReadItem, fd: int | None = None) -> Segment | None:
        """The recorded segment of ``item`` (None: nothing to check against); a mismatch raises.

        A file with one checksum for all of it (DCP's own writer wrote it) is checked whole, once,
        through ``fd`` when given (the file the caller reads ``item`` from)."""
        if self._checksums is None:
            return None
        info = self.storage_data[item.storage_index]
        file_checksum = self._checksums.get(info.relative_path)
        segment = None if file_checksum is None else file_checksum.segment_at(info.offset, info.length)
        if segment is None and file_checksum is not None and len(file_checksum.segments) == 1:
            # One segment for the whole file (written by DCP's own writer): check it all, once.
            if info.relative_path not in self._whole_verified:
                path = Path(self.path) / info.relative_path
                with RegularFile.open(path) if fd is None else RegularFile.borrow(fd) as handle:
                    verify_handle(handle, path, file_checksum, step=self._step)
                self._whole_verified.add(info.relative_path)
            return None
        if segment is None:
            raise corrupt(
                Path(self.path) / info.relative_path,
                info.offset,
                step=self._step,
                detail=f"no checksum was recorded for {info.length} bytes there (.metadata disagrees "
                "with the record)",
            )
        return segment

    def verify_items(self, items: Iterable[ReadItem]) -> None:
        """Read and check the bytes of ``items`` (for reads that DCP's own code then makes)."""
        for item in items:
            segment = self._segment(item)
            if segment is None:
                continue
            info = self.storage_data[item.storage_index]
            path = Path(self.path) / info.relative_path
            fd, _ = open_regular(path)
            try:
                data = os.pread(fd, info.length, info.offset)
            finally:
                os.close(fd)
            if crc32(data) != segment.crc:
                raise corrupt(path, info.offset, step=self._step)
