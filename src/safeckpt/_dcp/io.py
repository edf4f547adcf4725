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
import hashlib
import io
import logging
import os
import pickle
import threading
import traceback
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from .._format.checksums import FileChecksum, parse_checksums, read_verified
from .._format.layout import check_member_name
from .._format.record import Record, read_record
from .._store.base import ItemInfos
from .._store.loc import Loc, as_loc
from .._util.forksafe import reset_in_child
from .._util.torch_private import set_element
from ..errors import CheckpointError, IncompleteCheckpointError, UnsafeCheckpointError
from . import options
from .nesting import flatten_nested, nest_for_dcp
from .plans import SavePlans

logger = logging.getLogger(__name__)

METADATA_NAME = ".metadata"


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


_ALLOWED_GLOBALS: set[tuple[str, str]] = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to torch.strided etc.
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


def _is_dcp_metadata_class(module: str, name: str) -> bool:
    if module != dcp_metadata.__name__:
        return False
    obj = getattr(dcp_metadata, name, None)
    # Classes only (dataclasses and enums); a function there would be a call we never allow.
    return isinstance(obj, type) and obj.__module__ == module


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global is refused with :class:`UnsafeCheckpointError`."""

    def __init__(self, file: io.BufferedIOBase, *, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or _is_dcp_metadata_class(module, name):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._source} asks to load {module}.{name}, which DCP metadata never contains: "
            "the file was modified or is not a DCP checkpoint. safeckpt refuses to load it "
            "because unpickling it could run code. Restore another checkpoint; inspect this one "
            "only if you trust its origin.",
            path=self._source,
        )


def read_metadata(
    checkpoint_dir: Loc | str | os.PathLike[str], *, record: Record | None = None
) -> dcp_metadata.Metadata:
    """``.metadata`` of ``checkpoint_dir``, verified and through :class:`RestrictedUnpickler`.

    Its size and checksum are checked against ``record`` (read from the
    directory when not given), and every storage path it names must be a file
    the record lists, within that file's size: a ``.metadata`` that points out
    of its checkpoint raises :class:`UnsafeCheckpointError` before any data is read.
    """
    checkpoint_dir = as_loc(checkpoint_dir)
    path = checkpoint_dir / METADATA_NAME
    if record is None:
        record = read_record(checkpoint_dir)
    checksums = checksums_of(record, checkpoint_dir)
    try:
        raw = read_verified(
            path,
            size=None if record is None else record.files.get(METADATA_NAME),
            checksum=None if checksums is None else checksums.get(METADATA_NAME),
            step=None if record is None else record.step,
        )
    except (FileNotFoundError, NotADirectoryError) as e:
        raise IncompleteCheckpointError(
            f"{checkpoint_dir} has no {METADATA_NAME}: it is not a complete DCP checkpoint. Restore "
            "another one.",
            path=str(path),
        ) from e
    digest = hashlib.sha256(raw).digest()
    # What the paths were checked against: the record's files (none without a record).
    against = None if record is None else tuple(sorted(record.files.items()))
    with _last_parsed_lock:
        cached = _last_parsed[1:] if _last_parsed and _last_parsed[0] == digest else None
    if cached is not None and cached[1] == against and against is not None:
        return cached[0]  # the same bytes, checked against the same files already
    metadata = cached[0] if cached is not None else _unpickle_metadata(raw, path)
    _check_storage_paths(metadata, path, record)
    with _last_parsed_lock:
        if _keeping:
            _last_parsed[:] = [digest, metadata, against]
    return metadata


def _unpickle_metadata(raw: bytes, path: Loc) -> dcp_metadata.Metadata:
    try:
        metadata = RestrictedUnpickler(io.BytesIO(raw), source=str(path)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # a truncated or garbled pickle
        raise IncompleteCheckpointError(
            f"{path} is not readable DCP metadata ({type(e).__name__}: {e}); the checkpoint "
            "is damaged. Restore another one.",
            path=str(path),
        ) from e
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise IncompleteCheckpointError(
            f"{path} holds a {type(metadata).__name__}, not DCP metadata; restore another checkpoint.",
            path=str(path),
        )
    return metadata


def _check_storage_paths(metadata: dcp_metadata.Metadata, path: Loc, record: Record | None) -> None:
    """Every item's file is a plain name inside the checkpoint (listed by the record, within its size)."""
    checked: set[str] = set()
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative not in checked:  # a few files hold thousands of items
            check_member_name(relative, where=str(path))  # type: ignore[arg-type]
            checked.add(relative)  # type: ignore[arg-type]
        offset, length = getattr(info, "offset", 0), getattr(info, "length", 0)
        if record is None:
            continue
        size = record.files.get(relative)  # type: ignore[arg-type]
        if size is None or relative == METADATA_NAME:
            raise UnsafeCheckpointError(
                f"{path} points at {relative!r}, which is not a data file of this checkpoint (its "
                "record does not list it). The checkpoint was modified; restore another one.",
                path=str(path),
                step=record.step,
            )
        if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length < 0:
            raise UnsafeCheckpointError(f"{path} holds a malformed storage entry", path=str(path))
        if offset + length > size:
            raise UnsafeCheckpointError(
                f"{path} points past the end of {relative} ({offset}+{length} > {size} bytes); the "
                "checkpoint was modified. Restore another one.",
                path=str(path),
                step=record.step,
            )


