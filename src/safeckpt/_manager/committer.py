"""The life of one save after ``save()`` hands it over: write, agree, commit, then bookkeeping.

Runs on the writer thread (inline in sync mode). The protocol (``docs/format.md``):

1. every rank writes its DCP shards and its train-state file into
   ``.staging/step_<N>.<token>/``, each file fsynced, and checksums them as it writes;
2. the ranks agree that every write succeeded and hand rank 0 their checksums;
3. rank 0, holding the sidecar lock, writes the record and renames the directory
   to ``step_<N>``: the one commit point. ``latest`` follows;
4. rank 0 prunes and hands the commit to the registration thread; every rank then
   takes rank 0's view of the committed checkpoints.

A failure before the rename leaves nothing committed and is raised on every
rank at the next call; a failure after it is only logged.

"Rank 0" above is, exactly, the lowest of the ranks that share this rank's root
(``sharing``; every rank, on one shared root). With tiers beside the root
(:mod:`.tiering`: ``local_dir=``), the committer calls their hooks at steps 1, 3
and 4, and retention keeps what they protect; it knows nothing else of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .._dcp import io as dcp_io
from .._dcp.io import DCP_ERRORS
from .._dcp.options import IOOptions
from .._dcp.options import using as using_io
from .._dcp.plans import SavePlans
from .._dist.failures import save_failed
from .._dist.participants import Participants
from .._dist.participants import portable as _portable
from .._format.checksums import FileChecksum, checksum_file
from .._format.contents import contents_from_json
from .._format.layout import PRUNED, REPLACED, Layout, step_dirname
from .._format.record import Record, list_files, read_record, write_record
from .._format.sharing import Reuse
from .._policy.retention import Policy, Retention, retention_json
from .._registration.worker import CommitInfo, RegistrationWorker, is_best
from .._root.removal import Deleter, collect_abandoned_staging
from .._state.replicas import diverging, fingerprints
from .._state.walk import nest_for_dcp, train_state_filename
from .._store.base import FILE, Lock
from .._store.loc import Loc
from .._util.failure_log import FailureLog
from .._version import __version__
from ..errors import (
    CheckpointError,
    ConfigError,
    RankAgreementError,
    SaveFailedError,
)
from .background import COMMITTED, FAILED, StagingPool
from .outcomes import Outcomes
from .pruner import Pruner
from .saves import Committed, SaveJob, SaveView
from .session import RootSession
from .tiering import OneTier, Tiers

logger = logging.getLogger("safeckpt.manager")


class Committer:
    """What happens to a save after ``save()`` returns: write, agree, commit, prune, register.

    Call rules: ``persist`` runs on the writer thread (inline for a sync save),
    one job at a time, on every rank in the same order (it is collective over
    the writer group). ``prune``, ``close_registration`` and ``prune_deferred``
    are rank 0's and run while no job is being persisted (from the writer
    thread, or from ``pin``/``close()`` after the writer is idle).
    """

    def __init__(
        self,
        root: Path | str,  # as messages name it
        retention: Retention | Policy,
        *,
        ranks: Participants,
        plans: SavePlans,
        layout: Layout,
        view: SaveView,
        pool: StagingPool | None,
        session: RootSession,
        outcomes: Outcomes,
        registration: RegistrationWorker | None,
        registration_timeout: float,
        io: IOOptions,
        tiers: Tiers | None = None,
        sharing: frozenset[int] | None = None,
    ) -> None:
        """``tiers``: the hooks of the tiers beside this root (none: :class:`~.tiering.OneTier`);
        ``sharing``: the ranks whose files this rank's root holds (None: every rank)."""
        self.root = root
        self.retention = retention
        self._ranks = ranks
        self._plans = plans
        self._layout = layout
        self._store = layout.store
        self._view = view
        self._pool = pool
        self._session = session
        self._outcomes = outcomes
        self._registration = registration
        self.registration_timeout = registration_timeout
        self._io = io
        self._tiers: Tiers = tiers if tiers is not None else OneTier()
        self._sharing = sharing if sharing is not None else frozenset(range(ranks.world_size))
        # This rank commits, prunes and cleans up in this root: the lowest of the ranks sharing it.
        self._commits_here = ranks.rank == min(self._sharing)
        self._warned_diverging: set[str] = set()  # keys warned about (_state.replicas), once each
        self._failures = FailureLog(logger, f"the writer of {root}")
        # retention keeps off what registers, and what the tiers protect
        self._pruner = Pruner(
            root,
            retention,
            layout=layout,
            view=view,
            session=session,
            registering=self._pending_registrations,
            protected=self._tiers.protected,
        )
        self.policy = self._pruner.policy

    @property
    def _lock(self) -> Lock | None:
        return self._session.lock

    @property
    def _deleter(self) -> Deleter | None:
        return self._session.deleter

    def persist(self, job: SaveJob) -> None:
        """Write, agree, commit and prune one save. Runs on the writer thread (or inline).

        One boundary: whatever is raised, the job ends in the view in exactly one
        terminal state (committed if rank 0's rename happened, else failed), and
        the error waits for the next save/wait/flush/close. Never raises.
        """
        try:
            with using_io(self._io):
                self._write_and_commit(job)
        except BaseException as e:
            job.release_staging(self._pool)
            if job.committed_here:
                # Every rank had reported its shards durable and rank 0 committed: the checkpoint
                # is whole. A lost rank is still news for every caller; bookkeeping after the
                # commit (pins, pruning) only warns, and the next commit retries it.
                news = e if isinstance(e, RankAgreementError) else None
                self._view.finish(job, COMMITTED, news)
                logger.warning("safeckpt: step %d is committed, but what followed failed: %s", job.step, e)
            else:
                if self._commits_here:
                    self._discard_staging(job.staging_dir)
                self._view.finish(job, FAILED, _as_checkpoint_error(e, job.step))
                logger.error("safeckpt: step %d was not committed: %s", job.step, e)
            on_main = threading.current_thread() is threading.main_thread()
            if isinstance(e, (KeyboardInterrupt, SystemExit)) and on_main:
                raise  # a sync save interrupted by Ctrl-C: the job is accounted for, the interrupt goes on
        finally:
            if not job.ended:  # cannot happen; a job never stays in flight
                self._view.finish(job, FAILED, SaveFailedError(f"step {job.step} ended unaccounted"))

    def _warn_diverging(self, step: int, prints: list[dict[str, int]]) -> None:
        """Rank 0: warn (once per key) about plain tensors that differ between ranks (replicas to DCP)."""
        found = {k: r for k, r in diverging(prints).items() if k not in self._warned_diverging}
        if not found:
            return
        self._warned_diverging.update(found)
        listing = ", ".join(f"{k!r} (ranks {', '.join(map(str, r))})" for k, r in list(found.items())[:10])
        logger.warning(
            "safeckpt: step %d: %d plain tensor(s) differ between ranks: %s%s. DCP stores one copy of a "
            "plain tensor that several ranks hold under one key, and a restore gives every rank that "
            "copy. Wrap what each rank holds for itself (a data loader, a generator) in "
            "safeckpt.per_rank(...), and make a tensor that holds one part of a larger weight a DTensor; "
            "see docs/state.md.",
            step,
            len(found),
            listing,
            " ..." if len(found) > 10 else "",
        )

    def crashed(self, job: SaveJob, error: BaseException) -> None:
        self._view.finish(job, FAILED, _as_checkpoint_error(error, job.step))

    def _write_and_commit(self, job: SaveJob) -> None:
        ranks = self._ranks
        refused: BaseException | None = None
        if self._commits_here and not job.cancel_requested:
            try:  # still the root's writer, before this save writes anything (save() did not ask)
                self._session.ensure_writer(f"saving step {job.step}")
            except Exception as e:
                refused = e
            if refused is None:
                self._tiers.before_write(job.step)
        said = ranks.gather(
            (job.cancel_requested, _portable(refused)), ranks.writer, what=f"starting step {job.step}"
        )
        cancel = said[0][0]  # rank 0's say
        refusals = {rank: e for rank, (_, e) in enumerate(said) if e is not None}
        self._view.start(job, cancel)
        if cancel or refusals:
            job.release_staging(self._pool)
            if refusals:
                self._fail(job, refusals, refused)
            return
        started = time.monotonic()
        error: BaseException | None = None
        sums: dict[str, Any] = {}
        contents: dict[str, Any] = {}
        prints: dict[str, int] = {}
        try:
            if job.pending is not None:  # overlap_staging: the copy into the slot, finished
                job.pending.wait()
            if ranks.distributed:  # before the staging buffers go back: see safeckpt._state.replicas
                # Not the live tensors save() did not copy: read now, they may have moved on.
                staged = {k: v for k, v in job.dcp_state.items() if k not in job.live}
                prints = fingerprints(staged, job.step)
            self._store.make_dir(job.staging_dir.key)
            # Nested by first key segment: DCP's per-top-level-key work then runs per group.
            written = dcp_io.save(
                nest_for_dcp(job.dcp_state),
                job.staging_dir,
                ranks.writer,
                plans=self._plans,
                reuse=self._reuse(job),
            )
            train_name = train_state_filename(ranks.rank)
            self._store.write_new((job.staging_dir / train_name).key, job.train_state)
            sums = {name: None if c is None else c.to_json() for name, c in written.checksums.items()}
            contents = {name: c.to_json() for name, c in written.contents.items()}
            sums[train_name] = FileChecksum.whole(job.train_state).to_json()
            if job.pending is not None and job.pending.error is not None:
                raise job.pending.error  # after the collective write: every rank learns it next
        except DCP_ERRORS as e:
            error = e
        finally:
            job.release_staging(self._pool)
        written_at = time.monotonic()
        gathered = ranks.gather(
            (_portable(error), sums, prints, contents), ranks.writer, what=f"writing step {job.step}"
        )
        failed = {rank: e for rank, (e, _, _, _) in enumerate(gathered) if e is not None}
        commit_error: BaseException | None = None
        if not failed and self._commits_here:
            if ranks.is_leader:
                self._warn_diverging(job.step, [p for _, _, p, _ in gathered])
            try:
                self._commit(job, self._checksums_here(gathered), contents=self._contents_here(gathered))
            except Exception as e:
                commit_error = e
        commit_errors = ranks.gather(
            _portable(commit_error), ranks.writer, what=f"committing step {job.step}"
        )
        failed.update((rank, e) for rank, e in enumerate(commit_errors) if e is not None)
        if failed:
            if job.committed_here:  # committed in this root, not in another's: taken back
                self._tiers.settled(job, everywhere=False)
            self._fail(job, failed, error)
            return
        self._view.finish(job, COMMITTED)
        logger.info(
            "safeckpt: committed step %d in %.2f s (write %.2f s)",
            job.step,
            time.monotonic() - job.submitted,
            written_at - started,
        )
        if self._commits_here:
            try:  # bookkeeping after a commit never fails it (it is retried at the next one)
                self._tiers.settled(job, everywhere=True)
                self._register(job.step)
                self.prune()
            except Exception as e:
                logger.warning(
                    "safeckpt: after committing step %d: %s; retried at the next commit", job.step, e
                )
        self._outcomes.share_view(ranks.writer, what=f"the checkpoints after step {job.step}")

    def checks_live_tensors(self) -> bool:
        """Whether this manager's saves write through safeckpt's writer, which checks the digest of
        a tensor save() did not copy before writing its bytes (not DCP's own: ``dcp_io="torch"``)."""
        with using_io(self._io):
            return dcp_io.writes_its_own_archives()

    def _reuse(self, job: SaveJob) -> Reuse | None:
        """What this rank's writer needs to share untrained tensors' unchanged files with the
        previous commit of this root (None when nothing is untrained: every tensor is written)."""
        if not job.untrained:
            return None
        latest = self._view.latest
        entry = self._view.get(latest) if latest is not None else None
        record = entry.record if entry is not None else None
        if entry is None or record is None or record.contents is None:
            return Reuse(job.untrained, digests=job.digests, live=job.live)
        prefix = f"__{self._ranks.rank}_"  # this rank's own files (DCP names them so)
        mine = {n: c for n, c in record.contents.items() if n.startswith(prefix)}
        return Reuse.of(
            job.untrained,
            earlier_dir=entry.path.key,
            earlier_name=entry.path.name,
            files=record.files,
            contents=mine,
            checksums=record.checksums,
            digests=job.digests,
            live=job.live,
        )

    def _shared_sizes(self, contents: Mapping[str, Any], listed: Mapping[str, int]) -> dict[str, int]:
        """The files this save shares with the previous commit and that are not in its directory (on
        an object store they stay in the area that wrote them): their sizes, as that record says."""
        latest = self._view.latest
        entry = self._view.get(latest) if latest is not None else None
        earlier = entry.record if entry is not None else None
        if earlier is None:
            return {}
        return {
            name: earlier.files[name]
            for name, c in contents.items()
            if isinstance(c, dict) and c.get("from") and name not in listed and name in earlier.files
        }

    def _contents_here(self, gathered: list[tuple[Any, Any, Any, dict[str, Any]]]) -> dict[str, Any]:
        """The ``contents`` of the files of this root's ranks (see :meth:`_checksums_here`)."""
        found: dict[str, Any] = {}
        for rank, (_, _, _, theirs) in enumerate(gathered):
            if rank in self._sharing:
                found.update(theirs)
        return found

    def _checksums_here(self, gathered: list[tuple[Any, dict[str, Any], Any, Any]]) -> dict[str, Any]:
        """Each file of this root by name, with its writer's checksums where known: the files of the
        ranks that share this root (every rank's, on one shared root)."""
        # A rank names every file of the save, with checksums for those it wrote: on a root that
        # some ranks share, only those are its.
        every_file = len(self._sharing) == self._ranks.world_size
        checksums: dict[str, Any] = {}
        for rank, (_, theirs, _, _) in enumerate(gathered):
            if rank in self._sharing:
                checksums.update(
                    (n, c) for n, c in theirs.items() if c is not None or (every_file and n not in checksums)
                )
        return checksums

    def _fail(self, job: SaveJob, failed: dict[int, BaseException], own: BaseException | None) -> None:
        ranks = self._ranks
        if self._commits_here:
            self._discard_staging(job.staging_dir)
        if ranks.is_leader:
            latest = self._view.latest
            pointer = f"still names {'step ' + str(latest) if latest is not None else 'nothing'}"
        else:
            pointer = "is unchanged"
        error = save_failed(
            job.step, failed, own=own, root=self._layout.root, latest=pointer, distributed=ranks.distributed
        )
        self._view.finish(job, FAILED, error)
        logger.error("safeckpt: %s", error)

    def _discard_staging(self, staging_dir: Loc) -> None:
        """Move a failed save's staging directory to the trash and delete it now (rank 0).

        Deleted before the failure is reported (on the writer thread), so a save
        that failed for want of space gives that space back before the next one
        starts. Its own failure is logged, never raised: the save's error is the news.
        """
        assert self._lock is not None
        try:
            moved = collect_abandoned_staging(self._layout, self._lock, only=staging_dir)
            if moved and self._deleter is not None:
                self._deleter.run_pass()
        except Exception as e:  # left for the next start or `safeckpt gc`
            self._failures.failed(
                "cleaning up", "could not clean up a failed save (%s): %s", staging_dir.name, e
            )

    def _commit(
        self, job: SaveJob, checksums: Mapping[str, Any], *, contents: Mapping[str, Any] | None = None
    ) -> None:
        """Rank 0 (the lowest rank sharing this root), under the sidecar lock: record, then the
        rename into place, then ``latest``.

        The rename of the complete directory (record included) to ``step_<N>`` is
        the one commit point: from then on the save is committed, whatever
        happens to the bookkeeping after it (``latest`` is only a mirror of the
        newest commit, repaired at the next start when it lags).
        """
        assert self._lock is not None
        layout = self._layout
        files = list_files(job.staging_dir)
        contents = contents or {}
        files.update(self._shared_sizes(contents, files))
        for name in sorted(set(checksums) - set(files)):  # a listing can lag another client's file (NFS)
            entry = (job.staging_dir / name).entry()
            if entry is not None and entry.kind == FILE:
                files[name] = entry.size
        unseen = sorted(set(checksums) - set(files))
        if unseen:  # a rank wrote them where rank 0 cannot see them: never commit without them
            raise ConfigError(
                f"rank 0 does not see {', '.join(unseen[:5])} in {job.staging_dir}, which other ranks "
                f"wrote there: the root is not one directory that every rank shares (a node-local "
                f"path on several nodes?). Give every rank the same shared directory, or an s3:// URL; "
                f"step {job.step} was not committed."
            )
        # Checksums the writers could not compute as they wrote (DCP's own .metadata and, through
        # DCP's own writer, every file) are computed from the files, still in the page cache.
        sums = {n: checksums.get(n) or checksum_file(job.staging_dir / n).to_json() for n in files}
        target = layout.step_dir(job.step)
        with self._lock:
            # Built under the lock: a pin() of this step either lands in the job first or finds
            # the committed checkpoint after (pin holds the same lock), never in between.
            record = Record(
                step=job.step,
                time=job.time,
                files=files,
                metrics=dict(job.metrics),
                extra=dict(job.extra),
                world_size=self._ranks.world_size,
                pinned=job.pinned,
                torch_version=torch.__version__,
                library_version=__version__,
                retention=retention_json(self.retention),
                checksums=sums,
                seq=self._view.take_seq(),
                contents=contents_from_json(contents, files) if contents else None,
            )
            tiered = self._tiers.commit(job, record)  # the record as the tiers stamp it
            record = tiered.record
            write_record(job.staging_dir, record, self._lock)
            self._store.make_dir(layout.trash.key)
            try:
                replaced = self._store.commit_dir(
                    job.staging_dir.key,
                    target.key,
                    displaced=layout.new_trash_path(job.step, REPLACED).key,
                    retired=(tiered.keep_replaced or layout.new_trash_path(job.step, PRUNED)).key,
                )
            except BaseException as e:
                # Cut short after its commit point (a failed fsync after the rename; on S3 an
                # interrupt or error after the commit object landed) it is committed all the same,
                # and its staging must not be discarded as a failed save's.
                if not _in_place(target, record):
                    raise
                job.committed_here = True
                if not isinstance(e, OSError):
                    self._view.commit(Committed(target, record))
                    raise
                logger.warning("safeckpt: step %d is in place, but syncing it failed", job.step)
                replaced = False
            job.committed_here = True
            if tiered.keep_replaced is not None:
                replaced = False  # the old copy is kept there, not in the trash
            self._view.commit(Committed(target, record))
            try:
                self._store.write_pointer(layout.latest_path.key, step_dirname(job.step))
            except OSError as e:
                logger.warning(
                    "safeckpt: step %d is committed, but moving `latest` to it failed (%s); resume "
                    "takes it anyway, and the next start repairs `latest`",
                    job.step,
                    e,
                )
        if replaced and self._deleter is not None:
            self._deleter.schedule()

    def _register(self, step: int) -> None:
        """Rank 0: hand the commit of ``step`` to the registration thread; never waits for it."""
        if self._registration is None:
            return
        entry = self._view.get(step)
        if entry is None:
            return
        self._registration.submit(
            CommitInfo.of(step, entry.path, entry.record, self._layout.root, is_best=self.is_best(step))
        )

    def close_registration(self) -> None:
        """Offer the final checkpoint, then wait at most ``registration_timeout``. Never raises.

        Only a manager that committed something offers one: a reader registers nothing.
        """
        worker, self._registration = self._registration, None
        if worker is None:
            return
        try:
            latest = self._view.latest
            entry = self._view.get(latest) if latest is not None else None
            if latest is not None and entry is not None and worker.saw_commit:
                worker.submit(
                    CommitInfo.of(
                        latest,
                        entry.path,
                        entry.record,
                        self._layout.root,
                        is_best=self.is_best(latest),
                        final=True,
                    )
                )
        except Exception as e:
            logger.warning("safeckpt: could not offer the final checkpoint for registration: %s", e)
        worker.close(self.registration_timeout)

    def is_best(self, step: int) -> bool:
        """Whether ``step`` is the best committed checkpoint by retention's keep_best metric."""
        committed = [s for s in self._view.statuses(self.retention) if s.status == COMMITTED]
        return is_best(step, committed, self.retention)

    def prune(self) -> None:
        """Rank 0: prune what retention drops (see :meth:`.pruner.Pruner.prune`)."""
        self._pruner.prune()

    def prune_deferred(self) -> None:
        """Rank 0 at ``close()``, after the registrations and the tiers ended: prune what they kept."""
        self._pruner.prune_deferred()

    def _pending_registrations(self) -> frozenset[int]:
        return self._registration.pending_steps() if self._registration is not None else frozenset()


def _as_checkpoint_error(error: BaseException, step: int) -> CheckpointError:
    if isinstance(error, CheckpointError):
        return error
    wrapped = SaveFailedError(
        f"the save of step {step} failed: {type(error).__name__}: {error}", step=step, cause=error
    )
    wrapped.__cause__ = error
    return wrapped


def _in_place(target: Loc, record: Record) -> bool:
    """Whether ``target`` is the checkpoint ``record`` describes (its commit happened)."""
    try:
        found = read_record(target)
    except (CheckpointError, OSError):
        return False
    return found is not None and found.seq == record.seq and found.step == record.step
