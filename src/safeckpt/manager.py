"""CheckpointManager: the one stateful coordinator.

It owns one view of every save (queued, writing, committed, cancelled), and
both the writer and retention act on that view: a removal is a decision about
it, never a blind ``rm`` of a path. Rank 0 alone writes records, moves
``latest`` and prunes; every rank writes its own shards.

The commit protocol of one save (see ``docs/format.md``):

1. every rank writes its DCP shards and its train-state file into
   ``.staging/step_<N>.<token>/``, each file fsynced;
2. the ranks agree that every write succeeded (nothing is committed otherwise);
3. rank 0, holding the sidecar lock, writes the record (temp, fsync, replace,
   directory fsync), renames the directory to ``step_<N>`` (atomically
   replacing an earlier copy of that step), fsyncs the root and swaps
   ``latest`` to it;
4. rank 0 applies retention to the committed checkpoints and moves what falls
   out to ``.trash/``, where a background deleter removes it.
"""

from __future__ import annotations

import atexit
import logging
import operator
import os
import time
import uuid
import weakref
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from . import dcp_io
from ._version import __version__
from .atomic import replace_dir, swap_pointer
from .catalog import scan
from .distributed import Participants, agreed_error
from .distributed import portable as _portable
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    InvalidSaveError,
    ManagerClosedError,
    RankAgreementError,
    SaveFailedError,
)
from .failures import save_failed
from .fileops import DEFAULT_FILE_OPS, FileOps
from .layout import PRUNED, REPLACED, Layout, step_dirname
from .lock import SidecarLock
from .record import (
    Record,
    amend_record,
    check_json_value,
    clean_metrics,
    list_files,
    read_record,
    write_record,
)
from .registry import Registrar
from .removal import (
    Deleter,
    collect_abandoned_staging,
    discard_checkpoint,
    recover_interrupted_replacements,
)
from .restore import choose_checkpoint, load_checkpoint
from .retention import Retention
from .state import (
    capture,
    train_state_filename,
)
from .view import CheckpointStatus, Committed, SaveView
from .writer import COMMITTED, FAILED, BackgroundWriter, SaveJob, StagingPool

logger = logging.getLogger(__name__)

_WRITE_ERRORS = (Exception, CheckpointException)


