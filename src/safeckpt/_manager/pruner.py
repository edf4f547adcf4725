"""Pruning one root (rank 0): committed checkpoints that retention drops go to the trash.

Retention decides on the view of saves (:meth:`~.saves.SaveView.prune_plan`), never on a
listing: never ``latest``, a step with a save in flight, or a pinned one (re-read from its record:
``safeckpt pin`` changes only the record), nor what the caller protects for now (a registration
still running, a commit not in every tier yet): that is pruned at a later commit, or at
``close()``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from .._format.layout import Layout
from .._format.record import read_record
from .._policy.retention import Policy, Retention, explain, retention_json, with_pinned
from .._root.removal import discard_checkpoint
from ..errors import CheckpointError, IncompleteCheckpointError
from .saves import Committed, SaveView
from .session import RootSession

logger = logging.getLogger("safeckpt.manager")


class Pruner:
    """Rank 0's pruning of one root. Call rules: rank 0, while no save is being committed there
    (the writer thread, or ``pin``/``close()`` once the writer is idle)."""

    def __init__(
        self,
        root: Path | str,
        retention: Retention | Policy,
        *,
        layout: Layout,
        view: SaveView,
        session: RootSession,
        registering: Callable[[], frozenset[int]] = frozenset,
        protected: Callable[[], frozenset[int]] = frozenset,
    ) -> None:
        """``registering``: steps whose registration has not ended; ``protected``: other steps to
        keep for now (both asked at each prune)."""
        self.root = root
        self.retention = retention
        self.policy = with_pinned(retention)
        self._layout = layout
        self._view = view
        self._session = session
        self._registering_now = registering
        self._protected_now = protected
        self._deferred: set[int] = set()  # steps retention drops, kept for now (see prune)
        self._registering: set[int] = set()  # steps retention drops, kept while they register
        self._warned_narrower: set[int] = set()  # steps warned about as an earlier run's retention kept

    def prune(self) -> None:
        """Rank 0: move committed checkpoints that retention drops into the trash.

        Never the one ``latest`` names, one with a save in flight, one pinned
        (the pin is re-read from the record, as a ``safeckpt pin`` may have set it),
        one whose registration is queued or running (up to ``registration_timeout`` once it
        runs), or one ``protected`` says to keep for now. What that keeps back is pruned at a
        later commit or at ``close()``.
        """
        assert self._session.lock is not None
        self._refresh_pins()
        registering = self._registering_now()
        protected = self._protected_now()  # with local_dir=: commits not in every tier yet
        drop = self._view.prune_plan(self.policy, protected=registering | protected)
        deferred = self._view.prune_plan(self.policy) - drop if registering or protected else frozenset()
        if (deferred & registering) - self._registering:
            logger.info(
                "safeckpt: keeping step(s) %s until their registration ends",
                ", ".join(map(str, sorted(deferred & registering))),
            )
        self._registering = set(deferred & registering)
        self._deferred = set(deferred)
        if drop:
            self._warn_narrower_retention(drop)
        removed = []
        for step in sorted(drop):
            try:
                if self._trash_one(step):
                    removed.append(step)
            except OSError as e:
                logger.warning("safeckpt: could not prune step %d (%s); will retry", step, e)
        if removed:
            logger.info("safeckpt: pruned step(s) %s of %s", ", ".join(map(str, removed)), self.root)
            assert self._session.deleter is not None
            self._session.deleter.schedule()

    def _warn_narrower_retention(self, drop: frozenset[int]) -> None:
        """Rank 0, before removing ``drop``: warn, once per step, about those that the retention of
        the run that wrote the newest older record kept (a resume with narrower rules)."""
        current = json.loads(json.dumps(retention_json(self.retention)))  # as a record reads back
        earlier = self._view.earlier_retention(current)
        if earlier is None:
            return
        try:
            rules = Retention.from_json(earlier)
        except (CheckpointError, TypeError, ValueError):
            return  # a custom policy cannot be rebuilt: nothing to compare with
        infos = [c.info() for c in self._view.committed()]
        reasons = explain(infos, rules)
        lost = {s: reasons[s] for s in sorted(drop - self._warned_narrower) if reasons.get(s)}
        if not lost:
            return
        self._warned_narrower.update(lost)
        logger.warning(
            "safeckpt: this run's retention (%s) is narrower than the one that wrote this root's earlier "
            "checkpoints (%s): it now removes %s, which that retention kept. Pass the earlier rules "
            "(or pin these steps: `safeckpt pin ROOT STEP`) to keep them.",
            self.policy.reason(),
            rules.policy().reason(),
            "; ".join(f"step {s} ({', '.join(why)})" for s, why in lost.items()),
        )

    def prune_deferred(self) -> None:
        """Rank 0 at ``close()``, after the registrations and the tiers ended: prune what they kept."""
        if not self._deferred or self._session.deleter is None:
            return
        try:
            self.prune()
        except Exception as e:  # pruning never fails the job
            logger.warning("safeckpt: pruning after the registrations ended failed: %s", e)

    def _refresh_pins(self) -> None:
        """Re-read the records of pinned checkpoints: a `safeckpt unpin` changes only the record."""
        for entry in self._view.pinned():
            try:
                record = read_record(entry.path)
            except IncompleteCheckpointError:
                continue
            if record is not None and not record.pinned:
                self._view.update(Committed(entry.path, record))

    def _trash_one(self, step: int) -> bool:
        assert self._session.lock is not None
        moved, record = discard_checkpoint(self._layout, self._session.lock, step)
        if moved:
            self._view.forget(step)
        elif record is not None:
            self._view.update(Committed(self._layout.step_dir(step), record))
        return moved
