"""DCP files in and out, without running code from the checkpoint.

Plain ``dcp.load`` unpickles ``.metadata`` with ``pickle.load`` and loads every
non-tensor value (optimizer hyper-parameters, for instance) with
``torch.load(weights_only=False)``: a crafted checkpoint runs arbitrary code.
Here ``.metadata`` goes through :class:`RestrictedUnpickler`, which admits only
the classes DCP metadata is made of, and non-tensor values are loaded with
``weights_only=True``. What we write stays readable by plain ``dcp.load``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import traceback
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from .._format.checksums import FileChecksum
from .._format.contents import FileContents
from .._format.record import Record, read_record
from .._store.base import ItemInfos
from .._store.loc import Loc, as_loc
from .._util.torch_private import set_element
from ..errors import CheckpointError, SaveFailedError, UnsafeCheckpointError
from . import options
from .nesting import flatten_nested, nest_for_dcp
from .plans import SavePlans
from .safe_metadata import checksums_of, read_metadata

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """dcp.save/load warn on every single-process call that they assume a single process; for us
    that is the expected case, not news. Silenced for our calls only: the process's filters stay."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="torch.distributed is disabled, unavailable or uninitialized",
            category=UserWarning,
        )
        yield


def reader_for(directory: Loc | str | os.PathLike[str], record: Record | None = None) -> Any:
    """The store's DCP reader of ``directory``: every item checked against ``record``'s sums, and
    ``.metadata`` through the restricted unpickler."""
    directory = as_loc(directory)
    if record is None:
        record = read_record(directory)
    io_options = options.current()
    return directory.store.dcp_reader(
        directory.key,
        checksums=checksums_of(record, directory),
        step=None if record is None else record.step,
        direct_io=io_options.direct_io,
        dcp_own=io_options.dcp_io == options.TORCH,
        metadata=lambda: read_metadata(directory, record=record),
    )


def writes_its_own_archives() -> bool:
    """Whether a save's data files go through safeckpt's writer (which checks a live untrained
    tensor's digest before it writes its bytes), not DCP's own (``dcp_io="torch"``)."""
    return not _torch_io()


