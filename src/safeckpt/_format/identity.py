"""Whether a checkpoint directory still holds the commit a reader chose.

A reader takes no lock, so while it reads ``step_<N>`` the writer may replace
it (a re-save with ``overwrite=True``) or prune it. Bytes that then fail their
checks are not damage: the reader chose a commit that is no longer there. Each
commit is told apart by its record's step, commit sequence and time (a pin or
a registration amends a record but keeps those).
"""

from __future__ import annotations

import enum

from .._store.base import DIR
from .._store.loc import Loc
from ..errors import CheckpointError
from .record import Record, read_record


class Fate(enum.Enum):
    SAME = "same"
    """The directory still holds the commit that was read: what failed is damage."""
    REPLACED = "replaced"
    """Another commit (a re-save of the step) took its place: read again."""
    GONE = "gone"
    """It was removed (pruned) meanwhile."""


def commit_of(record: Record) -> tuple[int, int | None, float]:
    return record.step, record.seq, record.time


def fate_of(directory: Loc, record: Record) -> Fate:
    """What became of the commit ``record`` describes, which was read from ``directory``.

    A replacement swaps in a whole directory with a whole record in it, so a
    record that is missing or unreadable in a directory still there is damage
    in place (``SAME``), not a replacement.
    """
    try:
        now = read_record(directory)
    except (CheckpointError, OSError):
        now = None
    entry = directory.entry()
    if entry is None or entry.kind != DIR:
        return Fate.GONE
    if now is None or commit_of(now) == commit_of(record):
        return Fate.SAME
    return Fate.REPLACED
