"""Agreement on the outcome of every collective call (``save``, ``wait``, ``flush``, ``close``,
``restore``, ``pin``): all ranks succeed, or all raise the same error; and one view of the
committed checkpoints on every rank.

Each rank says which call it is in, so ranks in different calls raise
:class:`RankAgreementError` naming each one's instead of pairing up. A failed
background save is raised once, at the next call, on every rank.
"""

from __future__ import annotations

import logging
from typing import Any

from .._dist.participants import Participants, agreed_error
from .._dist.participants import portable as _portable
from ..errors import CheckpointError, RankAgreementError, SaveFailedError
from .saves import SaveView

logger = logging.getLogger("safeckpt.manager")


class Outcomes:
    """Agreement on each collective call's outcome, and rank 0's view shared with every rank.

    Call rules: every method is collective over the group it is given (``conclude``:
    the control group); every rank calls it in the same order.
    """

    def __init__(self, ranks: Participants, view: SaveView, *, own_view: bool = False) -> None:
        """``own_view``: this rank keeps its own view (it commits in a root rank 0 does not see:
        ``TierSetup.sharing``)."""
        self._ranks = ranks
        self._view = view
        self._own_view = own_view

    def share_view(self, group: Any, *, what: str) -> None:
        """Every rank's view of committed checkpoints becomes rank 0's, so queries
        (``latest_step``, ``checkpoints()``) answer the same on every rank without a collective."""
        if not self._ranks.distributed:
            return
        mine = self._view.snapshot() if self._ranks.is_leader else None
        snapshot = self._ranks.broadcast(mine, group, what=what)
        if not self._ranks.is_leader and not self._own_view:
            self._view.load_snapshot(snapshot)

    def same_call(self, what: str) -> None:
        """Before a collective that is not a :meth:`conclude`: every rank is in call ``what``, or
        every rank raises :class:`RankAgreementError` (a rank in a :meth:`conclude` raises it too:
        the same gather)."""
        gathered = self._ranks.gather((what, None, {}), self._ranks.control, what=what)
        self._same_calls([call for call, _, _ in gathered], None)

    def _same_calls(self, calls: list[str], step: int | None) -> None:
        if len(set(calls)) > 1:
            doing = {rank: f"in {call}" for rank, call in enumerate(calls)}
            listing = "; ".join(f"rank {r}: {c}" for r, c in doing.items())
            raise RankAgreementError(
                f"the ranks are in different calls ({listing}): every rank must call save, wait, "
                "flush, restore, close and pin in the same order. Nothing of these calls was "
                "committed; fix the training loop so all ranks make the same calls.",
                failures=doing,
                step=step,
                rank=self._ranks.rank,
            )

    def conclude(
        self,
        error: BaseException | None,
        *,
        what: str,
        step: int | None = None,
        defer_background: bool = False,
    ) -> CheckpointError | None:
        """Agreement at the end of save/wait/flush/close/restore: every rank raises the same error.

        Every rank says which call it is in (``what``): ranks in different calls
        raise :class:`RankAgreementError` naming each one's. A background save
        that failed is raised first, once (it is then cleared on every rank);
        with ``defer_background`` it is returned instead, for the caller to
        raise once its own work is done. Otherwise ``error`` from any rank.
        """
        mine = self._view.unraised()
        gathered = self._ranks.gather(
            (what, _portable(error), {seq: _portable(e) for seq, e in mine.items()}),
            self._ranks.control,
            what=what,
        )
        self._same_calls([call for call, _, _ in gathered], step)
        failures: dict[int, BaseException] = {}
        for _, _, theirs in gathered:
            for seq, e in theirs.items():
                failures.setdefault(seq, e)
        self._view.raised(failures)
        errors = {rank: e for rank, (_, e, _) in enumerate(gathered) if e is not None}
        if failures:
            first = failures[min(failures)]
            if len(failures) > 1:
                logger.error("safeckpt: %d background saves failed; raising the first", len(failures))
            if errors:
                logger.error("safeckpt: %s also failed: %s", what, errors[min(errors)])
            elif defer_background:
                return first  # type: ignore[return-value]
            raise first
        if not errors:
            return None
        if not self._ranks.distributed:
            assert error is not None
            raise error
        raise agreed_error(errors, what=what, step=step)


def taken_anyway(earlier: CheckpointError, step: int, *, async_save: bool) -> CheckpointError:
    """An earlier background failure, raised at ``save(step)`` after that save was taken."""
    fate = "is being written in the background" if async_save else "was committed"
    text = (
        f"{earlier} This call, save(step={step}), was taken all the same and {fate}; the failure "
        f"reported here is that of the earlier step {earlier.step}."
    )
    if isinstance(earlier, SaveFailedError):
        error: CheckpointError = SaveFailedError(
            text, step=earlier.step, path=earlier.path, cause=earlier.cause, failures=earlier.failures
        )
    elif isinstance(earlier, RankAgreementError):
        error = RankAgreementError(text, failures=earlier.failures, step=earlier.step, path=earlier.path)
    else:
        error = CheckpointError(text, step=earlier.step, path=earlier.path)
    error.__cause__ = earlier
    return error
