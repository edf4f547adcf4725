"""A checkpoint of the durable root, read with the files this node's local part holds from its disk.

With a local tier on each node's own disk (``docs/tiers.md``), a node's local
copy of a checkpoint is its part: the files its ranks wrote. A rank also reads
files other nodes wrote (DCP stores a replicated tensor on one rank, and
``.metadata`` is on node 0), so a restore reads the durable checkpoint, and
each file this node's part holds from the local disk instead.
:class:`PartOverlay` is that checkpoint's store: the durable root's, except
those files. Each file read locally is checked against the durable record's
checksums as any read is, so a damaged local file fails the read (and the
restore then reads the root alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._format.layout import Layout
from .._format.record import Record, read_record
from .._store.base import Entry, ReadHandle, Store
from .._store.loc import Loc
from ..errors import CheckpointError


def this_nodes_part(local: Layout, record: Record) -> tuple[Loc, frozenset[str]] | None:
    """This node's part of the durable checkpoint ``record`` describes, and the files of it that
    match the durable record (same names and checksums), if this node holds one."""
    save = record.uploaded.save if record.uploaded is not None else None
    if save is None:
        return None
    directory = local.step_dir(record.step)
    try:
        part = read_record(directory)
    except (CheckpointError, OSError):
        return None  # damaged: the root has every file
    if part is None or part.part_id != save or part.checksums is None or record.checksums is None:
        return None
    files = frozenset(
        n
        for n, size in part.files.items()
        if record.files.get(n) == size and record.checksums.get(n) == part.checksums.get(n) is not None
    )
    return (directory, files) if files else None


class PartOverlay:
    """The durable root's store, except the files ``files`` of checkpoint ``directory`` (a key in
    it), which are read from ``local`` (a node's part of that checkpoint). Its URL is the root's:
    a name in it means the same checkpoint on every rank."""

    def __init__(self, base: Store, directory: str, local: Loc, files: frozenset[str]) -> None:
        self._base = base
        self._directory = directory
        self._local = local
        self._files = files
        self.url = base.url

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    def _local_key(self, name: str) -> str | None:
        parent, _, leaf = name.rpartition("/")
        return (self._local / leaf).key if parent == self._directory and leaf in self._files else None

    def open_read(self, name: str) -> ReadHandle:
        key = self._local_key(name)
        return self._base.open_read(name) if key is None else self._local.store.open_read(key)

    def read_small(self, name: str, *, limit: int, what: str) -> bytes:
        key = self._local_key(name)
        if key is None:
            return self._base.read_small(name, limit=limit, what=what)
        return self._local.store.read_small(key, limit=limit, what=what)

    def entry(self, name: str) -> Entry | None:
        key = self._local_key(name)
        return self._base.entry(name) if key is None else self._local.store.entry(key)

    def entries(self, name: str = "") -> list[Entry]:
        found = self._base.entries(name)
        if name != self._directory:
            return found
        local = {e.name: e for e in self._local.store.entries(self._local.key) if e.name in self._files}
        return [local.get(e.name, e) for e in found]

    def dcp_prefetch(self, directory: str, rank: int, *, direct_io: bool) -> Callable[[], None]:
        if directory == self._directory:  # this rank's own files are its node's
            return self._local.store.dcp_prefetch(self._local.key, rank, direct_io=direct_io)
        return self._base.dcp_prefetch(directory, rank, direct_io=direct_io)

    def dcp_reader(self, directory: str, **options: Any) -> Any:
        reader = self._base.dcp_reader(directory, **options)
        if directory != self._directory:
            return reader
        return SplitReader(reader, self._local.store.dcp_reader(self._local.key, **options), self._files)


class SplitReader(StorageReader):
    """DCP's reader of one checkpoint from two places: ``files`` through ``local``, the rest
    through ``base`` (the same checkpoint's ``.metadata`` for both)."""

    def __init__(self, base: Any, local: Any, files: frozenset[str]) -> None:
        self._base = base
        self._local = local
        self._files = files

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    def reset(self, checkpoint_id: Any = None) -> None:
        self._base.reset(checkpoint_id)
        self._local.reset(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return self._base.read_metadata(*args, **kwargs)

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._base.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._local.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: Any) -> Any:
        return self._base.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: Any) -> Any:
        return self._base.prepare_global_plan(plans)

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        data = self._base.storage_data
        here = [i for i in plan.items if data[i.storage_index].relative_path in self._files]
        there = [i for i in plan.items if data[i.storage_index].relative_path not in self._files]
        if here:
            self._local.read_data(dataclasses.replace(plan, items=here), planner).wait()
        if there:
            return self._base.read_data(dataclasses.replace(plan, items=there), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done
