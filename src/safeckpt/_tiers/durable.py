"""The durable root of a run with two tiers (``local_dir=``): held, committed to and pruned as a
manager holds its own root.

Saves commit to the local tier; :mod:`.uploads` copies each commit here. An
upload commits with the same protocol as a save made here directly (its files
into ``.staging/``, the record, the one commit point, then ``latest``), and its
record says when it was uploaded and from where. This root has its own
retention, its own owner record and lock, and its own deleter.

The root has an identity, written in it once (:mod:`safeckpt._format.lineage`),
which every local commit records: a local directory holding another root's
commits is refused at start, and a local commit the root has moved on past (it
holds commits made elsewhere since the one the local copy followed) is never
uploaded over them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable

from .._dist.participants import Participants
from .._format import lineage
from .._format.contents import written_here
from .._format.identity import Fate, fate_of
from .._format.layout import PRUNED, RECORD_NAME, REPLACED, Layout, step_dirname
from .._format.record import Record, amend_record, read_record, same_checkpoint, write_record
from .._format.tier_fields import Lineage, Upload
from .._manager.damaged import DamagedCommits
from .._manager.pruner import Pruner
from .._manager.saves import Committed, SaveView
from .._manager.session import RootSession
from .._policy.retention import Policy, Retention, retention_json
from .._root.copy import copy_checkpoint
from .._root.removal import collect_abandoned_staging
from .._store.base import Store
from .._store.loc import Loc
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from .node_parts import (
    area_of,
    committed_part,
    has_marker,
    nodes_of,
    of_run,
    put_marker,
    remove_markers,
    wait_committed,
    whole_record,
)

logger = logging.getLogger("safeckpt.manager")

# What reading a local copy raises when it cannot be uploaded at all (the durable side raises
# OSError, or RootInUseError / RootNotWritableError, which are worth trying again).
LOCAL_COPY_BAD = (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    CheckpointNotFoundError,
)


class BehindRootError(CheckpointError):
    """A local commit the durable root has moved on past: never uploaded over the root's commits."""


