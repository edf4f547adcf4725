"""Commits auto-resume stepped over as damaged, kept out of the way until they are moved aside.

A restore notes each one (rank 0). They no longer count as the newest step for
``save()``'s order check, and the root's owner moves them to ``.damaged/``
(:mod:`safeckpt._root.quarantine`) after a restore, or as soon as this manager
takes the root.
"""

from __future__ import annotations

import logging

from .._format.layout import Layout
from .._format.record import Record
from .._root.ownership import Ownership
from .._root.quarantine import move_aside
from .._store.base import Lock
from .._store.loc import Loc
from ..errors import CheckpointError
from .saves import SaveView

logger = logging.getLogger("safeckpt.manager")


class DamagedCommits:
    """Rank 0's list of commits found unloadable and not moved aside yet. Not thread-safe: the
    manager's calls (restore, save) use it one at a time."""

    def __init__(self, layout: Layout, view: SaveView) -> None:
        self._layout = layout
        self._view = view
        self._noted: dict[int, tuple[Loc, Record, str]] = {}

    def note(self, directory: Loc, record: Record, reason: str) -> None:
        """Auto-resume stepped over this commit: it no longer counts as the newest step."""
        self._noted[record.step] = (directory, record, reason)

    @property
    def steps(self) -> frozenset[int]:
        return frozenset(self._noted)

    def move_aside(self, lock: Lock | None, ownership: Ownership | None) -> None:
        """Move every noted commit to ``.damaged/``, if ``ownership`` holds the root; failures only warn
        (the steps stay noted, out of the order check)."""
        if not self._noted or ownership is None or lock is None or not ownership.claimed:
            return
        if not ownership.still_ours():
            return
        moved = []
        for step, (directory, record, reason) in sorted(self._noted.items()):
            try:
                move_aside(self._layout, lock, directory, record, reason)
            except (OSError, CheckpointError) as e:
                logger.warning(
                    "safeckpt: could not move the unloadable step %d aside (%s); it stays where it is, "
                    "is never loaded by this job, and does not block its saves",
                    step,
                    e,
                )
                continue
            moved.append(step)
        for step in moved:
            del self._noted[step]
        self._view.drop(moved)
