"""Resuming on every rank: rank 0 chooses, every rank checks its own files, all load or fall back.

The restore half of :class:`~safeckpt.manager.CheckpointManager`: auto-resume
takes the newest commit that every rank can load, stepping over a damaged one
on every rank together; an explicit step raises the same error on every rank.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from .distributed import Participants, agreed_error
from .distributed import portable as _portable
from .layout import Layout
from .record import Record
from .restore import SKIPPABLE, choose_checkpoint

logger = logging.getLogger("safeckpt.manager")

_WRITE_ERRORS = (Exception, CheckpointException)


class ResumePath:
    """How a manager picks the checkpoint every rank loads."""

    _parts: Participants
    _layout: Layout

    def _choose(
        self, step: int | None, path: str | os.PathLike[str] | None, excluded: set[int]
    ) -> tuple[Path, Record] | None:
        """Rank 0 chooses; every rank gets the same choice, or the same error."""
        parts = self._parts
        choice: tuple[str, dict[str, Any]] | None = None
        error: BaseException | None = None
        if parts.is_leader:
            try:
                found = choose_checkpoint(self._layout, step, path, exclude=excluded)
                choice = None if found is None else (str(found[0]), found[1].to_json())
            except Exception as e:
                error = e
        choice, error = parts.broadcast(
            (choice, _portable(error)), parts.control, what="choosing the checkpoint to restore"
        )
        if error is not None:
            raise error
        if choice is None:
            return None
        directory = Path(choice[0])
        return directory, Record.from_json(choice[1], path=str(directory))

    def _skip_or_raise(
        self, error: BaseException | None, what: str, record: Record, auto: bool
    ) -> bool:
        """Agree on ``error``: False if every rank succeeded; True to fall back (auto-resume past
        damage); else raise the same error on every rank."""
        gathered = self._parts.gather(_portable(error), self._parts.control, what=what)
        failed = {rank: e for rank, e in enumerate(gathered) if e is not None}
        if not failed:
            return False
        if auto and all(isinstance(e, SKIPPABLE) for e in failed.values()):
            logger.warning(
                "safeckpt: step %d cannot be loaded (%s); falling back to the commit before it",
                record.step,
                "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items())),
            )
            return True
        if not self._parts.distributed:
            assert error is not None
            raise error
        raise agreed_error(failed, what=what, step=record.step)


def _attempt(fn: Any, *args: Any) -> BaseException | None:
    try:
        fn(*args)
    except _WRITE_ERRORS as e:
        return e
    return None
