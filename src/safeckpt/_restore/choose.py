"""Resuming: which checkpoint to load, whether it is whole, and loading it.

Rank 0 calls :func:`choose_checkpoint`; every rank then calls
:func:`load_checkpoint` on the directory rank 0 chose.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Collection
from typing import TypeVar

from torch.distributed.checkpoint.api import CheckpointException

from .._dcp import io as dcp_io
from .._dcp import safe_metadata
from .._dist.failures import storage_error, unreachable
from .._format.catalog import Catalog, scan
from .._format.checksums import read_verified
from .._format.identity import Fate, fate_of
from .._format.layout import Layout, parse_damaged_name, parse_step_dirname
from .._format.record import Record, missing_or_wrong_files, read_record
from .._state.train_state import train_state_filename
from .._store.base import DIR
from .._store.loc import Loc, as_loc
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    RootUnreachableError,
    UnsupportedStateError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


def verify_checkpoint(directory: Loc, *, step: int | None = None) -> Record:
    """The record of a committed, complete checkpoint at ``directory``; raises otherwise.

    Complete: its record is valid (and of ``step``, when the directory stands
    for one), every file the record lists is a regular file of its recorded
    size, and DCP's ``.metadata`` matches its checksum, reads through the
    restricted unpickler and names only files of this checkpoint. Reads no
    tensor data: those bytes are verified as they load. The record is read
    anew (not taken from a scan). A checkpoint replaced while it is checked (a
    re-save of its step) is checked again as it is now; one removed meanwhile
    is :class:`CheckpointNotFoundError`, never damage.
    """
    for _ in range(REREADS):
        record = _committed_record(directory, step)
        try:
            _check_files(directory, record)
            return record
        except SKIPPABLE as e:
            fate = fate_of(directory, record)
            if fate is Fate.SAME:
                raise
            if fate is Fate.GONE:
                raise removed_while_read(directory, record) from e
    raise kept_changing(directory, record)


# How often a checkpoint replaced under a reader is read again before the reader gives up.
REREADS = 8


def _is_dir(directory: Loc) -> bool:
    entry = directory.entry()
    return entry is not None and entry.kind == DIR


def _committed_record(directory: Loc, step: int | None) -> Record:
    if not _is_dir(directory):
        raise CheckpointNotFoundError(
            f"there is no checkpoint at {directory}.",
            path=str(directory),
            step=parse_step_dirname(directory.name) if step is None else step,
        )
    record = read_record(directory, step=step if step is not None else parse_step_dirname(directory.name))
    if record is None or not record.committed:
        if not _is_dir(directory):
            raise CheckpointNotFoundError(
                f"{directory} was removed (pruned) while it was read.", path=str(directory), step=step
            )
        raise IncompleteCheckpointError(
            f"{directory} is not a committed checkpoint (it has no committed record): it may be "
            "a save that never finished. Restore another step.",
            path=str(directory),
        )
    return record


def _check_files(directory: Loc, record: Record) -> None:
    problems = missing_or_wrong_files(directory, record)
    if problems:
        raise IncompleteCheckpointError(
            f"{directory} does not match its record: {'; '.join(problems[:5])}. The checkpoint "
            "was damaged after it was written; restore another step.",
            path=str(directory),
            step=record.step,
        )
    safe_metadata.read_metadata(directory, record=record)


def removed_while_read(directory: Loc, record: Record) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"step {record.step} was removed from {directory.parent} (pruned by its job) while it was "
        "being read; it was not damaged. Restore another step (`safeckpt ls` lists them).",
        path=str(directory),
        step=record.step,
    )


def kept_changing(directory: Loc, record: Record) -> IncompleteCheckpointError:
    return IncompleteCheckpointError(
        f"step {record.step} in {directory.parent} was replaced {REREADS} times while it was being "
        "read (a job re-saving it in a loop); try again once that job has moved on.",
        path=str(directory),
        step=record.step,
    )


_REFUSED = (errno.EACCES, errno.EPERM)


def cut_off(error: BaseException, directory: Loc, record: Record) -> CheckpointError | None:
    """A read the storage cut off (no answer: :class:`RootUnreachableError`) or refused (no
    permission, no credentials: :class:`ConfigError`), from ``error`` or the failure inside DCP's
    ``CheckpointException``; else None. The storage, not the checkpoint: never damage that
    auto-resume steps over, and never a reason to move a checkpoint aside."""
    if isinstance(error, CheckpointException):
        found = dcp_io.failure_of(error, OSError)
        error = found if found is not None else error
    if isinstance(error, RootUnreachableError):
        return error
    if not isinstance(error, OSError) or isinstance(error, CheckpointError):
        return None
    if isinstance(error, ConnectionError):
        return unreachable(directory.parent, error, doing=f"reading step {record.step}", step=record.step)
    if error.errno in _REFUSED:
        return storage_error(directory.parent, error, doing=f"reading step {record.step}")
    return None


def as_read_error(error: BaseException, directory: Loc, record: Record) -> BaseException:
    """A failed read of a checkpoint as its reader sees it: never a raw ``OSError`` nor DCP's
    ``CheckpointException``, but safeckpt's own error (damage is one auto-resume steps over)."""
    if isinstance(error, CheckpointError):
        return error
    storage = cut_off(error, directory, record)
    if storage is not None:
        return storage
    if isinstance(error, CheckpointException):
        ours = dcp_io.our_failure(error)
        if ours is not None:
            return ours
        text = f"loading step {record.step} from {directory} failed: {error}"
    elif isinstance(error, OSError):
        text = f"step {record.step} in {directory} could not be read ({type(error).__name__}: {error})"
    else:
        return error
    wrapped = IncompleteCheckpointError(
        f"{text}. Restore another step.", path=str(directory), step=record.step
    )
    wrapped.__cause__ = error
    return wrapped


