"""``save()`` up to the hand-over: check the arguments, capture the state, stage it, queue it.

What happens after the hand-over (write, agree, commit, prune) is the
:class:`~safeckpt._manager.committer.Committer`'s, on the writer thread (or
inline for a sync save).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._dist.participants import Participants
from .._format.layout import Layout
from .._format.record import check_json_value, clean_metrics
from .._state.untrained import digests_at_save, untrained_keys
from .._state.walk import Captured, StateCache, capture
from .._util.gc_pause import collector_paused
from .._util.validate import int_or_none, validate_step
from ..errors import CheckpointError, InvalidSaveError, SaveFailedError
from .background import BackgroundWriter, StagingPool
from .committer import Committer
from .damaged import DamagedCommits
from .outcomes import Outcomes, taken_anyway
from .overlap import Copier, OverlappedCopy, stage_overlapped
from .saves import SaveJob, SaveView
from .session import RootSession
from .triggers import Triggers

logger = logging.getLogger("safeckpt.manager")


class Saver:
    """One ``save()`` call on one rank. Call rules: collective over the control group (every rank
    calls ``save`` for every save, in the same order); never two at once (the manager's API lock)."""

    def __init__(
        self,
        root: Path | str,  # as messages name it
        *,
        token: str,
        save_rng: bool,
        ranks: Participants,
        layout: Layout,
        view: SaveView,
        session: RootSession,
        damaged: DamagedCommits,
        committer: Committer,
        outcomes: Outcomes,
        triggers: Triggers,
        pool: StagingPool | None,
        writer: BackgroundWriter | None,
        state_cache: StateCache,
        overlap: bool = False,
    ) -> None:
        """``overlap``: stage in the background, guarded by hooks (:mod:`.overlap`)."""
        self.root = root
        self.save_rng = save_rng
        self._token = token  # the same on every rank: names the staging directory all ranks write
        self._ranks = ranks
        self._layout = layout
        self._view = view
        self._session = session
        self._damaged = damaged
        self._committer = committer
        self._outcomes = outcomes
        self._triggers = triggers
        self._pool = pool
        self._untrained_digests: dict[str, str] = {}  # at the last save(): what it need not copy
        self._writer = writer
        self._state_cache = state_cache
        self._overlap = overlap
        self._pending: OverlappedCopy | None = None  # the last save's copy, while it may run
        self._copier = Copier() if overlap else None
        self._seq = 0

    def settle(self) -> None:
        """Wait for the last save's overlapped copy and remove its hooks (training thread, outside
        a forward or a step: every manager call that reads or changes the state comes here first)."""
        pending = self._pending
        if pending is None:
            return
        pending.wait()
        if pending.remove_hooks():
            self._pending = None

    def close(self) -> None:
        """Settle, and stop the copy thread (``close()``)."""
        self.settle()
        if self._copier is not None:
            self._copier.close()

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None,
        extra: Mapping[str, Any] | None,
        overwrite: bool,
    ) -> None:
        # Every rank counts every call, also one that fails validation on one rank only:
        # the sequence number names the staging directory all ranks write into.
        self._seq += 1
        self._triggers.saved()
        self.settle()  # a copy still running when the next save comes: the one other wait
        error: BaseException | None = None
        job: SaveJob | None = None
        try:
            step = validate_step(step)
            clean = clean_metrics(metrics)
            check_json_value(dict(extra or {}), "extra")
            if self._ranks.is_leader:
                self._session.ensure_claimed(f"save(step={step})")
                self._check_order(step, overwrite)
            try:
                with collector_paused():  # thousands of small objects: see safeckpt._util.gc_pause
                    captured = capture(state, rng=self.save_rng, cache=self._state_cache)
            except CheckpointError:
                raise
            except Exception as e:  # a state_dict() that raised
                raise SaveFailedError(
                    f"save(step={step}): reading the state failed ({type(e).__name__}: {e}); nothing "
                    "was written and earlier checkpoints are untouched.",
                    step=step,
                    cause=e,
                ) from e
            job = self._new_job(step, captured.encode_train_state, clean, dict(extra or {}))
            job.untrained = untrained_keys(captured)
            if self._pool is not None:
                to_stage = self._untrained_unchanged(job, captured)
                job.slot = self._acquire_slot(step)
                with collector_paused():
                    if self._overlap:
                        job.dcp_state, job.pending = stage_overlapped(job.slot, to_stage)
                    else:
                        job.dcp_state = job.slot.stage(to_stage.dcp)
                if job.live:  # the live tensors in their places: DCP's plan keeps its order
                    job.dcp_state = {
                        k: v if k in job.live else job.dcp_state[k] for k, v in captured.dcp.items()
                    }
            else:
                job.dcp_state = captured.dcp
        except BaseException as e:
            error = e
            self._drop(job)
            if not isinstance(e, Exception):
                raise
        what = f"save({int_or_none(step)})"
        try:
            earlier = self._outcomes.conclude(error, what=what, step=int_or_none(step), defer_background=True)
        except BaseException:
            self._drop(job)
            raise
        assert job is not None
        if job.pending is not None:  # accepted on every rank: nothing may now leave it unstarted
            assert self._copier is not None
            self._pending = job.pending
            job.pending.start(self._copier)
        self._view.add(job)
        if self._writer is not None:
            self._writer.submit(job)
            if self._ranks.is_leader:
                for cancelled in self._view.cancel_out_of_retention(self._committer.policy):
                    logger.info(
                        "safeckpt: cancelling queued save of step %d (out of retention)", cancelled.step
                    )
        else:
            with collector_paused():  # a sync save blocks the caller anyway
                self._committer.persist(job)
            later = self._outcomes.conclude(None, what=what, step=step, defer_background=earlier is not None)
            earlier = earlier or later
        if earlier is not None:
            raise taken_anyway(earlier, job.step, async_save=self._writer is not None)

    def _untrained_unchanged(self, job: SaveJob, captured: Captured) -> Captured:
        """Digest the untrained tensors in host memory now; those with the digests of the last
        ``save()`` are left out of the copy (``job.live``). Returns what is still to be staged."""
        if not job.untrained or not self._committer.checks_live_tensors():
            return captured
        job.digests = digests_at_save(captured.dcp, job.untrained)
        earlier, self._untrained_digests = self._untrained_digests, dict(job.digests)
        job.live = frozenset(k for k, d in job.digests.items() if earlier.get(k) == d)
        if not job.live:
            return captured
        return dataclasses.replace(captured, dcp={k: v for k, v in captured.dcp.items() if k not in job.live})

    def _drop(self, job: SaveJob | None) -> None:
        """A save refused on some rank: its staging goes back, its copy never starts."""
        if job is None:
            return
        if job.pending is not None:
            job.pending.cancel()
        job.release_staging(self._pool)

    def _acquire_slot(self, step: int) -> Any:
        assert self._pool is not None
        try:
            return self._pool.acquire(timeout=self._ranks.timeout)
        except TimeoutError as e:
            raise SaveFailedError(
                f"save(step={step}): the previous save has not freed its staging buffers within "
                f"{self._ranks.timeout:g} s (its write is stuck: a hung filesystem?). Nothing of step "
                f"{step} was written; check the storage, or raise timeout.",
                step=step,
                cause=e,
            ) from e

    def _check_order(self, step: int, overwrite: bool) -> None:
        newest = self._view.newest_step(ignore=self._damaged.steps)
        if newest is not None and step < newest and not overwrite:
            raise InvalidSaveError(
                f"save(step={step}): step {newest} is already saved in {self.root}, and saving an "
                f"earlier step would make `latest` go back. If you restarted from an earlier "
                f"checkpoint on purpose, pass overwrite=True; checkpoints after step {step} are "
                "then kept until retention removes them. Nothing was written.",
                step=step,
                path=str(self.root),
            )

    def _new_job(
        self,
        step: int,
        encode_train_state: Callable[[], bytes],
        metrics: dict[str, float | None],
        extra: dict[str, Any],
    ) -> SaveJob:
        token = f"{self._token}{self._seq % 0x1000000:06x}"
        return SaveJob(
            seq=self._seq,
            step=step,
            staging_dir=self._layout.staging_dir(step, token),
            dcp_state=None,
            encode_train_state=encode_train_state,
            metrics=metrics,
            extra=extra,
            time=time.time(),
        )
