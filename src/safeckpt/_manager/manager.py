"""CheckpointManager: the one stateful coordinator, kept thin.

It owns one view of every save (queued, writing, committed, cancelled), and
both the writer and retention act on that view: a removal is a decision about
it, never a blind ``rm`` of a path. Rank 0 alone writes records, moves
``latest`` and prunes; every rank writes its own shards.

The manager is the public API and its wiring; each part of the work lives in
its own module: opening a root (:mod:`safeckpt._manager.session`), the life of a save
after ``save()`` (:mod:`safeckpt._manager.committer`, with the commit protocol), resuming
and ``restore()`` (:mod:`safeckpt._manager.resumer`), ``should_save()``
(:mod:`safeckpt._manager.triggers`), pins (:mod:`safeckpt._manager.pins`) and agreement on
outcomes (:mod:`safeckpt._manager.outcomes`).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from .._dcp.plans import SavePlans
from .._dist.participants import Participants
from .._format.layout import Layout
from .._format.record import check_json_value, clean_metrics
from .._fs.fileops import DEFAULT_FILE_OPS, FileOps
from .._fs.lock import SidecarLock
from .._policy.retention import Policy, Retention, is_policy, with_pinned
from .._policy.schedule import SaveSchedule
from .._registration.registrar import Registrar
from .._registration.worker import RegistrationWorker
from .._root.ownership import Ownership
from .._root.removal import Deleter
from .._state.walk import StateCache, capture
from .._util.gc_pause import collector_paused
from .._util.validate import int_or_none, positive_int, positive_seconds, seconds, validate_step
from ..errors import CheckpointError, ConfigError, InvalidSaveError, ManagerClosedError, SaveFailedError
from .background import BackgroundWriter, StagingPool
from .committer import CommitPath
from .outcomes import Outcomes, _taken_anyway
from .pins import Pins
from .preemption import PreemptionHandlers
from .resumer import ResumePath
from .saves import CheckpointStatus, SaveJob, SaveView
from .session import OpenPath
from .triggers import SaveTriggers

logger = logging.getLogger(__name__)

_WRITE_ERRORS = (Exception, CheckpointException)


class CheckpointManager(OpenPath, CommitPath, ResumePath, SaveTriggers, Pins, Outcomes):
    """Saves, keeps, prunes and restores the checkpoints of one training run.

    Args:
        root: the run's checkpoint directory (created if missing).
        async_save: ``save()`` returns once the state is copied into reused host
            buffers; a background thread writes and commits it.
        retention: which checkpoints to keep: a :class:`Retention`, or any
            :class:`Policy` (``keep(infos)`` and ``reason()``); None keeps all.
            Pinned checkpoints are kept whatever it says.
        schedule: when :meth:`should_save` says to save (every N steps,
            milestones, every T seconds); None: only after a preemption signal.
        preemption_signals: signals (``signal.SIGTERM``, ``signal.SIGUSR1``)
            whose handlers only set a flag: the next :meth:`should_save` returns
            True on every rank and :attr:`preempted` becomes True. Off by
            default: a loop that never asks would no longer stop on SIGTERM.
            ``close()`` puts the previous handlers back. Main thread only.
            Pass the same ``schedule`` and ``preemption_signals`` on every rank.
        queue_depth: staged saves that may wait while one is written (each costs
            one host copy of the state). 1: a ``save()`` during a write waits
            until the previous save's data is on disk.
        save_rng: save and restore the Python, numpy, torch and CUDA RNG states.
        drain_timeout: how long ``close()`` keeps retrying deletions of pruned
            checkpoints (a slow NFS server can hold a ``.nfs`` file for seconds).
        lock_timeout: how long to wait for the root's sidecar lock (held for moments by a
            commit, a prune, or a ``safeckpt`` command). A root another live job writes is
            :class:`RootInUseError` within seconds, whatever this says.
        read_only: for jobs that only restore (evaluation, export): nothing is written,
            ``save()`` and ``pin()`` raise :class:`RootNotWritableError`, and a root this
            process cannot write is not warned about. Without it, such a root opens with a
            WARNING naming the cause, restores work, and ``save()`` raises that error.
        timeout: how long ranks wait for each other before presuming one dead.
        registrar: told about each commit (rank 0), on its own thread after the
            commit; its failure or slowness costs only the registration.
        registration_timeout: how long ``close()`` waits for registrations still
            running or queued; past it their records say ``unfinished``.
        file_ops: the filesystem seam (tests inject faults through it).
        process_group: the ranks that checkpoint together (e.g. one pipeline
            stage); every rank of it, and only those, creates the manager. None:
            every rank of the default group.

    Call ``save``, ``wait``, ``flush``, ``restore`` and ``close`` on every rank,
    in the same order. ``close()`` waits for queued saves; the manager is also a
    context manager.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        async_save: bool = True,
        retention: Retention | Policy | None = None,
        schedule: SaveSchedule | None = None,
        preemption_signals: Sequence[int] = (),
        queue_depth: int = 1,
        save_rng: bool = True,
        drain_timeout: float = 30.0,
        lock_timeout: float = 300.0,
        timeout: float = 600.0,
        registrar: Registrar | None = None,
        registration_timeout: float = 60.0,
        retry_interval: float = 1.0,
        file_ops: FileOps | None = None,
        process_group: dist.ProcessGroup | None = None,
        read_only: bool = False,
    ) -> None:
        positive_int("queue_depth", queue_depth)
        lock_timeout = positive_seconds("lock_timeout", lock_timeout)
        positive_seconds("timeout", timeout)
        positive_seconds("retry_interval", retry_interval)
        drain_timeout = seconds("drain_timeout", drain_timeout)
        if retention is not None and not (isinstance(retention, Retention) or is_policy(retention)):
            raise ConfigError(
                f"retention must be a safeckpt.Retention or a Policy (an object with keep(infos) and "
                f"reason()), got {type(retention).__name__}."
            )
        if schedule is not None and not isinstance(schedule, SaveSchedule):
            raise ConfigError(f"schedule must be a safeckpt.SaveSchedule, got {type(schedule).__name__}.")
        signals = PreemptionHandlers(preemption_signals)  # checks them before anything is opened
        self.root = Path(root).absolute()
        self.read_only = bool(read_only)
        self.async_save = async_save
        self.retention = retention if retention is not None else Retention()
        self.save_rng = save_rng
        self.drain_timeout = drain_timeout
        self.registrar = registrar
        self.registration_timeout = positive_seconds("registration_timeout", registration_timeout)
        self._registration: RegistrationWorker | None = None
        self._policy = with_pinned(self.retention)
        self.schedule = schedule
        self._last_save = time.monotonic()
        self._preempted_by: int | None = None
        self._ops = file_ops or DEFAULT_FILE_OPS
        self._layout = Layout(self.root)
        # process_group: the ranks that checkpoint together (one pipeline stage, say); None: all.
        self._parts = Participants.create(timeout=timeout, group=process_group)
        self._state_cache = StateCache()  # the state's structure, reused while it stays the same
        self._plans = SavePlans()  # DCP's plans of this manager's saves, reused while they stay the same
        self._closed = False
        self._api_lock = threading.RLock()  # orders save() and close() called from different threads

        self._view = SaveView()
        # Rank 0: commits auto-resume stepped over as damaged and has not moved aside yet (step ->
        # directory, record, why); they do not count as the newest step for the order check.
        self._unloadable: dict[int, tuple[Path, Any, str]] = {}
        self._seq = 0
        self._warned_diverging: set[str] = set()
        self._held_for_registration: set[int] = set()
        self._warned_narrower: set[int] = set()

        self._lock: SidecarLock | None = None
        self._ownership: Ownership | None = None
        self._deleter: Deleter | None = None
        self._lock_timeout = lock_timeout
        error: BaseException | None = None
        if self._parts.is_leader:
            try:
                self._open_root(lock_timeout, retry_interval)
            except BaseException as e:
                error = e
        if error is None and self._parts.is_leader and registrar is not None and not self.read_only:
            assert self._lock is not None
            self._registration = RegistrationWorker(
                registrar, self._lock, self._ops, self.root, timeout=self.registration_timeout
            )
        self._parts.agree(error, self._parts.control, what=f"opening {self.root}")
        self._share_view(self._parts.control, what=f"the checkpoints in {self.root}")
        self._session = self._parts.broadcast(
            uuid.uuid4().hex[:6], self._parts.control, what="the save session id"
        )
        self._pool = StagingPool(queue_depth) if async_save else None
        self._writer = BackgroundWriter(self._persist, on_crash=self._crashed) if async_save else None
        self._atexit = _register_atexit(self)
        self._signals = signals
        self._signals.install()

    # --- opening -------------------------------------------------------------

    # --- saving ----------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        """Save ``state`` as checkpoint ``step``: the number of training steps completed.

        Async mode returns once the state is copied into host buffers; the write,
        commit and pruning happen in the background. Sync mode returns once the
        checkpoint is committed. ``metrics`` (numbers) rank checkpoints for
        ``keep_best``; ``extra`` (JSON data) is kept in the record. A step lower
        than the newest saved one needs ``overwrite=True``; the same step again
        replaces that checkpoint atomically. Raises before writing anything for
        bad arguments, and raises a failed earlier background save here, once.
        """
        with self._api_lock:  # close() from another thread waits for this save, or refuses it
            self._save(step, state, metrics=metrics, extra=extra, overwrite=overwrite)

    def _save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None,
        extra: Mapping[str, Any] | None,
        overwrite: bool,
    ) -> None:
        self._check_open()
        # Every rank counts every call, also one that fails validation on one rank only:
        # the sequence number names the staging directory all ranks write into.
        self._seq += 1
        self._last_save = time.monotonic()  # SaveSchedule(every_seconds=...) counts from here
        error: BaseException | None = None
        job: SaveJob | None = None
        try:
            step = validate_step(step)
            clean = clean_metrics(metrics)
            check_json_value(dict(extra or {}), "extra")
            if self._parts.is_leader:
                self._ensure_writer(f"save(step={step})")
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
            job = self._new_job(step, captured.train_state, clean, dict(extra or {}))
            if self._pool is not None:
                job.slot = self._acquire_slot(step)
                with collector_paused():
                    job.dcp_state = job.slot.stage(captured.dcp)
            else:
                job.dcp_state = captured.dcp
        except BaseException as e:
            error = e
            if job is not None:
                job.release_staging(self._pool)
            if not isinstance(e, Exception):
                raise
        what = f"save({int_or_none(step)})"
        try:
            earlier = self._conclude(error, what=what, step=int_or_none(step), defer_background=True)
        except BaseException:
            if job is not None:
                job.release_staging(self._pool)
            raise
        assert job is not None
        self._view.add(job)
        if self._writer is not None:
            self._writer.submit(job)
            if self._parts.is_leader:
                for cancelled in self._view.cancel_out_of_retention(self._policy):
                    logger.info(
                        "safeckpt: cancelling queued save of step %d (out of retention)", cancelled.step
                    )
        else:
            with collector_paused():  # a sync save blocks the caller anyway
                self._persist(job)
            later = self._conclude(None, what=what, step=step, defer_background=earlier is not None)
            earlier = earlier or later
        if earlier is not None:
            raise _taken_anyway(earlier, job.step, async_save=self._writer is not None)

    def _acquire_slot(self, step: int) -> Any:
        assert self._pool is not None
        try:
            return self._pool.acquire(timeout=self._parts.timeout)
        except TimeoutError as e:
            raise SaveFailedError(
                f"save(step={step}): the previous save has not freed its staging buffers within "
                f"{self._parts.timeout:g} s (its write is stuck: a hung filesystem?). Nothing of step "
                f"{step} was written; check the storage, or raise timeout.",
                step=step,
                cause=e,
            ) from e

    def wait(self) -> None:
        """Block until every queued save is committed (or failed); raise a failure once."""
        self._check_open()
        if self._writer is not None:
            self._writer.wait_idle()
        self._conclude(None, what="wait()")

    def flush(self) -> None:
        """Like :meth:`wait`: call it before changing the model's structure or device.

        Afterwards nothing references the old tensors, and the next save
        allocates staging buffers for the new shapes.
        """
        self.wait()

    def close(self) -> None:
        """Wait for queued saves, drain the trash, stop the threads. Idempotent.

        Raises a failed background save that was not raised yet (after cleaning up).
        """
        with self._api_lock:
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        errors: list[BaseException] = []

        def attempt(action: Any) -> None:
            # Every part of the teardown runs, whatever an earlier one raised: threads stop and
            # the lock fd closes; the first error is raised once everything is cleaned up.
            try:
                action()
            except BaseException as e:
                errors.append(e)

        if self._writer is not None:
            attempt(self._writer.wait_idle)
        self._closed = True
        if self._writer is not None:
            attempt(self._writer.close)
        attempt(self._close_registration)
        attempt(self._prune_held_back)
        self._plans.forget()
        if self._deleter is not None:
            deleter = self._deleter
            attempt(lambda: deleter.drain(self.drain_timeout))
            attempt(deleter.close)
        if self._ownership is not None:
            attempt(self._ownership.release)
        if self._lock is not None:
            attempt(self._lock.close)
        _unregister_atexit(self._atexit)
        # only now, with the last save durable: a second SIGTERM during it only set the flag
        attempt(self._signals.restore)
        error = errors[0] if errors else None
        try:
            self._conclude(error, what="close()")
        finally:
            # after the last collective on them; a writer still inside DCP (a second Ctrl-C
            # during the join) keeps them until exit
            if self._writer is None or not self._writer.alive:
                self._parts.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception:
            logger.exception("safeckpt: close() failed while handling another exception")

    # --- the pieces of a save ---------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError(
                f"this CheckpointManager for {self.root} is closed; create a new one.",
                path=str(self.root),
            )

    def _check_order(self, step: int, overwrite: bool) -> None:
        newest = self._view.newest_step(ignore=self._unloadable)
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
        self, step: int, train_state: bytes, metrics: dict[str, float | None], extra: dict[str, Any]
    ) -> SaveJob:
        token = f"{self._session}{self._seq % 0x1000000:06x}"
        return SaveJob(
            seq=self._seq,
            step=step,
            staging_dir=self._layout.staging_dir(step, token),
            dcp_state=None,
            train_state=train_state,
            metrics=metrics,
            extra=extra,
            time=time.time(),
        )

    # --- views -----------------------------------------------------------------

    @property
    def latest_step(self) -> int | None:
        """The step ``latest`` names (rank 0's view), or None."""
        return self._view.latest

    def checkpoints(self) -> list[CheckpointStatus]:
        """Committed and in-flight checkpoints, by step, with why each is kept (rank 0)."""
        return self._view.statuses(self._policy)

    # --- exit ---------------------------------------------------------------------

    def _drain_at_exit(self) -> None:
        if self._closed or self._writer is None or not self._writer.pending:
            return
        logger.warning(
            "safeckpt: the interpreter is exiting without close(); waiting for %d queued save(s) of %s",
            self._writer.pending,
            self.root,
        )
        self._writer.wait_idle(timeout=self._parts.timeout)


def _register_atexit(manager: CheckpointManager) -> Any:
    ref = weakref.ref(manager)

    def drain() -> None:
        mgr = ref()
        if mgr is not None:
            mgr._drain_at_exit()

    atexit.register(drain)
    return drain


def _unregister_atexit(hook: Any) -> None:
    atexit.unregister(hook)