def read_chosen(
    layout: Layout,
    step: int | None,
    path: Loc | str | os.PathLike[str] | None,
    read: Callable[[Loc, Record], T],
    *,
    nothing: Callable[[], CheckpointError],
) -> T:
    """``read`` the checkpoint auto-resume would take (or ``step``, or ``path``), without a manager.

    As auto-resume does: damage found while reading falls back to the commit
    before (an explicit ``step`` or ``path`` raises it instead); a checkpoint
    replaced or pruned while it is read is chosen anew, never reported as
    damage. ``nothing()`` is raised when no checkpoint is left to read.
    """
    auto = step is None and path is None
    excluded: set[int] = set()
    for _ in range(REREADS + 1):
        chosen = choose_checkpoint(layout, step, path, exclude=excluded)
        if chosen is None:
            raise nothing()
        directory, record = chosen
        try:
            return read(directory, record)
        except dcp_io.DCP_ERRORS as e:
            error = as_read_error(e, directory, record)
            fate = fate_of(directory, record)
            if fate is Fate.GONE and not auto:
                raise removed_while_read(directory, record) from e
            if fate is not Fate.SAME:
                continue  # replaced or pruned under this reader: choose again
            if not auto or not is_damage(error):
                if error is e:
                    raise
                raise error from e
            logger.warning(
                "safeckpt: step %d cannot be loaded (%s); falling back to the commit before it",
                record.step,
                error,
            )
            excluded.add(record.step)
    raise kept_changing(directory, record)


# Damage that auto-resume steps over (to the previous commit); a checkpoint that asks to run
# code or read outside itself is never stepped over silently: it raises.
SKIPPABLE = (CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError)


def is_damage(error: BaseException) -> bool:
    """Whether auto-resume steps over ``error``: damage, not a state or a call it cannot serve."""
    return isinstance(error, SKIPPABLE) and not isinstance(error, UnsupportedStateError)


def check_own_files(directory: Loc, record: Record, rank: int) -> None:
    """Every rank, before the collective load: the files as this rank sees them match the record,
    and the train-state file it will read matches its checksum."""
    problems = missing_or_wrong_files(directory, record)
    if problems:
        raise IncompleteCheckpointError(
            f"{directory} does not match its record here: {'; '.join(problems[:5])}. Restore another step.",
            path=str(directory),
            step=record.step,
        )
    name = train_state_filename(rank)
    if name not in record.files:
        name = train_state_filename(0)
    checksums = safe_metadata.checksums_of(record, directory)
    if name in record.files:
        read_verified(
            directory / name,
            size=record.files[name],
            checksum=None if checksums is None else checksums.get(name),
            step=record.step,
        )


