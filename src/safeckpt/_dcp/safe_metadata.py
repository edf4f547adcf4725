"""DCP's ``.metadata`` read without running code from the checkpoint, and checked against the record.

Plain ``dcp.load`` unpickles ``.metadata`` with ``pickle.load``: a crafted file runs arbitrary code.
Here it goes through :class:`RestrictedUnpickler`, which admits only the classes DCP metadata is
made of, its size and checksum are checked against the record, and every storage path it names must
be a file the record lists. Parsed metadata and checksums are kept only inside :func:`parsed_kept`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import pickle
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._format import kept
from .._format.checksums import FileChecksum, parse_checksums, read_verified
from .._format.layout import check_member_name
from .._format.record import Record, read_record
from .._store.loc import Loc, as_loc
from .._util.forksafe import reset_in_child
from ..errors import IncompleteCheckpointError, UnsafeCheckpointError
from . import options

if TYPE_CHECKING:
    from torch.distributed.checkpoint import metadata as dcp_metadata

logger = logging.getLogger(__name__)

METADATA_NAME = ".metadata"


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
    # torch is imported where a .metadata is read, not with this module: `safeckpt ls` needs none
    from torch.distributed.checkpoint import metadata as dcp_metadata

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
        import torch

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
    from torch.distributed.checkpoint import metadata as dcp_metadata

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
        shown = str(directory)
        if shown not in _warned_unverifiable:
            _warned_unverifiable.add(shown)
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
        cached = parse_checksums(record.checksums, record.files, where=f"{directory}/metadata.json")
        with _last_parsed_lock:
            if _keeping:
                _parsed_checksums.clear()
                _parsed_checksums[key] = cached
    return cached


_warned_unverifiable: set[str] = set()


@contextlib.contextmanager
def parsed_kept() -> Iterator[None]:
    """Inside (a context manager, or a decorator), the last ``.metadata`` and checksums parsed are
    kept for the next read of the same checkpoint, with what :mod:`safeckpt._format.kept` keeps
    (small files verified, checkpoints found complete); all is forgotten when the outermost one ends.

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
        with kept.keeping():  # the bytes read and the files checked, for the same span
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
