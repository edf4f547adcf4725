"""Pins: checkpoints kept whatever retention says, stored in their records.

A pin is a flag in the checkpoint's record, amended under the sidecar lock by
rank 0; a save still in flight takes the pin with it when it commits (the
commit holds the same lock, so a pin never falls between the two). Unpinning
lets retention decide again at once. With two tiers, the durable copy is
pinned too (and a step only the durable tier still holds can be pinned there).
"""

from __future__ import annotations

from pathlib import Path

from .._dist.participants import Participants
from .._format.record import amend_record
from .._util.validate import validate_step
from ..errors import CheckpointError, CheckpointNotFoundError
from .committer import Committer
from .durable import DurableTier
from .outcomes import Outcomes
from .saves import Committed, SaveView
from .session import RootSession

__all__ = ["Pins"]


class Pins:
    """``pin`` and ``unpin`` of a manager. Call rules: collective over the control group."""

    def __init__(
        self,
        root: Path,
        *,
        parts: Participants,
        view: SaveView,
        session: RootSession,
        committer: Committer,
        outcomes: Outcomes,
        durable: DurableTier | None = None,
    ) -> None:
        self.root = root
        self._durable = durable  # two tiers: the durable copy is pinned too
        self._parts = parts
        self._view = view
        self._session = session
        self._committer = committer
        self._outcomes = outcomes

    def set_pinned(self, step: int, pinned: bool) -> None:
        """Rank 0 changes the record; every rank returns or raises the same."""
        what = f"{'pin' if pinned else 'unpin'}({step})"
        error: BaseException | None = None
        if self._parts.is_leader:
            try:
                self._set_pinned_here(validate_step(step), pinned)
            except Exception as e:
                error = e
        self._parts.agree(error, self._parts.control, what=what)
        self._outcomes.share_view(self._parts.control, what=what)

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
        # After the local copy, outside its lock (the durable root may be slow or down): an upload
        # that read the local record before this pin makes the durable copy's pin the local one's
        # when it marks that record, under the local lock.
        durable = self._set_pinned_durable(step, pinned, here=entry is not None or in_flight)
        if entry is None and not in_flight and not durable:
            raise CheckpointNotFoundError(
                f"there is no checkpoint of step {step} in {self.root} to {verb}; see "
                "mgr.checkpoints() for the saved steps.",
                step=step,
                path=str(self.root),
            )
        if not pinned:
            self._committer.prune()

    def _set_pinned_durable(self, step: int, pinned: bool, *, here: bool) -> bool:
        """The durable copy's pin (two tiers); whether the durable root has one. ``here``: the local
        copy took the pin already (the error then says so)."""
        if self._durable is None:
            return False
        try:
            return self._durable.set_pinned(step, pinned)
        except (CheckpointError, OSError) as e:
            verb, done = ("pin", "pinned") if pinned else ("unpin", "unpinned")
            local = f"step {step} is {done} in {self.root}, but " if here else ""
            raise CheckpointError(
                f"{verb}({step}): {local}its durable copy in {self._durable.root} could not be "
                f"{done} ({type(e).__name__}: {e}). Call {verb}({step}) again once "
                f"{self._durable.root} can be written.",
                step=step,
                path=str(self._durable.root),
            ) from e