def choose_checkpoint(
    layout: Layout,
    step: int | None,
    path: Loc | str | os.PathLike[str] | None,
    *,
    exclude: Collection[int] = (),
    on_damaged: Callable[[Loc, Record | None, Exception], None] | None = None,
    announce: bool = True,
) -> tuple[Loc, Record] | None:
    """Rank 0: the checkpoint to restore, or None for a fresh start.

    An explicit ``path`` or ``step`` is verified and returned, or raises. Else
    the most recent commit (by the records' commit sequence, which a rollback
    with ``overwrite=True`` respects) that is whole, skipping damaged ones and
    ``exclude`` with a warning (and telling ``on_damaged`` about each damaged
    one), and quietly skipping one pruned while it was checked. ``latest`` is
    not consulted: it only mirrors the newest commit and may lag it by a crash. ``announce``: warn
    when it falls back (off where the caller has other copies to offer).
    """
    if path is not None and step is not None:
        raise ConfigError("restore(): pass step= or path=, not both.")
    if path is not None:
        directory = as_loc(path)
        return directory, verify_checkpoint(directory)
    if step is not None:
        return _explicit_step(layout, step)
    skipped: set[int] = set()  # damaged, found here
    for attempt in range(REREADS):
        catalog = scan(layout.root)
        found, pruned = _newest_whole(catalog, set(exclude) | skipped, skipped, on_damaged)
        if found is None and not pruned and attempt < _MOVING_RETRIES and _caught_moving(catalog):
            time.sleep(0.005 * 2**attempt)  # a commit and the prune after it settle in milliseconds
            continue
        if found is not None:
            if (skipped or exclude) and announce:
                logger.warning(
                    "safeckpt: falling back to step %d: the newer checkpoint(s) %s cannot be loaded",
                    found[1].step,
                    sorted(skipped | set(exclude)),
                )
            return found
        if not pruned:  # nothing was pruned under this scan: there is nothing to load
            break
    for entry in catalog.entries:
        if not entry.committed and entry.step not in exclude and entry.path.entry() is not None:
            logger.warning("safeckpt: skipping step %d: %s", entry.step, entry.problem)
    return None


# Scans taken again when one may have caught a commit and its prune (0.075 s of pauses in all), so
# a root whose `latest` names a step it no longer has pays little at each start.
_MOVING_RETRIES = 4


def _caught_moving(catalog: Catalog) -> bool:
    """Whether a scan that found no commit may have caught the writer between a commit and the
    prune after it: a directory's listing can miss the new checkpoint renamed in, and its stat
    the old one renamed out. ``latest`` naming a step says a commit was there."""
    return not catalog.committed and catalog.latest_name is not None


def _newest_whole(
    catalog: Catalog,
    exclude: set[int],
    skipped: set[int],
    on_damaged: Callable[[Loc, Record | None, Exception], None] | None,
) -> tuple[tuple[Loc, Record] | None, bool]:
    """The newest commit of ``catalog`` that verifies, and whether one was pruned while checked
    (then a commit newer than the catalog may exist: the caller scans again)."""
    pruned = False
    for entry in catalog.newest_first():
        if entry.step in exclude:
            continue
        try:
            return (entry.path, verify_checkpoint(entry.path, step=entry.step)), pruned
        except CheckpointNotFoundError as e:
            logger.info("safeckpt: skipping step %d: %s", entry.step, e)
            pruned = True
        except SKIPPABLE as e:
            logger.warning("safeckpt: skipping step %d: %s", entry.step, e)
            skipped.add(entry.step)
            if on_damaged is not None:
                on_damaged(entry.path, entry.record, e)
    # A directory listed, then gone before its record was read: pruned during the scan.
    vanished = any(not e.committed and e.path.entry() is None for e in catalog.entries)
    return None, pruned or vanished


def _explicit_step(layout: Layout, step: int) -> tuple[Loc, Record]:
    """``step``'s checkpoint, verified. Where a filesystem has no ``RENAME_EXCHANGE``, a re-save
    leaves ``step_<N>`` missing for an instant: a step that was listed is looked for again."""
    for wait in (0.0, 0.05, 0.2):
        time.sleep(wait)
        catalog = scan(layout.root)
        entry = catalog.committed.get(step)
        if entry is None:
            break
        try:
            return entry.path, verify_checkpoint(entry.path, step=step)
        except CheckpointNotFoundError:
            continue
    directory = layout.step_dir(step)
    if _is_dir(directory):
        return directory, verify_checkpoint(directory, step=step)
    catalog = scan(layout.root)
    steps = sorted(catalog.committed)
    there = f"the steps there are {_steps_listing(steps)}" if steps else "it holds no committed checkpoint"
    aside = [p for p in catalog.damaged if parse_damaged_name(p.name) == step]
    if aside:
        there = (
            f"auto-resume found it unloadable and moved it aside to {aside[-1]} (its damaged.json "
            f"says why; `safeckpt gc` removes it); {there}"
        )
    raise CheckpointNotFoundError(
        f"there is no checkpoint of step {step} ({directory} does not exist): {there}. Pass one of "
        "them, or no step to take the newest.",
        path=str(directory),
        step=step,
    )


def _steps_listing(steps: list[int], limit: int = 20) -> str:
    if len(steps) <= limit:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[: limit // 2]))}, ..., {', '.join(map(str, steps[-limit // 2 :]))}"