class DurableTier:
    """Rank 0's hold on the durable root. Call rules: :meth:`open` once; :meth:`upload` from one
    thread at a time (the upload thread, or start-up before it runs)."""

    def __init__(
        self,
        store: Store,
        ranks: Participants,
        retention: Retention | Policy,
        *,
        read_only: bool,
        lock_timeout: float,
        retry_interval: float,
    ) -> None:
        self.layout = Layout(Loc(store))
        self._is_leader = ranks.is_leader
        self.run = ""  # this run's id, the same on every rank (see node_parts.area_of)
        self.root = self.layout.root.where
        self.identity: str | None = None  # written in the root once (see _format.lineage)
        self.view = SaveView()
        self.session = RootSession(
            self.layout,
            self.view,
            DamagedCommits(self.layout, self.view),
            read_only=read_only,
            lock_timeout=lock_timeout,
            retry_interval=retry_interval,
        )
        # saves commit locally and wait for it
        self.session.when_unreachable = "saves wait on the first tier and go up once it answers"
        # The durable root's pruning is a manager's: the same rules, kept by the same checks.
        self._pruner = Pruner(self.root, retention, layout=self.layout, view=self.view, session=self.session)

    def open(self) -> None:
        """Rank 0: hold the root as a manager holds its own, and know its identity (written now
        by the root's writer where it has none)."""
        self.session.keep_staging = lambda name: of_run(name, self.run)
        self.session.open()
        ownership, lock = self.session.ownership, self.session.lock
        if ownership is not None and ownership.claimed and lock is not None:
            try:
                self.identity = lineage.ensure_root_id(self.layout.root, lock)
                return
            except OSError as e:  # as a root that cannot be written: its uploads fail and say why
                logger.info("safeckpt: could not write the identity of %s (%s)", self.root, e)
        self.identity = lineage.read_root_id(self.layout.root)

    def read_identity(self) -> None:
        """Another node's leader (which does not hold the root): the root's identity as it is."""
        self.identity = lineage.read_root_id(self.layout.root)

    def stamp(self, tier: str | None) -> Lineage:
        """What a local commit of local directory ``tier`` records of this root now (see
        :mod:`safeckpt._format.lineage`); ``after`` only where this rank holds the root's view."""
        newest = self.newest() if self._is_leader else None
        after = (newest.record.seq or 0) if newest is not None else (0 if self._is_leader else None)
        return lineage.stamp(str(self.root), self.identity, tier, after)

    def refuse_others(self, local_root: Loc, committed: list[Record]) -> None:
        """A ``ConfigError`` when ``local_root`` holds commits saved for another durable root:
        they would be restored, uploaded and counted as this run's."""
        others = sorted(
            (r for r in committed if not lineage.belongs(r, str(self.root), self.identity)),
            key=lambda r: r.step,
        )
        if not others:
            return
        steps = ", ".join(str(r.step) for r in others)
        where = sorted({str(lineage.root_of(r)) for r in others})
        waiting = [r.step for r in others if r.uploaded is None]
        raise ConfigError(
            f"local_dir={local_root.where} holds step(s) {steps} of another root ({', '.join(where)}; "
            f"this run's root is {self.root}, or one removed and made again there). A local_dir "
            "belongs to one root: give this run a local_dir of its own, or remove that run's steps "
            "from it"
            + (
                f" (step(s) {', '.join(map(str, waiting))} were never uploaded: `safeckpt upload "
                f"{where[0]} --local-dir {local_root.where}` uploads them first)."
                if waiting
                else " (each was uploaded to its root, so removing them loses nothing)."
            ),
            path=str(local_root.where),
        )

    def moved_on(self, record: Record) -> Committed | None:
        """This root's commit that the local commit ``record`` is behind (see
        :func:`safeckpt._format.lineage.moved_on`), or None. Rank 0, which holds the root's view."""
        committed = {id(c.record): c for c in self.view.committed()}
        found = lineage.moved_on(record, [c.record for c in committed.values()])
        return None if found is None else committed[id(found)]

    def behind_error(self, source: Loc, record: Record, newer: Committed) -> BehindRootError:
        return BehindRootError(
            f"step {record.step} in {source.parent.where} was saved from an earlier state of "
            f"{self.root}, which has moved on since without it (it holds step {newer.record.step}, "
            "committed from another node or job after the commit this copy followed): uploading it "
            "would roll the root back",
            path=str(source.where),
            step=record.step,
        )

    def holds(self, record: Record) -> Committed | None:
        """This root's commit of the same checkpoint (same step and bytes; for a node's part, of the
        save it is a part of), if it has one."""
        if record.part is not None:
            found_part = committed_part(self.layout, record)
            return None if found_part is None else Committed(self.layout.step_dir(record.step), found_part)
        found = self.view.get(record.step)
        return found if found is not None and same_checkpoint(found.record, record) else None

    def upload(
        self, source: Loc, record: Record, *, should_stop: Callable[[], bool] | None = None
    ) -> Committed:
        """Copy the committed checkpoint at ``source`` here and commit it; its record says so.

        Anything that fails before the commit point leaves nothing here (the staging area is
        discarded); after it, the copy is committed whatever follows (``latest`` only warns).
        A node's part (``record.part``) goes up as :mod:`.node_parts` says.
        """
        if record.part is not None:
            return self._upload_part(source, record, should_stop=should_stop)
        self.session.ensure_writer(f"uploading step {record.step}")
        self._identify()
        newer = self.moved_on(record)  # the view as this writer holds it (taken anew at a claim)
        if newer is not None:
            raise self.behind_error(source, record, newer)
        staging = self.layout.staging_dir(record.step, uuid.uuid4().hex[:12])
        try:
            copy_checkpoint(source, record, staging, should_stop=should_stop)
        except BaseException:
            self._discard(staging)
            raise
        committed = self._commit(staging, record, source)
        self._prune_after(record.step)
        return committed

    def _upload_part(
        self, source: Loc, record: Record, *, should_stop: Callable[[], bool] | None
    ) -> Committed:
        """This node's part into the save's area and its marker; then rank 0 commits the area once
        every node's part is in, and the other nodes' leaders wait for that commit."""
        area = area_of(self.layout, record, self.run)
        if self._is_leader:
            self.session.ensure_writer(f"uploading step {record.step}")
            self._identify()
            newer = self.moved_on(record)
            if newer is not None:
                self._discard(area)  # the other nodes see the save dropped
                raise self.behind_error(source, record, newer)
        if not has_marker(area, record) and (area / RECORD_NAME).entry() is None:
            try:
                copy_checkpoint(source, record, area, should_stop=should_stop)
            except LOCAL_COPY_BAD as e:
                put_marker(area, record, lost=str(e))  # rank 0 drops the save, not waits for it
                raise
            put_marker(area, record)
        if not self._is_leader:
            found = wait_committed(self.layout, area, record, should_stop=should_stop)
            return Committed(self.layout.step_dir(record.step), found)
        try:
            whole = read_record(area) or whole_record(area, record, should_stop=should_stop)
        except IncompleteCheckpointError:
            self._discard(area)  # a node's part is lost: the others see the area go
            raise
        committed = self._commit(area, whole, source, parts_of=record)
        self._prune_after(record.step)
        return committed

    def _identify(self) -> None:
        """The root's identity, written by this writer where it has none (a claim made mid-run)."""
        if self.identity is None and self.session.lock is not None:
            self.identity = lineage.ensure_root_id(self.layout.root, self.session.lock)

    def _prune_after(self, step: int) -> None:
        try:
            self._pruner.prune()
        except Exception as e:  # pruning after a commit never fails it; the next upload retries
            logger.warning("safeckpt: after uploading step %d: %s", step, e)

    def _commit(
        self, staging: Loc, record: Record, source: Loc, *, parts_of: Record | None = None
    ) -> Committed:
        """Under the lock: the record, the rename (or the commit object) into place, ``latest``.

        ``parts_of``: ``staging`` holds every node's part of the save this (rank 0's) part record
        names; its markers go once the record is in, and a failure leaves the area for the next
        try instead of discarding it."""
        lock = self.session.lock
        assert lock is not None
        store, target = self.layout.store, self.layout.step_dir(record.step)
        local = parts_of if parts_of is not None else record  # the local commit this is the upload of
        with lock:
            durable = dataclasses.replace(
                record,
                seq=self.view.take_seq(),
                registration=None,
                retention=retention_json(self._pruner.retention),  # this root's, not the local tier's
                # which local directory's commit this is the upload of (see _format.lineage)
                uploaded=Upload.durable_copy(
                    time.time(),
                    str(source.where),
                    tier=local.local.tier if local.local is not None else None,
                    seq=local.seq,
                    save=None if parts_of is None else parts_of.part_id,
                ),
                part=None,
                local=None,
                contents=written_here(record.contents),  # every file is uploaded: none shared there
            )
            try:
                write_record(staging, durable, lock)
                if parts_of is not None:
                    remove_markers(staging, nodes_of(parts_of))
                store.make_dir(self.layout.trash.key)
                store.commit_dir(
                    staging.key,
                    target.key,
                    displaced=self.layout.new_trash_path(record.step, REPLACED).key,
                    retired=self.layout.new_trash_path(record.step, PRUNED).key,
                )
            except BaseException:
                if fate_of(target, durable) is not Fate.SAME:
                    if parts_of is None:
                        self._discard(staging)
                    raise
                # In place, then a directory fsync failed: committed, maybe not durable yet.
                logger.warning(
                    "safeckpt: step %d is in place in %s, but syncing it failed", record.step, self.root
                )
            committed = Committed(target, durable)
            self.view.commit(committed)
            try:
                store.write_pointer(self.layout.latest_path.key, step_dirname(record.step))
            except OSError as e:
                logger.warning(
                    "safeckpt: step %d is committed in %s, but moving `latest` to it failed (%s); "
                    "resume takes it anyway",
                    record.step,
                    self.root,
                    e,
                )
        if self.session.deleter is not None:
            self.session.deleter.schedule()  # a replaced copy went to the trash
        return committed

    def set_pinned(self, step: int, pinned: bool) -> bool:
        """Rank 0: pin or unpin this root's commit of ``step`` (its record, under this root's lock);
        whether this root has one. A step not uploaded yet takes its local record's pin up with it."""
        if not self._is_leader:
            return False  # only rank 0 holds this root; the other nodes' leaders only put parts here
        self.session.ensure_writer(f"{'pin' if pinned else 'unpin'}({step})")
        lock = self.session.lock
        assert lock is not None
        with lock:
            entry = self.view.get(step)
            if entry is None:
                return False
            if entry.record.pinned != pinned:
                self.view.update(Committed(entry.path, amend_record(entry.path, lock, pinned=pinned)))
        if not pinned:
            self._prune_after(step)
        return True

    def newest(self) -> Committed | None:
        """This root's most recent commit."""
        committed = self.view.committed()
        return max(committed, key=lambda c: (c.record.seq or 0, c.record.step)) if committed else None

    def _discard(self, staging: Loc) -> None:
        lock = self.session.lock
        if lock is None:
            return
        try:
            collect_abandoned_staging(self.layout, lock, only=staging)
            if self.session.deleter is not None:
                self.session.deleter.schedule()
        except Exception as e:  # the upload's error is the news; the leftover is collected at next start
            logger.info("safeckpt: could not discard the upload left in %s (%s)", staging, e)

    def drain(self, timeout: float) -> None:
        self.session.drain(timeout)

    def release(self) -> list[BaseException]:
        return self.session.release()
