"""CheckpointManager: the public API of a training run's checkpoints, and its wiring.

The manager composes collaborators, each a class built from what it needs and
testable alone: the root session (:mod:`.session`: the sidecar lock, ownership,
the deleter), the saver (:mod:`.saver`: ``save()`` up to the hand-over), the
committer (:mod:`.committer`: write, agree, commit, prune, register), the
resumer (:mod:`.resumer`: ``restore()``), triggers (:mod:`.triggers`:
``should_save()``), pins (:mod:`.pins`) and outcomes (:mod:`.outcomes`: every
collective call's agreement, and one view of the checkpoints on every rank).
They share one view of every save (:mod:`.saves`: queued, writing, committed,
cancelled), which the writer and retention both act on: a removal is a decision
about it, never a blind ``rm`` of a path. Rank 0 alone writes records, moves
``latest`` and prunes; every rank writes its own shards. The tiers beside the
root (``local_dir=``) plug in through :mod:`.tiering`; without them, its
:class:`~.tiering.OneTier` does nothing.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .._dcp.options import resolve as resolve_io
from .._dist.participants import Participants
from .._policy.retention import Policy, Retention, is_policy
from .._policy.schedule import SaveSchedule
from .._registration.registrar import Registrar
from .._restore.restored import Restored
from .._store.loc import shown
from .._store.registry import open_store
from .._util.validate import positive_int, positive_seconds, seconds
from ..errors import ConfigError, ManagerClosedError
from .preemption import PreemptionHandlers
from .saves import CheckpointStatus
from .tiering import TierOptions, Waited, tiers_for
from .wiring import wire

if TYPE_CHECKING:
    from .._fs.fileops import FileOps

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Saves, keeps, prunes and restores the checkpoints of one training run.

    Args:
        root: the run's checkpoint directory (created if missing), or an ``s3://bucket/prefix``
            URL (credentials and endpoint from the standard ``AWS_*`` variables).
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
        verify: check every byte loaded against the CRC32 written with it (default: True;
            ``SAFECKPT_VERIFY=0`` in the environment makes it False for the whole process, with
            a WARNING). ``safeckpt verify`` always checks.
        direct_io: write and read large files with ``O_DIRECT`` where the filesystem takes
            it (default: True; ``SAFECKPT_DIRECT_IO=0`` turns it off). The bytes are the same.
        dcp_io: ``"raw"`` (default): safeckpt's own DCP writer and reader; ``"torch"``: DCP's
            (same files, slower; ``SAFECKPT_DCP_IO=torch``), a way around a problem in ours.
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
        storage_options: for a URL root, settings over the ``AWS_*`` variables, as fsspec
            writes them (``key``, ``secret``, ``token``, ``endpoint_url``, ``region_name``,
            ``client_kwargs``) and transfer settings (``part_size``, ``max_concurrency``,
            ``max_attempts``, ``connect_timeout``, ``read_timeout``).
        process_group: the ranks that checkpoint together (e.g. one pipeline
            stage); every rank of it, and only those, creates the manager. None:
            every rank of the default group.
        local_dir: a fast local directory (node-local NVMe) as a first tier: each save commits
            there, with the same protocol, and is then uploaded to ``root`` (the durable tier) in
            the background, in commit order, where it is committed again. ``restore()`` takes the
            newest commit of either tier, the local copy only if every byte of it verifies. See
            ``docs/tiers.md``. With several nodes, every rank passes the same path, each node's
            its own disk: each node commits its part there and uploads it, and rank 0 commits
            the whole checkpoint in ``root``; a restore reads each node's part from its disk and
            the rest from ``root``.
        local_retention: which checkpoints ``local_dir`` keeps (default: the last 2); ``retention``
            is then the durable tier's. A local checkpoint is never pruned before its upload
            committed.
        overlap_staging: with ``async_save``, ``save()`` returns once it has recorded what to copy;
            the copy into the staging buffers runs in the background while training goes on. Each
            optimizer in the state waits, before its ``step()``, for its parameters and state, and
            each module, before its forward, for its buffers; any other tensor is copied before
            ``save()`` returns. A checkpoint holds the state at ``save()`` exactly; a tensor changed
            in place by hand before its copy fails that save. See ``docs/overlap.md``.
        upload_timeout: how long ``close()`` waits for uploads still running or queued; it stops
            waiting at a failed try (the next start uploads what is left).

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
        verify: bool | None = None,
        direct_io: bool | None = None,
        dcp_io: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        local_dir: str | os.PathLike[str] | None = None,
        local_retention: Retention | Policy | None = None,
        upload_timeout: float = 3600.0,
        overlap_staging: bool = False,
    ) -> None:
        positive_int("queue_depth", queue_depth)
        lock_timeout = positive_seconds("lock_timeout", lock_timeout)
        positive_seconds("timeout", timeout)
        positive_seconds("retry_interval", retry_interval)
        drain_timeout = seconds("drain_timeout", drain_timeout)
        for name, policy in (("retention", retention), ("local_retention", local_retention)):
            if policy is not None and not (isinstance(policy, Retention) or is_policy(policy)):
                raise ConfigError(
                    f"{name} must be a safeckpt.Retention or a Policy (an object with keep(infos) and "
                    f"reason()), got {type(policy).__name__}."
                )
        if overlap_staging and not async_save:
            raise ConfigError(
                "overlap_staging=True copies the state in the background after save() returns; it "
                "needs async_save=True (a sync save has written the state when it returns)."
            )
        _check_schedule(schedule)
        io = resolve_io(verify=verify, direct_io=direct_io, dcp_io=dcp_io)
        signals = PreemptionHandlers(preemption_signals)  # checks them before anything is opened
        store = open_store(root, ops=file_ops, options=storage_options)
        self.root = shown(store)
        self.read_only = bool(read_only)
        self.async_save = async_save
        self.retention = retention if retention is not None else Retention()
        self.save_rng = save_rng
        self.drain_timeout = drain_timeout
        self.registrar = registrar
        self.registration_timeout = positive_seconds("registration_timeout", registration_timeout)
        self.upload_timeout = positive_seconds("upload_timeout", upload_timeout)
        self._closed = False
        self._api_lock = threading.RLock()  # orders save() and close() called from different threads
        ranks = Participants.create(timeout=timeout, group=process_group)
        try:  # the tiers beside the root (local_dir=), or none: the seam of .tiering
            setup = tiers_for(
                TierOptions(
                    root=store,
                    ranks=ranks,
                    retention=self.retention,
                    local_dir=local_dir,
                    local_retention=local_retention,
                    upload_timeout=self.upload_timeout,
                    drain_timeout=drain_timeout,
                    has_registrar=registrar is not None,
                    read_only=self.read_only,
                    lock_timeout=lock_timeout,
                    retry_interval=retry_interval,
                    file_ops=file_ops,
                )
            )
        except BaseException:
            ranks.release()
            raise
        self.local_dir: Path | None = setup.local_dir
        self.local_retention: Retention | Policy | None = setup.local_retention
        w = wire(
            setup,
            ranks,
            schedule=schedule,
            signals=signals,
            async_save=async_save,
            queue_depth=queue_depth,
            save_rng=save_rng,
            read_only=self.read_only,
            lock_timeout=lock_timeout,
            retry_interval=retry_interval,
            registrar=registrar,
            registration_timeout=self.registration_timeout,
            io=io,
            overlap=bool(overlap_staging),
        )
        self._tiers = setup.tiers
        self._ranks, self._view, self._session, self._outcomes = ranks, w.view, w.session, w.outcomes
        self._committer, self._resumer, self._triggers, self._pins = (
            w.committer,
            w.resumer,
            w.triggers,
            w.pins,
        )
        self._saver, self._pool, self._writer = w.saver, w.pool, w.writer
        self._plans, self._state_cache = w.plans, w.state_cache
        self._atexit = _register_atexit(self)
        self._signals = signals
        self._signals.install()

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
            self._check_open()
            self._saver.save(step, state, metrics=metrics, extra=extra, overwrite=overwrite)

    def wait(self, *, durable: bool = False) -> None:
        """Block until every queued save is committed (or failed); raise a failure once.

        ``durable=True`` (with ``local_dir``): also until every local commit is uploaded and
        committed in the durable tier; raises :class:`SaveFailedError` naming the steps still
        waiting when an upload fails meanwhile (they are tried again in the background), and the
        steps whose local copy could not be uploaded at all since the last such call (damaged:
        they are not durable).
        """
        self._check_open()
        self._saver.settle()
        if self._writer is not None:
            self._writer.wait_idle()
        # with local_dir=: until every local commit is committed in the root (collective)
        error = self._tiers.wait(closing=False).error if durable else None
        self._outcomes.conclude(error, what="wait()")

    def flush(self) -> None:
        """Like :meth:`wait`: call it before changing the model's structure or device.

        Afterwards nothing references the old tensors, and the next save
        allocates staging buffers for the new shapes.
        """
        self.wait()

    # --- restoring -------------------------------------------------------------

    def restore(
        self,
        state: MutableMapping[str, Any],
        *,
        step: int | None = None,
        path: str | os.PathLike[str] | None = None,
        strict: bool = True,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
    ) -> Restored:
        """Load a checkpoint into ``state`` in place; return what was loaded, the same on every rank.

        The :class:`Restored` result carries the step, path, metrics, extra and
        record; it is falsy (``.step is None``) when there was nothing to restore,
        so ``start = (r := mgr.restore(state)).step or 0`` starts a loop.

        With neither ``step`` nor ``path``: the checkpoint ``latest`` names if it
        is committed and complete, else the newest complete one (with a warning);
        nothing, and ``state`` untouched, when there is none. A checkpoint found
        damaged is moved aside to ``.damaged/`` by the root's writer, so it never
        counts as the newest step again. An explicit ``step`` or ``path`` is
        loaded as is, or raises if it is missing or broken. A checkpoint replaced
        or pruned while it is read (by the job writing the root) is chosen anew,
        never reported as damage. Rank 0 decides which checkpoint, and every rank
        loads that one. ``strict``: every key of ``state`` must be in the
        checkpoint and vice versa (else the result lists what did not match).
        ``include``/``exclude``: dotted paths (``"model"``, ``"optim.state"``) to
        load only, or to leave out (RNG states are then left alone); see
        ``docs/state.md``.
        """
        self._check_open()
        self._saver.settle()  # a restore writes into the tensors a save may still be copying
        return self._resumer.restore(
            state, step=step, path=path, strict=strict, include=include, exclude=exclude
        )

    def load(self, step: int | None = None) -> dict[Any, Any]:
        """This root's checkpoint (the one ``restore`` would take, or ``step``) without a template.

        See :func:`safeckpt.load`. Not collective: each rank that calls it reads
        the whole checkpoint.
        """
        self._check_open()
        return self._resumer.load(step)

    # --- when to save, and pins --------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether to save ``step`` (steps completed) now; the same answer on every rank.

        True when the schedule says so, or once after a preemption signal on any
        rank (then :attr:`preempted` is True: save, and leave the loop). Step
        rules need no agreement; the ``every_seconds`` clock is rank 0's, and
        signals count on every rank, which takes one small collective over the
        manager's control group per call: call it on every rank, once per step.
        With no schedule and no ``preemption_signals`` it is False for every step,
        and a warning says so once.
        """
        with self._api_lock:  # its collective must not overlap a close() from another thread
            self._check_open()
            return self._triggers.should_save(step)

    @property
    def schedule(self) -> SaveSchedule | None:
        """When :meth:`should_save` says to save; assign another to change it from the next call."""
        return self._triggers.schedule

    @schedule.setter
    def schedule(self, schedule: SaveSchedule | None) -> None:
        _check_schedule(schedule)
        self._triggers.schedule = schedule

    @property
    def preempted(self) -> bool:
        """True once :meth:`should_save` has seen a preemption signal (on any rank); same on every rank."""
        return self._triggers.preempted

    @property
    def preemption_signal(self) -> int | None:
        """The signal that preempted the run (the lowest rank's), or None: exit with ``128 +`` it."""
        return self._triggers.preemption_signal

    def pin(self, step: int) -> None:
        """Keep ``step`` whatever retention says (stored in its record). Collective; rank 0 acts."""
        self._check_open()
        self._pins.set_pinned(step, True)

    def unpin(self, step: int) -> None:
        """Let retention decide about ``step`` again. Collective; rank 0 acts."""
        self._check_open()
        self._pins.set_pinned(step, False)

    # --- views -----------------------------------------------------------------

    @property
    def latest_step(self) -> int | None:
        """The step ``latest`` names (rank 0's view), or None."""
        return self._view.latest

    def checkpoints(self) -> list[CheckpointStatus]:
        """Committed and in-flight checkpoints, by step, with why each is kept (rank 0)."""
        return self._view.statuses(self._committer.policy)

    # --- closing -----------------------------------------------------------------

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

        attempt(self._saver.close)  # nothing of the manager stays on the user's modules
        if self._writer is not None:
            attempt(self._writer.wait_idle)
        self._closed = True
        if self._writer is not None:
            attempt(self._writer.close)
        attempt(self._committer.close_registration)
        waited: list[Waited] = []
        attempt(lambda: waited.append(self._tiers.wait(closing=True)))  # the tiers beside the root
        attempt(self._committer.prune_deferred)
        self._plans.forget()
        attempt(lambda: self._session.drain(self.drain_timeout))
        if not any(w.busy for w in waited):  # their work still running writes here when it ends
            errors.extend(self._session.release())
        _unregister_atexit(self._atexit)
        # only now, with the last save durable: a second SIGTERM during it only set the flag
        attempt(self._signals.restore)
        error = errors[0] if errors else None
        try:
            self._outcomes.conclude(error, what="close()")
        finally:
            # after the last collective on them; a writer still inside DCP (a second Ctrl-C
            # during the join) keeps them until exit
            if self._writer is None or not self._writer.alive:
                self._ranks.release()

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

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError(
                f"this CheckpointManager for {self.root} is closed; create a new one.",
                path=str(self.root),
            )

    # --- exit ---------------------------------------------------------------------

    def _drain_at_exit(self) -> None:
        if self._closed or self._writer is None or not self._writer.pending:
            return
        logger.warning(
            "safeckpt: the interpreter is exiting without close(); waiting for %d queued save(s) of %s",
            self._writer.pending,
            self.root,
        )
        self._writer.wait_idle(timeout=self._ranks.timeout)


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


def _check_schedule(schedule: object) -> None:
    if schedule is not None and not isinstance(schedule, SaveSchedule):
        raise ConfigError(f"schedule must be a safeckpt.SaveSchedule, got {type(schedule).__name__}.")
