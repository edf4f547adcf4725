"""The one view of saves that the writer and retention share.

Every save is queued, writing, committed, cancelled or failed, and both the
background writer and retention act on this view, under its lock: a removal
is a decision about the view, never a blind ``rm`` of a path. Rank 0's view is
authoritative; the other ranks track only their own jobs and failures. The
saves in flight are a :class:`~safeckpt._manager.ledger.SaveLedger` keyed by
step, sharing the view's lock.

Lock order: the sidecar lock may be held when the view lock is taken, never
the other way round.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from time import monotonic
from typing import Any

from .._format.record import Record
from .._policy.retention import CheckpointInfo, Policy, Retention, explain, plan_removals
from .._store.loc import Loc
from ..errors import CheckpointError
from .background import COMMITTED, QUEUED, WRITING, SaveState, StagingPool, StagingSlot
from .ledger import Flight, SaveLedger
from .overlap import OverlappedCopy


@dataclass(eq=False)
class SaveJob(Flight):
    """One save, from ``save()`` to its outcome.

    ``status`` changes only through :class:`SaveView` (under its lock), and a
    job reaches exactly one terminal state: the first one it is given.
    """

    seq: int
    step: int
    staging_dir: Loc
    dcp_state: Any
    encode_train_state: Callable[[], bytes]
    """The train-state file's bytes, made when the writer asks (see ``_state.walk.Captured``)."""
    metrics: Mapping[str, float | None]
    extra: Mapping[str, Any]
    time: float
    pinned: bool = False
    slot: StagingSlot | None = None
    pending: OverlappedCopy | None = None  # overlap_staging: the copy still running into the slot
    committed_here: bool = False  # this rank committed it in its root (set by the commit itself)
    untrained: frozenset[str] = frozenset()
    """The DCP keys of the tensors nothing trains: written apart, shared where unchanged."""
    digests: dict[str, str] = field(default_factory=dict)  # of untrained host tensors, at save()
    live: frozenset[str] = frozenset()  # untrained tensors not copied: unchanged since the last save()
    submitted: float = field(default_factory=monotonic)  # (the field `time` hides the module here)

    @functools.cached_property
    def train_state(self) -> bytes:
        return self.encode_train_state()

    def info(self) -> CheckpointInfo:
        return CheckpointInfo(self.step, self.metrics, self.time, self.pinned)

    def release_staging(self, pool: StagingPool | None) -> None:
        """Drop references to staged data and give the slot back (idempotent)."""
        self.dcp_state = None
        if self.slot is not None and pool is not None:
            pool.release(self.slot)
        self.slot = None


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointStatus:
    """A checkpoint as the manager sees it (``mgr.checkpoints()``)."""

    step: int
    status: str
    """``"committed"``, ``"queued"`` or ``"writing"``."""
    path: Path | str | None
    metrics: Mapping[str, float | None]
    pinned: bool
    kept_because: tuple[str, ...]
    """Why retention keeps it; empty for one the next prune removes."""


@dataclass(frozen=True)
class Committed:
    path: Loc
    record: Record

    def info(self) -> CheckpointInfo:
        r = self.record
        return CheckpointInfo(r.step, r.metrics, r.time, r.pinned)


def _commit_order(entry: Committed) -> tuple[int, int]:
    seq = entry.record.seq
    return (seq if seq is not None else -1, entry.record.step)