def _torch_io() -> bool:
    """Whether this call uses DCP's own writer and reader (``dcp_io="torch"``: same files, slower),
    a way around a problem in :mod:`safeckpt._storage.writer` without changing code."""
    return options.current().dcp_io == options.TORCH


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads non-tensor values with ``torch.load(weights_only=True)``; plans whole-tensor loads itself.

    DCP plans every tensor through its resharding sweep (chunk lists, overlap
    regions), a large share of a restore of many small tensors. Where every
    value is a plain tensor saved whole, in one chunk, of its current size (a
    restore on the ranks and shapes it was saved with), each read item is the
    one that sweep gives: the whole saved chunk into the whole tensor. Anything
    else (a DTensor, a reshard, a missing or extra key, a size that differs, a
    non-tensor value) is planned by DCP, which also raises its own errors.
    """

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        flat = flatten_nested(state_dict) if self.flatten_state_dict else None
        if flat is None:
            super().set_up_planner(state_dict, metadata, is_coordinator)
            return
        super().set_up_planner({}, metadata, is_coordinator)  # every other field, as DCP sets it
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flat

    def create_local_plan(self) -> LoadPlan:
        plan = _whole_tensor_plan(self.state_dict, self.metadata)
        return plan if plan is not None else super().create_local_plan()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        # A whole plain tensor is what DCP's lookup and narrowing give, without their checks (3 us
        # of every item of a 10,000-tensor restore); everything else goes through them.
        tensor: Any = self.state_dict.get(read_item.dest_index.fqn)
        offset = read_item.dest_index.offset  # DCP: None, or the zeros of the tensor's rank
        if (
            type(tensor) in _PLAIN
            and read_item.lengths == tensor.size()
            and not any(read_item.dest_offsets)
            and (offset is None or (len(offset) == tensor.dim() and not any(offset)))
        ):
            return tensor
        return super().resolve_tensor(read_item)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"the value {read_item.dest_index.fqn!r} in the checkpoint is not plain data "
                f"({e}); safeckpt will not unpickle it. Restore another checkpoint.",
            ) from e
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class _WholeTensorPlanner(SafeLoadPlanner):
    """The planner of a :func:`_whole_tensor_plan`'s reads: each item's tensor is its destination."""

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.state_dict[read_item.dest_index.fqn]


def _whole_tensor_plan(state_dict: Mapping[str, Any], metadata: Any) -> LoadPlan | None:
    """The read items DCP would plan when every value is a plain tensor saved whole at its size, else None."""
    saved = getattr(metadata, "state_dict_metadata", None)
    if saved is None or len(saved) != len(state_dict):
        return None
    # Each item indexes its chunk by the key .metadata stores it under (a whole tensor has one, at
    # zero offsets), and the plan hands the reader each chunk's storage info: no key is built or
    # hashed per tensor (each costs a Python call, and there may be 10,000).
    keys = {index.fqn: (index, info) for index, info in metadata.storage_data.items()}
    items = []
    infos = ItemInfos()  # the reader's lookups, done here
    tensor_type = LoadItemType.TENSOR
    for fqn, tensor in state_dict.items():
        md = saved.get(fqn)
        if type(tensor) not in _PLAIN or type(md) is not dcp_metadata.TensorStorageMetadata:
            return None
        chunks = md.chunks
        size = tensor.size()
        if len(chunks) != 1 or md.size != size or chunks[0].sizes != size or any(chunks[0].offsets):
            return None
        if 0 in size:
            continue  # nothing to read: DCP's sweep finds no overlap and plans no item either
        index, info = keys.get(fqn, (None, None))
        if index is None or index.offset != chunks[0].offsets:
            return None  # .metadata lacks the chunk's key: DCP plans it, and raises its own error
        zeros = index.offset
        items.append(_WholeRead(tensor_type, index, zeros, index, zeros, size))
        infos.append(info)
    # tuples with ReadItem's fields, which is all DCP reads of them
    return LoadPlan(cast("list[ReadItem]", items), storage_data=infos)


_PLAIN = (torch.Tensor, torch.nn.Parameter)

# What a DCP call raises: any Exception, or DCP's CheckpointException (a BaseException, which
# ``except Exception`` misses).
DCP_ERRORS = (Exception, CheckpointException)


class _WholeRead(NamedTuple):
    """An item of :func:`_whole_tensor_plan`: the fields of DCP's ``ReadItem``, in its order, made as
    a tuple (a frozen dataclass sets each field with a Python call, 10,000 items times six)."""

    type: LoadItemType
    dest_index: MetadataIndex
    dest_offsets: torch.Size
    storage_index: MetadataIndex
    storage_offsets: torch.Size
    lengths: torch.Size


def _group_or_none(group: dist.ProcessGroup | None) -> dict[str, Any]:
    if group is None or not dist.is_initialized():
        return {"no_dist": True}
    return {"process_group": group}


class Written(NamedTuple):
    """What :func:`save` wrote."""

    checksums: dict[str, FileChecksum | None]
    """Each data file of the save by name (every rank's, as the checkpoint's ``.metadata`` places
    its items), with the CRC32 segments of those this rank could checksum as it wrote them (or
    took from the file it shared), else None (DCP's own writer, another rank's file)."""
    contents: dict[str, FileContents]
    """This rank's data files of untrained tensors, by item digest (see ``_format.contents``)."""


def save(
    state_dict: Mapping[str, Any],
    directory: Loc | str | os.PathLike[str],
    group: dist.ProcessGroup | None,
    *,
    plans: SavePlans | None = None,
    reuse: Any = None,
) -> Written:
    """Write ``state_dict`` with DCP into ``directory``; every file fsynced.

    Collective over ``group`` (every rank of it calls this with the same
    directory). ``plans``: the plans of earlier saves of the same caller, reused
    where nothing changed. ``reuse``: the untrained tensors and the previous
    commit's files of them (``safeckpt._storage.reuse.Reuse``), to share what is
    unchanged. The caller checksums what :attr:`Written.checksums` lacks.
    """
    if reuse is not None and reuse.live and _torch_io():
        # DCP's own writer would write those live tensors unchecked: a later value. Never.
        raise SaveFailedError(
            "safeckpt: a save with tensors save() did not copy reached DCP's own writer "
            '(dcp_io="torch"), which cannot check them; nothing was written. Please report this.'
        )
    # Same files as DCP's FileSystemWriter (plain dcp.load reads them), without torch.save's slow CRC.
    directory = as_loc(directory)
    writer = directory.store.dcp_writer(
        directory.key, direct_io=options.current().direct_io, dcp_own=_torch_io(), reuse=reuse
    )
    planner = None if plans is None else plans.planner()
    try:
        with _quiet_single_process():
            metadata = dcp.save(
                dict(state_dict), storage_writer=writer, planner=planner, **_group_or_none(group)
            )
    except BaseException:
        # DCP raises on every rank: each drops its plans, and the next save plans in full
        if plans is not None:
            plans.forget()
        raise
    written: dict[str, FileChecksum | None] = dict(getattr(writer, "checksums", {}))
    # The names, from the plans DCP gathered: a commit then looks each one up, where a directory
    # listing can lag another client's new file (NFS), whichever writer wrote it.
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        written.setdefault(info.relative_path, None)
    return Written(written, dict(getattr(writer, "contents", {})))


