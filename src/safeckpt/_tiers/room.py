"""Room on the local tier's disk: when it cannot hold one more checkpoint, uploaded ones go early.

A local checkpoint is kept until its upload commits, and otherwise as long as
``local_retention`` says. When the local disk has less free space than the
newest checkpoint took, the oldest checkpoints already uploaded are removed
first, with a warning (their durable copies stay), until there is room; never
one waiting for its upload, a pinned one, or the one ``latest`` names. If that
is not enough, the save goes ahead and fails for want of space, as on any root.
"""

from __future__ import annotations

import logging

from .._format.layout import Layout
from .._manager.saves import SaveView
from .._manager.session import RootSession
from .._root.removal import discard_checkpoint

logger = logging.getLogger("safeckpt.manager")

_MARGIN = 1.1  # the next checkpoint is taken to be a little larger than the newest


class LocalRoom:
    """Rank 0, on the local writer thread before each save writes."""

    def __init__(self, layout: Layout, view: SaveView, session: RootSession) -> None:
        self._layout = layout
        self._view = view
        self._session = session

    def make_room(self, step: int) -> None:
        free = self._layout.store.free_space()
        committed = sorted(self._view.committed(), key=lambda c: c.record.seq or 0)
        if free is None or not committed:
            return
        need = int(committed[-1].record.size * _MARGIN)
        if free >= need:
            return
        lock, deleter = self._session.lock, self._session.deleter
        if lock is None or deleter is None:
            return
        latest = self._view.latest
        removed = []
        for entry in committed:
            record = entry.record
            if free >= need:
                break
            if record.uploaded is None or record.pinned or record.step in (latest, step):
                continue
            moved, _ = discard_checkpoint(self._layout, lock, record.step)
            if not moved:
                continue
            self._view.forget(record.step)
            deleter.run_pass()  # the space is needed now, not at the deleter's next pass
            removed.append(record.step)
            free = self._layout.store.free_space() or 0
        if removed:
            logger.warning(
                "safeckpt: the local disk of %s is full (%s bytes free, step %d needs about %d); removed "
                "the uploaded step(s) %s early (their durable copies stay)",
                self._layout.root,
                free,
                step,
                need,
                ", ".join(map(str, removed)),
            )