class CheckpointManager:
    """Saves, keeps, prunes and restores the checkpoints of one training run.

    Args:
        root: the run's checkpoint directory (created if missing).
        async_save: ``save()`` returns once the state is copied into reused host
            buffers; a background thread writes and commits it.
        retention: which checkpoints to keep; None keeps all.
        queue_depth: staged saves that may wait while one is written (each costs
            one host copy of the state). 1: a ``save()`` during a write waits
            until the previous save's data is on disk.
        save_rng: save and restore the Python, numpy, torch and CUDA RNG states.
        drain_timeout: how long ``close()`` keeps retrying deletions of pruned
            checkpoints (a slow NFS server can hold a ``.nfs`` file for seconds).
        lock_timeout: how long to wait for the root's sidecar lock.
        timeout: how long ranks wait for each other before presuming one dead.
        registrar: told about each commit (rank 0); its failure costs only the
            registration.
        file_ops: the filesystem seam (tests inject faults through it).

    Call ``save``, ``wait``, ``flush``, ``restore`` and ``close`` on every rank,
    in the same order. ``close()`` waits for queued saves; the manager is also a
    context manager.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        async_save: bool = True,
        retention: Retention | None = None,
        queue_depth: int = 1,
        save_rng: bool = True,
        drain_timeout: float = 30.0,
        lock_timeout: float = 300.0,
        timeout: float = 600.0,
        registrar: Registrar | None = None,
        retry_interval: float = 1.0,
        file_ops: FileOps | None = None,
    ) -> None:
        if isinstance(queue_depth, bool) or not isinstance(queue_depth, int) or queue_depth < 1:
            raise ConfigError(f"queue_depth={queue_depth!r}: must be a positive integer.")
        if retention is not None and not isinstance(retention, Retention):
            raise ConfigError(f"retention must be a safeckpt.Retention, got {type(retention).__name__}.")
        self.root = Path(root).absolute()
        self.async_save = async_save
        self.retention = retention or Retention()
        self.save_rng = save_rng
        self.drain_timeout = drain_timeout
        self.registrar = registrar
        self._policy = self.retention.policy()
        self._ops = file_ops or DEFAULT_FILE_OPS
        self._layout = Layout(self.root)
        self._parts = Participants.create(timeout=timeout)
        self._closed = False

        self._view = SaveView()
        self._seq = 0

        self._lock: SidecarLock | None = None
        self._deleter: Deleter | None = None
        error: BaseException | None = None
        if self._parts.is_leader:
            try:
                self._open_root(lock_timeout, retry_interval)
            except BaseException as e:
                error = e
        self._parts.agree(error, self._parts.control, what=f"opening {self.root}")
        self._session = self._parts.broadcast(
            uuid.uuid4().hex[:6], self._parts.control, what="the save session id"
        )
        self._pool = StagingPool(queue_depth) if async_save else None
        self._writer = BackgroundWriter(self._persist) if async_save else None
        self._atexit = _register_atexit(self)

    # --- opening -------------------------------------------------------------

    def _open_root(self, lock_timeout: float, retry_interval: float) -> None:
        """Rank 0: recover from an interrupted run, load the view, start the deleter."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._layout.staging.mkdir(exist_ok=True)
        self._layout.trash.mkdir(exist_ok=True)
        self._lock = SidecarLock(self._layout.lock_path, timeout=lock_timeout)
        recover_interrupted_replacements(self._layout, self._lock, self._ops)
        abandoned = collect_abandoned_staging(self._layout, self._lock, self._ops)
        if abandoned:
            logger.info("collecting %d interrupted save(s) from %s", len(abandoned), self.root)
        catalog = scan(self.root)
        for entry in catalog.entries:
            if not entry.committed:
                logger.warning(
                    "safeckpt: ignoring %s: %s. It is neither loaded nor pruned; delete it if it "
                    "is not yours.",
                    entry.path,
                    entry.problem,
                )
        committed = [Committed(e.path, e.record) for e in catalog.entries if e.record and e.committed]
        self._view.load(committed, catalog.latest_step)
        self._deleter = Deleter(self._layout, self._lock, self._ops, retry_interval=retry_interval)
        self._deleter.start()
        self._deleter.schedule()

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
        self._check_open()
        # Every rank counts every call, also one that fails validation on one rank only:
        # the sequence number names the staging directory all ranks write into.
        self._seq += 1
        error: BaseException | None = None
        job: SaveJob | None = None
        try:
            step = _validate_step(step)
            clean = clean_metrics(metrics)
            check_json_value(dict(extra or {}), "extra")
            if self._parts.is_leader:
                self._check_order(step, overwrite)
            try:
                captured = capture(state, rng=self.save_rng)
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
                job.slot = self._pool.acquire()
                job.dcp_state = job.slot.stage(captured.dcp)
            else:
                job.dcp_state = captured.dcp
        except BaseException as e:
            error = e
            if job is not None:
                job.release_staging(self._pool)
            if not isinstance(e, Exception):
                raise
        try:
            self._conclude(error, what=f"save of step {step}", step=_int_or_none(step))
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
            self._persist(job)
            self._conclude(None, what=f"save of step {step}", step=step)

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
        if self._closed:
            return
        error: BaseException | None = None
        try:
            if self._writer is not None:
                self._writer.wait_idle()
        except BaseException as e:  # pragma: no cover - wait_idle does not raise
            error = e
        finally:
            self._closed = True
            if self._writer is not None:
                self._writer.close()
            if self._deleter is not None:
                self._deleter.drain(self.drain_timeout)
                self._deleter.close()
            if self._lock is not None:
                self._lock.close()
            _unregister_atexit(self._atexit)
        self._conclude(error, what="close()")

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
        newest = self._view.newest_step()
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

    def _conclude(self, error: BaseException | None, *, what: str, step: int | None = None) -> None:
        """Agreement at the end of save/wait/flush/close: every rank raises the same error.

        A background save that failed is raised first, once (it is then cleared
        on every rank); otherwise ``error`` from any rank.
        """
        mine = self._view.unraised()
        gathered = self._parts.gather(
            (_portable(error), {seq: _portable(e) for seq, e in mine.items()}),
            self._parts.control,
            what=what,
        )
        failures: dict[int, BaseException] = {}
        for _, theirs in gathered:
            for seq, e in theirs.items():
                failures.setdefault(seq, e)
        self._view.raised(failures)
        if failures:
            first = failures[min(failures)]
            if len(failures) > 1:
                logger.error("safeckpt: %d background saves failed; raising the first", len(failures))
            if not self._parts.distributed and error is not None:
                logger.error("safeckpt: %s also failed: %s", what, error)
            raise first
        errors = {rank: e for rank, (e, _) in enumerate(gathered) if e is not None}
        if not errors:
            return
        if not self._parts.distributed:
            assert error is not None
            raise error
        raise agreed_error(errors, what=what, step=step)

    def _persist(self, job: SaveJob) -> None:
        """Write, agree, commit and prune one save. Runs on the writer thread (or inline).

        Never raises: a failure is recorded for the next save/wait/flush/close.
        """
        try:
            self._write_and_commit(job)
        except RankAgreementError as e:  # a rank died or stopped answering mid-save
            job.release_staging(self._pool)
            if job.committed_here:
                # Every rank had reported its shards durable and rank 0 committed: the
                # checkpoint is whole. The lost rank is still news for every caller.
                self._view.finish(job, COMMITTED, e)
                logger.error("safeckpt: %s", e)
            else:
                if self._parts.is_leader:
                    self._discard_staging(job.staging_dir)
                self._view.finish(job, FAILED, e)
                logger.error("safeckpt: step %d was not committed: %s", job.step, e)

    def _write_and_commit(self, job: SaveJob) -> None:
        parts = self._parts
        cancel = parts.broadcast(job.cancel_requested, parts.writer, what=f"cancelling step {job.step}")
        self._view.start(job, cancel)
        if cancel:
            job.release_staging(self._pool)
            return
        started = time.monotonic()
        error: BaseException | None = None
        try:
            job.staging_dir.mkdir(parents=True, exist_ok=True)
            dcp_io.save(job.dcp_state, job.staging_dir, parts.writer)
            self._ops.write_file(job.staging_dir / train_state_filename(parts.rank), job.train_state)
        except _WRITE_ERRORS as e:
            error = e
        finally:
            job.release_staging(self._pool)
        written = time.monotonic()
        failures = parts.gather(_portable(error), parts.writer, what=f"writing step {job.step}")
        failed = {rank: e for rank, e in enumerate(failures) if e is not None}
        commit_error: BaseException | None = None
        if not failed and parts.is_leader:
            try:
                self._commit(job)
            except Exception as e:
                commit_error = e
        commit_error = parts.broadcast(
            _portable(commit_error), parts.writer, what=f"committing step {job.step}"
        )
        if commit_error is not None:
            failed[0] = commit_error
        if failed:
            self._fail(job, failed, error)
            return
        self._view.finish(job, COMMITTED)
        logger.info(
            "safeckpt: committed step %d in %.2f s (write %.2f s)",
            job.step,
            time.monotonic() - job.submitted,
            written - started,
        )
        if parts.is_leader:
            self._register(job.step)
            self._prune()

    def _fail(self, job: SaveJob, failed: dict[int, BaseException], own: BaseException | None) -> None:
        parts = self._parts
        if parts.is_leader:
            self._discard_staging(job.staging_dir)
            latest = self._view.latest
            pointer = f"still names {'step ' + str(latest) if latest is not None else 'nothing'}"
        else:
            pointer = "is unchanged"
        error = save_failed(
            job.step, failed, own=own, root=self.root, latest=pointer, distributed=parts.distributed
        )
        self._view.finish(job, FAILED, error)
        logger.error("safeckpt: %s", error)

    def _discard_staging(self, staging_dir: Path) -> None:
        """Move a failed save's staging directory to the trash; the deleter retries its removal."""
        assert self._lock is not None and self._deleter is not None
        moved = collect_abandoned_staging(self._layout, self._lock, self._ops, only=staging_dir)
        if moved:
            self._deleter.schedule()

    def _commit(self, job: SaveJob) -> None:
        """Rank 0, under the sidecar lock: record, rename into place, move ``latest``."""
        assert self._lock is not None
        layout = self._layout
        record = Record(
            step=job.step,
            time=job.time,
            files=list_files(job.staging_dir),
            metrics=dict(job.metrics),
            extra=dict(job.extra),
            world_size=self._parts.world_size,
            pinned=job.pinned,
            torch_version=torch.__version__,
            library_version=__version__,
            retention=self.retention.to_json(),
        )
        target = layout.step_dir(job.step)
        with self._lock:
            write_record(job.staging_dir, record, self._lock, self._ops)
            layout.trash.mkdir(exist_ok=True)
            replaced = replace_dir(
                job.staging_dir,
                target,
                layout.new_trash_path(job.step, REPLACED),
                layout.new_trash_path(job.step, PRUNED),
                self._ops,
            )
            swap_pointer(layout.latest_path, step_dirname(job.step), self._ops)
            self._view.commit(Committed(target, record))
            job.committed_here = True
        if replaced and self._deleter is not None:
            self._deleter.schedule()

    def _register(self, step: int) -> None:
        if self.registrar is None:
            return
        entry = self._view.get(step)
        if entry is None:
            return
        try:
            result = self.registrar.register(step, entry.path, entry.record)
            registration: dict[str, Any] = {"status": "registered", **dict(result or {})}
            check_json_value(registration, "the registrar's result")
        except Exception as e:
            logger.warning(
                "safeckpt: registering step %d failed (%s: %s); the checkpoint itself is committed and safe",
                step,
                type(e).__name__,
                e,
            )
            registration = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        try:
            assert self._lock is not None
            record = amend_record(entry.path, self._lock, self._ops, registration=registration)
            self._view.update(Committed(entry.path, record))
        except Exception as e:
            logger.warning("safeckpt: could not record the registration of step %d: %s", step, e)

    def _prune(self) -> None:
        """Rank 0: move committed checkpoints that retention drops into the trash.

        Never the one ``latest`` names, one with a save in flight, or one pinned
        (the pin is re-read from the record, as a ``safeckpt pin`` may have set it).
        """
        assert self._lock is not None
        self._refresh_pins()
        drop = self._view.prune_plan(self._policy)
        removed = []
        for step in sorted(drop):
            try:
                if self._trash_one(step):
                    removed.append(step)
            except OSError as e:
                logger.warning("safeckpt: could not prune step %d (%s); will retry", step, e)
        if removed:
            logger.info("safeckpt: pruned step(s) %s", ", ".join(map(str, removed)))
            assert self._deleter is not None
            self._deleter.schedule()

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
        assert self._lock is not None
        moved, record = discard_checkpoint(self._layout, self._lock, self._ops, step)
        if moved:
            self._view.forget(step)
        elif record is not None:
            self._view.update(Committed(self._layout.step_dir(step), record))
        return moved

    # --- pins and views -----------------------------------------------------------

    def pin(self, step: int) -> None:
        """Keep ``step`` whatever retention says (stored in its record). Rank 0 acts; others no-op."""
        self._set_pinned(step, True)

    def unpin(self, step: int) -> None:
        """Let retention decide about ``step`` again."""
        self._set_pinned(step, False)

    def _set_pinned(self, step: int, pinned: bool) -> None:
        self._check_open()
        step = _validate_step(step)
        if not self._parts.is_leader:
            return
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
            assert self._lock is not None
            record = amend_record(entry.path, self._lock, self._ops, pinned=pinned)
            self._view.update(Committed(entry.path, record))
        if not pinned:
            self._prune()

    @property
    def latest_step(self) -> int | None:
        """The step ``latest`` names (rank 0's view), or None."""
        return self._view.latest

    def checkpoints(self) -> list[CheckpointStatus]:
        """Committed and in-flight checkpoints, by step, with why each is kept (rank 0)."""
        return self._view.statuses(self.retention)

    # --- restoring ------------------------------------------------------------------

    def restore(
        self,
        state: MutableMapping[str, Any],
        *,
        step: int | None = None,
        path: str | os.PathLike[str] | None = None,
        strict: bool = True,
    ) -> int:
        """Load a checkpoint into ``state`` in place; return its step (0 if there is none).

        With neither ``step`` nor ``path``: the checkpoint ``latest`` names if it
        is committed and complete, else the newest complete one (with a warning);
        0 and ``state`` untouched when there is none. An explicit ``step`` or
        ``path`` is loaded as is, or raises if it is missing or broken. Rank 0
        decides which checkpoint, and every rank loads that one. ``strict``: every
        key of ``state`` must be in the checkpoint.
        """
        self._check_open()
        parts = self._parts
        choice: tuple[str, dict[str, Any]] | None = None
        error: BaseException | None = None
        if parts.is_leader:
            try:
                found = choose_checkpoint(self._layout, _validate_or_none(step), path)
                choice = None if found is None else (str(found[0]), found[1].to_json())
            except Exception as e:
                error = e
        choice, error = parts.broadcast(
            (choice, _portable(error)), parts.control, what="choosing the checkpoint to restore"
        )
        if error is not None:
            raise error
        if choice is None:
            logger.info("safeckpt: nothing to resume in %s; starting from step 0", self.root)
            return 0
        directory, record_json = Path(choice[0]), choice[1]
        record = Record.from_json(record_json, path=str(directory))
        load_error: BaseException | None = None
        try:
            load_checkpoint(state, directory, record, parts, strict=strict, with_rng=self.save_rng)
        except _WRITE_ERRORS as e:
            load_error = e
        self._conclude(load_error, what=f"restore of step {record.step}", step=record.step)
        logger.info("safeckpt: restored step %d from %s", record.step, directory)
        return record.step

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


def _validate_step(step: Any) -> int:
    if isinstance(step, bool):
        raise InvalidSaveError(f"step must be a non-negative integer, got {step!r}.")
    try:
        value = operator.index(step)
    except TypeError:
        raise InvalidSaveError(
            f"step must be a non-negative integer, got {type(step).__name__} {step!r}."
        ) from None
    if value < 0:
        raise InvalidSaveError(f"step must be non-negative, got {value}.", step=value)
    return value


def _validate_or_none(step: Any) -> int | None:
    return None if step is None else _validate_step(step)


def _int_or_none(step: Any) -> int | None:
    try:
        return _validate_step(step)
    except CheckpointError:
        return None


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
