"""Pins: checkpoints kept whatever retention says, stored in their records.

A pin is a flag in the checkpoint's record, amended under the sidecar lock by
rank 0; a save still in flight takes the pin with it when it commits (the
commit holds the same lock, so a pin never falls between the two). Unpinning
lets retention decide again at once. With tiers beside the root (``local_dir=``),
their copies are pinned too (:meth:`~.tiering.Copies.pin`; a step only they
still hold can be pinned there).
"""

from __future__ import annotations

from pathlib import Path

from .._dist.participants import Participants
from .._format.record import amend_record
from .._util.validate import validate_step
from ..errors import CheckpointError, CheckpointNotFoundError
from .committer import Committer
from .outcomes import Outcomes
from .saves import Committed, SaveView
from .session import RootSession
from .tiering import Copies

__all__ = ["Pins"]


class Pins:
    """``pin`` and ``unpin`` of a manager. Call rules: collective over the control group."""

    def __init__(
        self,
        root: Path | str,  # as messages name it
        *,
        ranks: Participants,
        view: SaveView,
        session: RootSession,
        committer: Committer,
        outcomes: Outcomes,
        copies: Copies | None = None,
    ) -> None:
        self.root = root
        self._copies = copies  # beside the root (local_dir=): their copies are pinned too
        self._ranks = ranks
        self._view = view
        self._session = session
        self._committer = committer
        self._outcomes = outcomes

    def set_pinned(self, step: int, pinned: bool) -> None:
        """Rank 0 changes the record; every rank returns or raises the same."""
        what = f"{'pin' if pinned else 'unpin'}({step})"
        error: BaseException | None = None
        if self._ranks.is_leader:
            try:
                self._set_pinned_here(validate_step(step), pinned)
            except Exception as e:
                error = e
        self._ranks.agree(error, self._ranks.control, what=what)
        self._outcomes.share_view(self._ranks.control, what=what)

    def _set_pinned_here(self, step: int, pinned: bool) -> None:
        verb = "pin" if pinned else "unpin"
        self._session.ensure_writer(f"{verb}({step})")
        lock = self._session.lock
        assert lock is not None
        with lock:  # the commit of this step holds it too: a pin never falls between
            entry = self._view.get(step)
            in_flight = self._view.pin_jobs(step, pinned)
            if entry is not None:
                try:
                    record = amend_record(entry.path, lock, pinned=pinned)
                except OSError as e:
                    raise CheckpointError(
                        f"{verb}({step}): its record in {entry.path} could not be changed "
                        f"({type(e).__name__}: {e}); nothing was changed. Check the disk and call "
                        f"{verb}({step}) again.",
                        step=step,
                        path=str(entry.path),
                    ) from e
                self._view.update(Committed(entry.path, record))
        # After this root's copy, outside its lock: another root may be slow or down.
        here = entry is not None or in_flight
        elsewhere = self._copies is not None and self._copies.pin(step, pinned, here=here)
        if not here and not elsewhere:
            raise CheckpointNotFoundError(
                f"there is no checkpoint of step {step} in {self.root} to {verb}; see "
                "mgr.checkpoints() for the saved steps.",
                step=step,
                path=str(self.root),
            )
        if not pinned:
            self._committer.prune()
