"""A node's commits of its parts of saves, with a local tier on each node's own disk.

Each node's leader commits its node's part with the whole protocol, before the
nodes agree that every part is in. So a part that replaces a commit of its
step (a step saved again) holds the old copy aside, in ``.staging`` (not in the
trash, which the deleter empties), until then: a save another node failed is
taken back (:func:`~safeckpt._root.withdraw.withdraw_checkpoint`) and the old
copy put back in its place; a save every node committed sends it to the trash.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from .._format.layout import PRUNED, Layout
from .._format.record import amend_record, read_record
from .._root.withdraw import withdraw_checkpoint
from .._store.loc import Loc
from .saves import Committed, SaveJob, SaveView
from .session import RootSession

logger = logging.getLogger("safeckpt.manager")


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
        return self._layout.staging_dir(job.step, uuid.uuid4().hex[:12]) if part is not None else None

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
                if job.held.entry() is not None:
                    self._layout.store.move(job.held.key, self._layout.new_trash_path(job.step, PRUNED).key)
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
            restored = self._restored(job.step, current) if put_back else None
            self._view.withdraw(job.step, restored)
            if restored is not None and self._on_commit is not None:
                # In line for its upload again: a try while the part stood in its place found
                # another copy there, and dropped it.
                self._on_commit(restored)
            if self._session.deleter is not None:
                self._session.deleter.schedule()
        except Exception as e:
            logger.warning("safeckpt: could not withdraw this node's part of step %d (%s)", job.step, e)

    def _restored(self, step: int, withdrawn: Committed) -> Committed | None:
        """The copy put back in place of ``withdrawn``, as its record says now; pinned if a pin of
        the step came while the withdrawn part stood there."""
        lock = self._session.lock
        assert lock is not None
        target = self._layout.step_dir(step)
        record = read_record(target)
        if record is None:
            return None
        if withdrawn.record.pinned and not record.pinned:
            record = amend_record(target, lock, pinned=True)
        return Committed(target, record)