def load(
    state_dict: dict[str, Any],
    directory: Loc | str | os.PathLike[str],
    group: dist.ProcessGroup | None,
    *,
    record: Record | None = None,
) -> None:
    """Load ``directory`` into ``state_dict`` in place, safely. Collective over ``group``.

    Every byte read is checked against the checksums in ``record`` (read from
    the directory when not given): :class:`CorruptCheckpointError` on a mismatch.
    Raises :class:`UnsafeCheckpointError` when the checkpoint asks to run code
    or to read outside itself.
    """
    directory = as_loc(directory)
    if record is None:
        record = read_record(directory)
    # Inside dcp.load a failed metadata read becomes the text of an AssertionError (after a
    # fallback to per-rank metadata), so read it here first: its errors then keep their type.
    read_metadata(directory, record=record)
    try:
        with _quiet_single_process():
            dcp.load(
                state_dict,
                storage_reader=reader_for(directory, record),
                planner=SafeLoadPlanner(),
                **_group_or_none(group),
            )
    except CheckpointException as e:
        # DCP wraps every rank's error in a CheckpointException (a BaseException); ours (a
        # refusal to run code, a checksum mismatch) must reach the caller as what it is.
        ours = our_failure(e)
        if ours is not None:
            raise ours from e
        raise


def load_flat(
    flat: dict[str, Any],
    directory: Loc,
    group: dist.ProcessGroup | None,
    *,
    record: Record,
    metadata: dcp_metadata.Metadata,
) -> None:
    """:func:`load` for a flat state (DCP keys, as the checkpoint's ``.metadata`` names them).

    In one process, when every value is a plain tensor that the checkpoint
    holds whole at its size, and the checkpoint holds nothing else, the reader
    reads the plan DCP would make (:func:`_whole_tensor_plan`) without
    ``dcp.load``: its flattening, its planning steps and their logging cost more
    than the reads of 10,000 small tensors. Anything else goes through DCP.
    Errors are those of :func:`load`.
    """
    plan = None
    if "no_dist" in _group_or_none(group) and not _torch_io():
        try:
            plan = _whole_tensor_plan(flat, metadata)
        except Exception:  # a .metadata not laid out as DCP writes it: dcp.load raises its own error
            plan = None
    if plan is None:
        load(nest_for_dcp(flat), directory, group, record=record)
        return
    reader = reader_for(directory, record)
    reader.set_up_storage_reader(metadata, True)
    planner = _WholeTensorPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    # What set_up_planner sets, without its walk of the state: every value is a plain tensor.
    planner.original_state_dict = planner.state_dict = flat
    planner.metadata, planner.is_coordinator = metadata, True
    try:
        reader.read_data(plan, planner).wait()
    except CheckpointError:
        raise
    except Exception as e:  # as dcp.load reports it, so callers see one kind of failed read
        failure = (e, traceback.extract_tb(e.__traceback__))
        raise CheckpointException("read_data", {0: failure}) from e


E = TypeVar("E", bound=BaseException)


def our_failure(error: CheckpointException) -> CheckpointError | None:
    return failure_of(error, CheckpointError)


def failure_of(error: CheckpointException, kind: type[E]) -> E | None:
    """The first rank's failure inside DCP's ``error`` that is a ``kind``, or None."""
    for _rank, failure in sorted(error.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, kind):
            return exc
    return None
