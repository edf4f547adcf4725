"""A node's commits of its parts of saves, with a local tier on each node's own disk.

Each node's leader commits its node's part with the whole protocol, before the
nodes agree that every part is in. So a part that replaces a commit of its
step (a step saved again) holds the old copy aside, in ``.staging`` (not in the
trash, which the deleter empties), until then: a save another node failed is
taken back (:func:`~safeckpt._root.withdraw.withdraw_checkpoint`) and the old
copy put back in its place; a save every node committed sends it to the trash.

A run that stops in between (a kill, a lost rank) leaves the held copy in
``.staging``, under a name the next start knows (:func:`is_held`) and keeps: once
the nodes have agreed which saves are whole, a held copy of a whole save goes
back in place of a part of one that is not (:func:`settle_held`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from .._format.layout import Layout, parse_staging_name
from .._format.record import amend_record, read_record
from .._root.removal import to_trash
from .._root.withdraw import withdraw_checkpoint
from .._store.base import Lock
from .._store.loc import Loc
from ..errors import CheckpointError
from .saves import Committed, SaveJob, SaveView
from .session import RootSession

logger = logging.getLogger("safeckpt.manager")

_HELD = "00000"  # a held copy's staging token starts so (a random token does once in a million)


class NodeCommits:
    """The committing thread's (a node's leader's) handling of the copies its parts replace."""

    def __init__(
        self,
        layout: Layout,
        view: SaveView,
        session: RootSession,
        on_commit: Callable[[Committed], None] | None,
    ) -> None:
        self._layout = layout
        self._view = view
        self._session = session
        self._on_commit = on_commit

    def holding_place(self, job: SaveJob, part: Mapping[str, Any] | None) -> Loc | None:
        """Where a commit of ``job`` moves the copy it replaces (None: to the trash, as usual)."""
        if part is None:
            return None
        return self._layout.staging_dir(job.step, _HELD + uuid.uuid4().hex[: 12 - len(_HELD)])

    @staticmethod
    def hold(job: SaveJob, held: Loc | None) -> bool:
        """Whether the commit moved an old copy of its step to ``held`` (then the job keeps it)."""
        if held is None or held.entry() is None:
            return False
        job.held = held
        return True

    def release(self, job: SaveJob) -> None:
        """Every node committed its part of ``job``: the copy it replaced goes to the trash."""
        lock = self._session.lock
        if job.held is None or lock is None:
            return
        try:
            with lock:
                to_trash(self._layout, job.held, job.step)
            if self._session.deleter is not None:
                self._session.deleter.schedule()
        except Exception as e:  # left in .staging: the next start collects it
            logger.warning("safeckpt: could not remove the copy step %d replaced (%s)", job.step, e)

    def withdraw(self, job: SaveJob) -> None:
        """This node committed its part of ``job`` and another node failed to: the part goes to the
        trash (alone it is no checkpoint, and is never uploaded), and the copy it replaced, if any,
        back into its place. Logged, never raised."""
        lock = self._session.lock
        try:
            current = self._view.get(job.step)
            if (
                lock is None
                or current is None
                or (current.record.part or {}).get("id") != job.staging_dir.name
            ):
                return
            put_back = withdraw_checkpoint(self._layout, lock, job.step, held=job.held)
            restored = restored_copy(self._layout, lock, job.step, current) if put_back else None
            self._view.withdraw(job.step, restored)
            if restored is not None and self._on_commit is not None:
                # In line for its upload again: a try while the part stood in its place found
                # another copy there, and dropped it.
                self._on_commit(restored)
            if self._session.deleter is not None:
                self._session.deleter.schedule()
        except Exception as e:
            logger.warning("safeckpt: could not withdraw this node's part of step %d (%s)", job.step, e)


def is_held(name: str) -> bool:
    """Whether the ``.staging`` entry ``name`` is a copy held aside (a start keeps it)."""
    return name.rpartition(".")[2].startswith(_HELD)


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
    of a part and the nodes' agreement on it), and the other entries under a held name: a save's
    own staging (its part is named after it, a held copy's is not), or anything unreadable."""
    held, other = [], []
    for entry in layout.staging_entries():
        if not is_held(entry.name):
            continue
        try:
            record = read_record(entry)
        except (CheckpointError, OSError):
            record = None
        if record is not None and record.committed and record.part_id not in (None, entry.name):
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
