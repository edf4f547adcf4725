"""Pins: checkpoints kept whatever retention says, stored in their records.

A pin is a flag in the checkpoint's record, amended under the sidecar lock by
rank 0; a save still in flight takes the pin with it when it commits (the
commit holds the same lock, so a pin never falls between the two). Unpinning
lets retention decide again at once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .._dist.participants import Participants
from .._format.record import amend_record
from .._fs.fileops import FileOps
from .._fs.lock import SidecarLock
from .._util.validate import validate_step
from ..errors import CheckpointNotFoundError
from .saves import Committed, SaveView

__all__ = ["Pins"]


class Pins:
    """``pin`` and ``unpin`` (a part of :class:`~safeckpt._manager.manager.CheckpointManager`)."""

    root: Path
    _parts: Participants
    _view: SaveView
    _lock: SidecarLock | None
    _ops: FileOps
    _check_open: Callable[[], None]
    _ensure_writer: Callable[[str], None]
    _share_view: Callable[..., None]
    _prune: Callable[[], None]

    def pin(self, step: int) -> None:
        """Keep ``step`` whatever retention says (stored in its record). Rank 0 acts; others no-op."""
        self._set_pinned(step, True)

    def unpin(self, step: int) -> None:
        """Let retention decide about ``step`` again."""
        self._set_pinned(step, False)

    def _set_pinned(self, step: int, pinned: bool) -> None:
        """Collective: rank 0 changes the record; every rank returns or raises the same."""
        self._check_open()
        what = f"{'pin' if pinned else 'unpin'}({step})"
        error: BaseException | None = None
        if self._parts.is_leader:
            try:
                self._set_pinned_here(validate_step(step), pinned)
            except Exception as e:
                error = e
        self._parts.agree(error, self._parts.control, what=what)
        self._share_view(self._parts.control, what=what)

    def _set_pinned_here(self, step: int, pinned: bool) -> None:
        self._ensure_writer(f"{'pin' if pinned else 'unpin'}({step})")
        assert self._lock is not None
        with self._lock:  # the commit of this step holds it too: a pin never falls between
            entry = self._view.get(step)
            in_flight = self._view.pin_jobs(step, pinned)
            if entry is None and not in_flight:
                raise CheckpointNotFoundError(
                    f"there is no checkpoint of step {step} in {self.root} to "
                    f"{'pin' if pinned else 'unpin'}; see mgr.checkpoints() for the saved steps.",
                    step=step,
                    path=str(self.root),
                )
            if entry is not None:
                record = amend_record(entry.path, self._lock, self._ops, pinned=pinned)
                self._view.update(Committed(entry.path, record))
        if not pinned:
            self._prune()
