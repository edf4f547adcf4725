"""``should_save``: the schedule, rank 0's clock and preemption signals, one answer on every rank.

The :class:`~safeckpt._policy.schedule.SaveSchedule` is pure (steps and seconds in, a
decision out); this is its live half in :class:`~safeckpt.CheckpointManager`:
the ``every_seconds`` clock is rank 0's, a signal counts on whichever rank
received it, and one small collective over the manager's control group makes
the answer the same everywhere.
"""

from __future__ import annotations

import logging
import time

from .._dist.participants import Participants
from .._policy.schedule import SaveSchedule
from .._util.validate import validate_step
from .preemption import PreemptionHandlers, signal_name

logger = logging.getLogger("safeckpt.manager")

__all__ = ["Triggers"]


def _never_due(schedule: SaveSchedule | None) -> bool:
    """Whether ``schedule`` says no step is ever due (none given, or one with no rule)."""
    return schedule is None or (schedule.every is None and schedule.milestones is None and not schedule.timed)


class Triggers:
    """When the training loop should save: the schedule, rank 0's clock, preemption signals.

    Call rules: ``should_save`` is collective over the control group when the
    schedule is timed or signals are installed (call it on every rank, once
    per step); ``saved()`` after each ``save()`` call restarts the clock.
    """

    def __init__(
        self, ranks: Participants, schedule: SaveSchedule | None, signals: PreemptionHandlers
    ) -> None:
        self.schedule = schedule
        self._ranks = ranks
        self._signals = signals
        self._last_save = time.monotonic()  # SaveSchedule(every_seconds=...) counts from here
        self._preempted_by: int | None = None
        self._warned_never_due = False

    def saved(self) -> None:
        """A ``save()`` was called: ``every_seconds`` counts from now."""
        self._last_save = time.monotonic()

    def should_save(self, step: int) -> bool:
        """Whether to save ``step`` now, the same on every rank (see ``CheckpointManager.should_save``)."""
        step = validate_step(step)
        schedule = self.schedule
        if not self._signals.signals and _never_due(schedule):
            self._warn_never_due()
        due = schedule is not None and schedule.due_at_step(step)
        timed = schedule is not None and schedule.timed
        if not (timed or self._signals.signals):
            return due
        mine = self._signals.take()
        clock = bool(
            timed
            and self._ranks.is_leader
            and schedule is not None
            and schedule.due_by_time(time.monotonic() - self._last_save)
        )
        gathered = self._ranks.gather((mine, clock), self._ranks.control, what=f"should_save({step})")
        received = [(rank, sig) for rank, (sig, _) in enumerate(gathered) if sig is not None]
        if received:
            if self._preempted_by is None:
                self._preempted_by = received[0][1]
            logger.warning(
                "safeckpt: %s; saving step %d, then the loop should stop",
                ", ".join(f"rank {r} received {signal_name(sig)}" for r, sig in received),
                step,
            )
            return True
        return due or bool(gathered[0][1])

    def _warn_never_due(self) -> None:
        # should_save() then answers False for every step, and a loop that saves only
        # when it says so never saves: say it once, not once per step
        if self._warned_never_due:
            return
        self._warned_never_due = True
        logger.warning(
            "safeckpt: should_save() answers False for every step: this manager has no save schedule "
            "(and no preemption_signals). Pass schedule=SaveSchedule(every=N) (or milestones=..., "
            "every_seconds=...) to CheckpointManager, or call save() without asking should_save()."
        )

    @property
    def preempted(self) -> bool:
        """True once :meth:`should_save` has seen a preemption signal (on any rank); same on every rank."""
        return self._preempted_by is not None

    @property
    def preemption_signal(self) -> int | None:
        """The signal that preempted the run (the lowest rank's), or None: exit with ``128 +`` it."""
        return self._preempted_by