def checksums_of(
    record: Record | None, directory: Loc | str | os.PathLike[str], *, for_load: bool = True
) -> dict[str, FileChecksum] | None:
    """The record's checksums (None, with a warning once per directory, for an older record).

    None too when verification on load is off for this call (``for_load`` and the caller's
    ``verify=False``, see :mod:`safeckpt._dcp.options`).
    """
    if for_load and not options.current().verify:
        return None
    if record is None or record.checksums is None:
        key = str(directory)
        if key not in _warned_unverifiable:
            _warned_unverifiable.add(key)
            logger.warning(
                "safeckpt: %s was written without checksums (before safeckpt 0.2, or not by "
                "safeckpt); its bytes cannot be verified as they load",
                directory,
            )
        return None
    # Keyed by the commit the record describes, not by the file now at its path: a reader holding
    # the record of a step that was saved again meanwhile must check against that record's sums.
    key = (str(directory), record.step, record.seq, record.time)
    with _last_parsed_lock:
        cached = _parsed_checksums.get(key)
    if cached is None:
        # Parsed once per checkpoint: a restore of 10^4 tensors asks for them many times.
        cached = parse_checksums(record.checksums, record.files, where=str(directory / "metadata.json"))
        with _last_parsed_lock:
            if _keeping:
                _parsed_checksums.clear()
                _parsed_checksums[key] = cached
    return cached


_warned_unverifiable: set[str] = set()


@contextlib.contextmanager
def parsed_kept() -> Iterator[None]:
    """Inside (a context manager, or a decorator), the last ``.metadata`` and checksums parsed are
    kept for the next read of the same checkpoint; they are forgotten when the outermost one ends.

    Unpickling a large ``.metadata`` is slow and a restore needs it
    several times (verify, key check, the reader). Kept after the restore, the
    objects of 10^4 tensors' metadata (10^5 of them) would hold memory for the
    rest of the run and make the collector walk them in every full collection.
    Outside any, nothing is kept. Scopes nest and may overlap across threads.
    """
    global _keeping
    reset_in_child(_reset_in_child)
    with _last_parsed_lock:
        _keeping += 1
    try:
        yield
    finally:
        with _last_parsed_lock:
            _keeping -= 1
            if _keeping == 0:
                _forget()


def forget_parsed() -> None:
    """Forget the last ``.metadata`` and checksums parsed, as a new process starts: a benchmark's
    cold restore then pays what a restarted job pays (the unpickle of the checkpoint's metadata)."""
    with _last_parsed_lock:
        _forget()


def _forget() -> None:
    _last_parsed.clear()
    _parsed_checksums.clear()


# Inside parsed_kept: the last .metadata, keyed by its bytes' hash, with the record files its
# storage paths were checked against (20 ms per check at 10,000 tensors), and the last checksums.
_last_parsed: list[Any] = []
_parsed_checksums: dict[tuple[Any, ...], dict[str, FileChecksum] | None] = {}
_last_parsed_lock = threading.Lock()  # both, and _keeping
_keeping = 0  # parsed_kept scopes open


def _reset_in_child() -> None:
    # A child forked by another thread during a read has no one to end its scope.
    global _keeping, _last_parsed_lock
    _last_parsed_lock = threading.Lock()  # it may have been held by a thread the child does not have
    _keeping = 0
    _forget()


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
        tensor = self.state_dict.get(read_item.dest_index.fqn)
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
        items.append(ReadItem(tensor_type, index, zeros, index, zeros, size))
        infos.append(info)
    return LoadPlan(items, storage_data=infos)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _group_or_none(group: dist.ProcessGroup | None) -> dict[str, Any]:
    if group is None or not dist.is_initialized():
        return {"no_dist": True}
    return {"process_group": group}


def save(
    state_dict: Mapping[str, Any],
    directory: Loc | str | os.PathLike[str],
    group: dist.ProcessGroup | None,
    *,
    plans: SavePlans | None = None,
) -> dict[str, FileChecksum]:
    """Write ``state_dict`` with DCP into ``directory``; every file fsynced.

    Collective over ``group`` (every rank of it calls this with the same
    directory). ``plans``: the plans of earlier saves of the same caller, reused
    where nothing changed. Returns the CRC32 segments of the files this rank
    wrote that it could checksum as it wrote them (DCP's own writer: none; the
    caller checksums what is missing).
    """
    # Same files as DCP's FileSystemWriter (plain dcp.load reads them), without torch.save's slow CRC.
    directory = as_loc(directory)
    writer = directory.store.dcp_writer(
        directory.key, direct_io=options.current().direct_io, dcp_own=_torch_io()
    )
    planner = None if plans is None else plans.planner()
    try:
        with _quiet_single_process():
            dcp.save(dict(state_dict), storage_writer=writer, planner=planner, **_group_or_none(group))
    except BaseException:
        # DCP raises on every rank: each drops its plans, and the next save plans in full
        if plans is not None:
            plans.forget()
        raise
    return dict(getattr(writer, "checksums", {}))


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


def our_failure(error: CheckpointException) -> CheckpointError | None:
    for _rank, failure in sorted(error.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, CheckpointError):
            return exc
    return None