class SaveView:
    """Committed checkpoints, ``latest``, saves in flight and failures not yet raised."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # the ledger's too: one decision sees both
        self._committed: dict[int, Committed] = {}
        self._latest: int | None = None
        self._jobs: SaveLedger[int, SaveJob] = SaveLedger(self._lock)  # queued and writing, by step
        self._failures: dict[int, CheckpointError] = {}  # seq -> error not raised yet
        self._next_seq = 1  # commit sequence (records order commits by it)
        self._reported: set[int] = set()

    # --- committed checkpoints ---------------------------------------------------

    def load(self, committed: Iterable[Committed], latest: int | None, *, next_seq: int = 1) -> None:
        with self._lock:
            self._committed = {c.record.step: c for c in committed}
            self._latest = latest if latest in self._committed else None
            self._next_seq = max(self._next_seq, next_seq)

    def snapshot(self) -> tuple[list[Committed], int | None, int]:
        """Committed checkpoints (records without their checksums), ``latest``, the next sequence."""
        with self._lock:
            committed = [
                Committed(c.path, dataclasses.replace(c.record, checksums=None))
                for c in self._committed.values()
            ]
            return committed, self._latest, self._next_seq

    def load_snapshot(self, snapshot: tuple[list[Committed], int | None, int]) -> None:
        committed, latest, next_seq = snapshot
        with self._lock:
            self._committed = {c.record.step: c for c in committed}
            self._latest = latest
            self._next_seq = next_seq

    def take_seq(self) -> int:
        """The commit sequence number of the commit about to happen (rank 0)."""
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            return seq

    @property
    def latest(self) -> int | None:
        with self._lock:
            return self._latest

    def get(self, step: int) -> Committed | None:
        with self._lock:
            return self._committed.get(step)

    def commit(self, entry: Committed) -> None:
        """``entry`` is committed and ``latest`` names it."""
        with self._lock:
            self._committed[entry.record.step] = entry
            self._latest = entry.record.step

    def update(self, entry: Committed) -> None:
        """A committed checkpoint's record changed (pin, registration, a tier's mark); ignored if it
        is gone, or if its step was committed again since (another ``seq``): an amendment made on
        another thread must never stand in for the newer commit."""
        with self._lock:
            current = self._committed.get(entry.record.step)
            if current is not None and current.record.seq == entry.record.seq:
                self._committed[entry.record.step] = entry

    def forget(self, step: int) -> None:
        with self._lock:
            self._committed.pop(step, None)

    def withdraw(self, step: int, previous: Committed | None) -> None:
        """``step``'s newest commit was taken back (it must not count: see :mod:`.tiering`), and
        ``previous``, the commit it replaced, put back if there was one; ``latest`` becomes the
        newest commit, as the root's pointer does."""
        with self._lock:
            self._committed.pop(step, None)
            if previous is not None:
                self._committed[step] = previous
            self._latest = self._newest_step()

    def drop(self, steps: Iterable[int]) -> None:
        """These committed steps left the root as unloadable (moved aside), though ``latest`` could
        name them; ``latest`` becomes the newest commit left, as the root's pointer does."""
        with self._lock:
            for step in steps:
                self._committed.pop(step, None)
            if self._latest not in self._committed:
                self._latest = self._newest_step()

    def _newest_step(self) -> int | None:
        newest = max(self._committed.values(), key=_commit_order, default=None)
        return newest.record.step if newest is not None else None

    def committed(self) -> list[Committed]:
        with self._lock:
            return list(self._committed.values())

    def earlier_retention(self, current: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The retention recorded by the newest commit whose record holds another one than
        ``current`` (the rules of an earlier run of this root), or None."""
        with self._lock:
            newest_first = sorted(self._committed.values(), key=_commit_order, reverse=True)
        for entry in newest_first:
            recorded = entry.record.retention
            if recorded is not None and dict(recorded) != dict(current):
                return recorded
        return None

    def pinned(self) -> list[Committed]:
        with self._lock:
            return [c for c in self._committed.values() if c.record.pinned]

    # --- saves in flight ---------------------------------------------------------------

    def newest_step(self, *, ignore: Iterable[int] = ()) -> int | None:
        """The highest step committed or in flight, but for committed steps in ``ignore``."""
        with self._lock:
            known = (set(self._committed) - set(ignore)) | set(self._jobs.keys())
        return max(known, default=None)

    def add(self, job: SaveJob) -> None:
        self._jobs.add(job.step, job)

    def start(self, job: SaveJob, cancel: bool) -> None:
        """The writer picked ``job`` up: it is cancelled (and leaves the view) or being written."""
        self._jobs.start(job, cancel=cancel)

    def finish(self, job: SaveJob, status: SaveState, error: BaseException | None = None) -> bool:
        """``job`` left flight as ``status``; an ``error`` is kept until it is raised.

        Only the first terminal state counts (a failure while cleaning up after
        a failure does not end the job twice); returns whether this one did.
        """
        with self._lock:
            if not self._jobs.finish(job, status, error):
                return False
            if error is not None and job.seq not in self._reported:
                self._failures[job.seq] = error  # type: ignore[assignment]
            return True

    def pin_jobs(self, step: int, pinned: bool) -> bool:
        """Pin (or unpin) the saves of ``step`` in flight; whether there were any."""
        with self._lock:
            jobs = self._jobs.in_flight(step)
            for job in jobs:
                job.pinned = pinned
                if pinned:
                    self._jobs.withdraw_cancel(job)
            return bool(jobs)

    # --- failures ------------------------------------------------------------------------

    def unraised(self) -> dict[int, CheckpointError]:
        with self._lock:
            return dict(self._failures)

    def raised(self, seqs: Iterable[int]) -> None:
        """These failures were raised (on some rank): never raise them again."""
        with self._lock:
            for seq in seqs:
                self._failures.pop(seq, None)
                self._reported.add(seq)

    # --- retention decisions ---------------------------------------------------------------

    def cancel_out_of_retention(self, policy: Policy) -> list[SaveJob]:
        """Mark queued saves that ``policy`` drops, given everything in flight; the ones marked.

        The newest save is never cancelled (it becomes ``latest``), nor one
        being written, nor the checkpoint ``latest`` names.
        """
        with self._lock:
            jobs = self._jobs.in_flight()
            # Only a queued save older than the newest can be marked. Without one (the usual
            # case: one save in flight) there is nothing to decide: skip the O(checkpoints) plan.
            if not any(j.status == QUEUED and not j.cancel_requested for j in jobs[:-1]):
                return []
            pending = {j.step for j in jobs}
            infos = {c.record.step: c.info() for s, c in self._committed.items() if s not in pending}
            infos.update({j.step: j.info() for j in jobs})  # a re-save supersedes
            protected = {j.step for j in jobs if j.status == WRITING}
            protected.add(jobs[-1].step)
            if self._latest is not None:
                protected.add(self._latest)
            drop = plan_removals(list(infos.values()), policy, protected)
            # Marked, not cancelled: the writer cancels it once every rank agrees (see start).
            return [j for j in jobs if j.step in drop and not j.pinned and self._jobs.request_cancel(j)]

    def prune_plan(self, policy: Policy, *, protected: Iterable[int] = ()) -> frozenset[int]:
        """Committed steps ``policy`` drops, judged by committed checkpoints only.

        Never ``latest`` nor a step with a save in flight: a checkpoint is not
        removed because of saves that may still fail. Nor a step in ``protected``
        (its registration has not ended, or it is not in every tier yet).
        """
        with self._lock:
            infos = [c.info() for c in self._committed.values()]
            protected = set(self._jobs.keys()) | set(protected)
            if self._latest is not None:
                protected.add(self._latest)
            return plan_removals(infos, policy, protected)

    def statuses(self, retention: Retention | Policy) -> list[CheckpointStatus]:
        """Committed and in-flight checkpoints, by step, with why each is kept."""
        with self._lock:
            committed = dict(self._committed)
            jobs = self._jobs.in_flight()
            latest = self._latest
        infos = [c.info() for c in committed.values()]
        reasons = explain(infos, retention, {latest: "latest"} if latest is not None else {})
        out = [
            CheckpointStatus(
                step, COMMITTED, c.path.where, dict(c.record.metrics), c.record.pinned, tuple(reasons[step])
            )
            for step, c in committed.items()
        ]
        out += [
            CheckpointStatus(j.step, j.status, None, dict(j.metrics), j.pinned, ("in flight",)) for j in jobs
        ]
        return sorted(out, key=lambda s: (s.step, s.status != COMMITTED))
