"""A node's commits of its parts of saves, with a local tier on each node's own disk.

Each node's leader commits its node's part with the whole protocol, before the
nodes agree that every part is in. So a part that replaces a commit of its
step (a step saved again) holds the old copy aside, in ``.staging`` (not in the
trash, which the deleter empties), until then: a save another node failed is
taken back (:func:`~safeckpt._tiers.withdraw.withdraw_checkpoint`) and the old
copy put back in its place; a save every node committed sends it to the trash.

A copy held aside is known by its record, not by its name (:func:`is_held`): a
node's part lying in ``.staging`` under another name than its save's (the name
of the staging directory it was written in, ``part.save``). A save being
written lies under its own name, so only a commit moved out of its step's place
can, from the instant it leaves it (where the local disk exchanges directories
atomically: the old copy is at the new save's staging name, then at the held
one). A run that stops in between (a kill, a lost rank) thus leaves it for the
next start, which keeps it (:func:`is_held`, as start-up collection's ``keep``)
until the nodes have agreed which saves are whole: then a held copy of a whole
save goes back in place of a part of one that is not (:func:`settle_held`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from .._format.layout import Layout, parse_staging_name
from .._format.record import Record, amend_record, read_record
from .._manager.saves import Committed, SaveJob, SaveView
from .._manager.session import RootSession
from .._root.removal import to_trash
from .._store.base import Lock
from .._store.loc import Loc
from ..errors import CheckpointError
from .withdraw import withdraw_checkpoint

logger = logging.getLogger("safeckpt.manager")


class NodeCommits:
    """The committing thread's (a node's leader's) handling of the copies its parts replace.

    Call rules: the writer thread of a node's leader: :meth:`hold_place` under the sidecar lock
    before a part's commit, :meth:`settled` once the ranks agreed on it.
    """

    def __init__(
        self, layout: Layout, view: SaveView, session: RootSession, requeue: Callable[[Committed], None]
    ) -> None:
        self._layout = layout
        self._view = view
        self._session = session
        self._requeue = requeue  # a copy put back goes up again (see settled)
        self._held: dict[str, Loc] = {}  # a save's staging name -> where the copy it replaced goes

    def hold_place(self, job: SaveJob) -> Loc:
        """Where the commit of ``job`` (a node's part) moves the copy of its step it replaces."""
        place = self._layout.staging_dir(job.step, uuid.uuid4().hex[:12])
        self._held[job.staging_dir.name] = place
        return place

    def settled(self, job: SaveJob, *, everywhere: bool) -> None:
        """The nodes agreed on ``job``, which this node committed: every node committed its part
        (the copy it replaced, if any, goes to the trash), or another failed (this part is taken
        back, and that copy put back in its place). Logged, never raised."""
        held = self._held.pop(job.staging_dir.name, None)
        if held is not None and held.entry() is None:
            held = None  # it replaced nothing
        if everywhere:
            self._release(job, held)
        else:
            self._withdraw(job, held)

    def _release(self, job: SaveJob, held: Loc | None) -> None:
        lock = self._session.lock
        if held is None or lock is None:
            return
        try:
            with lock:
                to_trash(self._layout, held, job.step)
            if self._session.deleter is not None:
                self._session.deleter.schedule()
        except Exception as e:  # left in .staging: the next start settles it
            logger.warning("safeckpt: could not remove the copy step %d replaced (%s)", job.step, e)

    def _withdraw(self, job: SaveJob, held: Loc | None) -> None:
        """Alone a part is no checkpoint, and is never uploaded: it goes to the trash, and the copy
        it replaced, if any, back into its place."""
        lock = self._session.lock
        try:
            current = self._view.get(job.step)
            if lock is None or current is None or current.record.part_id != job.staging_dir.name:
                return
            put_back = withdraw_checkpoint(self._layout, lock, job.step, held=held)
            restored = restored_copy(self._layout, lock, job.step, current) if put_back else None
            self._view.withdraw(job.step, restored)
            if restored is not None:
                # In line for its upload again: a try while the part stood in its place found
                # another copy there, and dropped it.
                self._requeue(restored)
            if self._session.deleter is not None:
                self._session.deleter.schedule()
        except Exception as e:
            logger.warning("safeckpt: could not withdraw this node's part of step %d (%s)", job.step, e)


def is_held(entry: Loc) -> bool:
    """Whether the ``.staging`` entry ``entry`` is a copy held aside (see :func:`_held_record`)."""
    return _held_record(entry) is not None


def _held_record(entry: Loc) -> Record | None:
    """The record of ``entry`` if it is a copy held aside: a committed part of a save whose staging
    directory it is not (see the module's docstring)."""
    try:
        record = read_record(entry)
    except (CheckpointError, OSError):
        return None
    if record is None or not record.committed or record.part_id in (None, entry.name):
        return None
    return record


def restored_copy(layout: Layout, lock: Lock, step: int, withdrawn: Committed | None) -> Committed | None:
    """The copy put back in place of ``withdrawn`` (a part taken back), as its record says now;
    pinned if a pin of the step came while the withdrawn part stood there."""
    target = layout.step_dir(step)
    record = read_record(target)
    if record is None:
        return None
    if withdrawn is not None and withdrawn.record.pinned and not record.pinned:
        record = amend_record(target, lock, pinned=True)
    return Committed(target, record)


def held_copies(layout: Layout) -> tuple[list[Committed], list[Loc]]:
    """The copies an earlier run held aside and never released (it stopped between a node's commit
    of a part and the nodes' agreement on it), and every other ``.staging`` entry: a save's own
    staging (its part is named after it, a held copy's is not), or anything unreadable."""
    held, other = [], []
    for entry in layout.staging_entries():
        record = _held_record(entry)
        if record is not None:
            held.append(Committed(entry, record))
        else:
            other.append(entry)
    return held, other


def settle_held(
    layout: Layout,
    lock: Lock,
    view: SaveView,
    held: list[Committed],
    whole: frozenset[str],
    other: list[Loc],
) -> list[Committed]:
    """At start, once the nodes have agreed which saves not uploaded yet are whole (``whole``): the
    newest held copy of a whole save goes back in place of its step's part of a save that is not
    whole (never over one that is, or that went up); every other held copy, and ``other`` (see
    :func:`held_copies`), goes to the trash. Returns the copies put back."""
    for entry in other:
        with lock:
            to_trash(layout, entry, parse_staging_name(entry.name) or 0)
    by_step: dict[int, list[Committed]] = {}
    for copy in held:
        by_step.setdefault(copy.record.step, []).append(copy)
    put_back = []
    for step, copies in sorted(by_step.items()):
        current = view.get(step)
        replaces = current is None or (
            current.record.uploaded is None and current.record.part_id not in whole
        )
        candidates = [c for c in copies if c.record.part_id in whole]
        back = max(candidates, key=lambda c: c.record.seq or 0) if candidates and replaces else None
        if back is not None and withdraw_checkpoint(layout, lock, step, held=back.path):
            restored = restored_copy(layout, lock, step, current)
            view.withdraw(step, restored)
            if restored is not None:
                put_back.append(restored)
            logger.warning(
                "safeckpt: put back the earlier copy of step %d in %s: the save that replaced it was "
                "cut short before every node had committed it",
                step,
                layout.root,
            )
        for copy in copies:
            if copy is not back:
                with lock:
                    to_trash(layout, copy.path, step)
    return put_back
