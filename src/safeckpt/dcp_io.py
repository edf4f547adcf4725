"""DCP files in and out, without running code from the checkpoint.

Plain ``dcp.load`` unpickles ``.metadata`` with ``pickle.load`` and loads every
non-tensor value (optimizer hyper-parameters, for instance) with
``torch.load(weights_only=False)``: a crafted checkpoint runs arbitrary code.
Here ``.metadata`` goes through :class:`RestrictedUnpickler`, which admits only
the classes DCP metadata is made of, and non-tensor values are loaded with
``weights_only=True``. What we write stays readable by plain ``dcp.load``.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from .errors import IncompleteCheckpointError, UnsafeCheckpointError
from .storage import RawFileSystemReader, RawFileSystemWriter

METADATA_NAME = ".metadata"

# dcp.save/load warn on every single-process call that they assume a single
# process; for us that is the expected case, not news.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)

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


def read_metadata(checkpoint_dir: Path) -> dcp_metadata.Metadata:
    """``.metadata`` of ``checkpoint_dir``, through :class:`RestrictedUnpickler`."""
    path = checkpoint_dir / METADATA_NAME
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError) as e:
        raise IncompleteCheckpointError(
            f"{checkpoint_dir} has no {METADATA_NAME}: it is not a complete DCP checkpoint. Restore "
            "another one.",
            path=str(path),
        ) from e
    digest = hashlib.sha256(raw).digest()
    with _last_parsed_lock:
        if _last_parsed and _last_parsed[0] == digest:
            return _last_parsed[1]
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
    with _last_parsed_lock:
        _last_parsed[:] = [digest, metadata]
    return metadata


# Unpickling a large .metadata takes tens of ms and a restore needs it several times
# (verify, key check, DCP's reader): keep the last one, keyed by its bytes' hash.
_last_parsed: list[Any] = []
_last_parsed_lock = threading.Lock()


class _RestrictedMetadata:
    """Reads ``.metadata`` through the restricted unpickler (mixed into a DCP reader)."""

    path: Any
    load_id: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_RestrictedMetadata, RawFileSystemReader):
    """Tensors read straight into their destination (``data.pkl`` through torch's
    weights-only unpickler); ``.metadata`` through the restricted unpickler."""


class SafeTorchFileSystemReader(_RestrictedMetadata, FileSystemReader):
    """DCP's own reader, with ``.metadata`` through the restricted unpickler."""


def _torch_io() -> bool:
    """``SAFECKPT_DCP_IO=torch`` switches to DCP's own writer and reader (same files, slower):
    a way around a problem in :mod:`safeckpt.storage` without changing code."""
    return os.environ.get("SAFECKPT_DCP_IO", "raw").strip().lower() == "torch"


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads non-tensor values with ``torch.load(weights_only=True)``."""

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


def _group_or_none(group: dist.ProcessGroup | None) -> dict[str, Any]:
    if group is None or not dist.is_initialized():
        return {"no_dist": True}
    return {"process_group": group}


def save(state_dict: Mapping[str, Any], directory: Path, group: dist.ProcessGroup | None) -> None:
    """Write ``state_dict`` with DCP into ``directory``; every file fsynced.

    Collective over ``group`` (every rank of it calls this with the same directory).
    """
    # Same files as DCP's FileSystemWriter (plain dcp.load reads them), without torch.save's slow CRC.
    writer_class = FileSystemWriter if _torch_io() else RawFileSystemWriter
    writer = writer_class(directory, sync_files=True, single_file_per_rank=True, thread_count=1)
    dcp.save(dict(state_dict), storage_writer=writer, **_group_or_none(group))


def load(state_dict: dict[str, Any], directory: Path, group: dist.ProcessGroup | None) -> None:
    """Load ``directory`` into ``state_dict`` in place, safely. Collective over ``group``.

    Raises :class:`UnsafeCheckpointError` when the checkpoint asks to run code.
    """
    # Inside dcp.load a failed metadata read becomes the text of an AssertionError (after a
    # fallback to per-rank metadata), so read it here first: its errors then keep their type.
    read_metadata(directory)
    try:
        dcp.load(
            state_dict,
            storage_reader=(SafeTorchFileSystemReader if _torch_io() else SafeFileSystemReader)(directory),
            planner=SafeLoadPlanner(),
            **_group_or_none(group),
        )
    except CheckpointException as e:
        # DCP wraps every rank's error in a CheckpointException (a BaseException); a refusal
        # to run code must reach the caller as what it is.
        unsafe = _unsafe_failure(e)
        if unsafe is not None:
            raise unsafe from e
        raise


def _unsafe_failure(error: CheckpointException) -> UnsafeCheckpointError | None:
    for _rank, failure in sorted(error.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, UnsafeCheckpointError):
            return exc
    return None
