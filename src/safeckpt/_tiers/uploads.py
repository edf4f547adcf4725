"""Uploading each local commit to the durable tier, in commit order, on a thread of its own.

A local commit is queued here once it is committed. The upload thread copies it
to the durable root (:class:`~.durable.DurableTier`), and once that commit is
made it marks the local record as uploaded. Local retention keeps every
commit whose record is not marked (:meth:`Uploader.kept_for_upload`), so nothing is
pruned before it is durable, whether or not it reached this queue.

A failed upload (the durable tier unreachable) stays first in the queue and is
tried again after growing pauses, so later commits wait behind it and nothing
is uploaded out of order. A local copy that cannot be uploaded at all (its
bytes fail their checksums, or it was replaced or removed meanwhile) is
dropped from the queue with an error, so it does not hold the others back. A
commit the durable root already holds (the same step and bytes: a crash came
between its durable commit and the local mark) is marked, never uploaded twice.
A local commit the durable root has moved on past (another node committed there
since the state it was saved from) is never uploaded: it is set aside, with a
warning. Every step that will never be durable (damaged, removed, set aside) is
named once by the next ``wait(durable=True)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from .._format.identity import Fate, fate_of
from .._format.layout import Layout
from .._format.record import amend_record, read_record
from .._format.tier_fields import Upload
from .._manager.saves import Committed, SaveView
from .._root.copy import CopyStopped
from .._store.base import Lock
from .._util.failure_log import FailureLog
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    SaveFailedError,
)
from .durable import LOCAL_COPY_BAD, BehindRootError, DurableTier
from .leader_wait import Heartbeat
from .node_parts import PartsNotIn
from .withdraw import set_aside

logger = logging.getLogger("safeckpt.manager")

_MAX_PAUSE = 30.0  # between tries while the durable tier cannot be reached
_BACKLOG_WARNING = 3  # local commits waiting before the warning says the backlog grows

# Why a step will never be durable (see take_lost).
DAMAGED = "damaged"
REMOVED = "removed"
BEHIND = "behind"


class Uploader:
    """The queue of local commits to make durable, and the thread that works it.

    Call rules: ``submit`` from the local writer thread; ``upload_earlier`` at start-up, before
    any submit; ``wait``, ``kept_for_upload`` and ``close`` from any thread.
    """

    def __init__(
        self, durable: DurableTier, local_view: SaveView, local_lock: Lock, *, retry_interval: float
    ) -> None:
        self._durable = durable
        self._local_view = local_view
        self._local_lock = local_lock
        self._retry_interval = retry_interval
        self._queue: deque[Committed] = deque()
        self._current: Committed | None = None  # the entry being uploaded (the queue's head)
        self._dropped: set[tuple[int, int | None]] = set()  # (step, seq) never to be uploaded
        # Steps that will never be durable, and why (DAMAGED, REMOVED, BEHIND), not yet told to
        # wait(durable=True).
        self._lost: list[tuple[int, str]] = []
        self._cond = threading.Condition()
        self._wake = threading.Event()  # cuts a pause short: close(), or a wait for durability
        self._closed = False
        self._failures = 0  # tries in a row that failed (the pause grows with them)
        self._said = FailureLog(logger, f"the uploader to {durable.root}")
        self._last_error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # --- the queue ---------------------------------------------------------------------------------

    def submit(self, committed: Committed) -> None:
        """Queue a local commit; the thread starts on the first one."""
        with self._cond:
            step = committed.record.step
            # A copy put back (a several-node save withdrawn) may have been dropped meanwhile.
            self._dropped.discard((step, committed.record.seq))
            # The same step saved again before its upload: the newer copy replaces it in line (not
            # the one being uploaded, whose mark checks that it is still the local copy).
            self._queue = deque(c for c in self._queue if c is self._current or c.record.step != step)
            self._queue.append(committed)
            waiting, failures, last = len(self._queue), self._failures, self._last_error
            self._cond.notify_all()
        self._start()
        if waiting >= _BACKLOG_WARNING and failures:
            logger.warning(
                "safeckpt: %d local checkpoint(s) wait to be uploaded to %s (the last try failed: %s); "
                "they are kept on the local disk until they are",
                waiting,
                self._durable.root,
                last,
            )

    def set_aside_behind(self, committed: list[Committed], local: Layout) -> None:
        """At start (rank 0, holding the local root): move the local commits the durable root has
        moved on past out of the run's way (see :func:`set_aside`): never uploaded, restored or
        counted, kept for a look. Each is said in a warning."""
        for c in sorted(committed, key=lambda c: c.record.seq or 0):
            if c.record.uploaded is None and c.record.part is None:
                newer = self._durable.moved_on(c.record)
                if newer is not None:
                    error = self._durable.behind_error(c.path, c.record, newer)
                    self._set_aside(c, error, local, tell=False)  # an earlier run's: warned now

    def upload_earlier(
        self,
        committed: list[Committed],
        *,
        heartbeat: Heartbeat | None = None,
        whole: frozenset[str] | None = None,
        wait: bool = True,
    ) -> None:
        """At start: upload the local commits an earlier run left without an upload, before training
        goes on; if the durable tier cannot be reached, they wait in the queue (with a warning).

        One the durable root has moved on past is not uploaded (:meth:`set_aside_behind` moved
        it out of the way first, where it could). ``heartbeat``: as for :meth:`wait`. With a part
        on each node: ``whole``, the saves every node holds a part of (the others are never
        uploaded); ``wait=False`` queues without waiting (a node's leader: rank 0 waits, for the
        commits)."""
        waiting = []
        for c in sorted(committed, key=lambda c: (c.record.seq or 0, c.record.step)):
            if c.record.uploaded is not None:
                continue
            if c.record.part_id is not None and (whole is None or c.record.part_id not in whole):
                logger.warning(
                    "safeckpt: step %d in %s was never uploaded, and not every node holds its part of "
                    "that save (a node's disk was replaced, the save was cut short, or %s has moved on "
                    "past it): it is not uploaded; local retention removes it",
                    c.record.step,
                    c.path.parent,
                    self._durable.root,
                )
                self._dropped.add((c.record.step, c.record.seq))
                continue
            if c.record.part_id is None and self.behind(c):
                logger.warning(
                    "safeckpt: step %d in %s was never uploaded, but %s has moved on past it: it is "
                    "not uploaded",
                    c.record.step,
                    c.path.parent,
                    self._durable.root,
                )
                self._dropped.add((c.record.step, c.record.seq))
                continue
            waiting.append(c)
        if not waiting:
            return
        with self._cond:
            self._queue.extend(waiting)
        logger.info(
            "safeckpt: uploading step(s) %s, committed locally but not uploaded by the last run",
            ", ".join(str(c.record.step) for c in waiting),
        )
        self._start()
        if wait and not self.wait(give_up_on_failure=True, heartbeat=heartbeat):
            logger.warning(
                "safeckpt: could not upload step(s) %s to %s (%s); training goes on, and they are "
                "uploaded in the background once it can be reached",
                ", ".join(map(str, self.waiting()[0])),
                self._durable.root,
                self._last_error,
            )

    def behind(self, c: Committed) -> bool:
        """The durable root (rank 0's view of it) has moved on past ``c`` and does not hold it."""
        return self._durable.holds(c.record) is None and self._durable.moved_on(c.record) is not None

    def kept_for_upload(self) -> frozenset[int]:
        """Local steps that local retention keeps: every commit whose record is not marked as
        uploaded, except those that will never be (dropped)."""
        return frozenset(
            c.record.step
            for c in self._local_view.committed()
            if c.record.uploaded is None and (c.record.step, c.record.seq) not in self._dropped
        )

    def wait(
        self,
        timeout: float | None = None,
        *,
        give_up_on_failure: bool = False,
        heartbeat: Heartbeat | None = None,
    ) -> bool:
        """Until the queue is empty (True), ``timeout`` passes, the uploader closes, or, with
        ``give_up_on_failure``, a try fails. False when something is still waiting.

        ``heartbeat`` is sent every ``heartbeat.every`` s meanwhile, outside the lock: rank 0 tells
        the other ranks, which wait in a collective whose timeout an upload may outlast, that it
        still waits (see :mod:`.leader_wait`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wake.set()  # someone waits: a try now, not after the rest of a pause
        with self._cond:
            failures = self._failures
        every = heartbeat.every if heartbeat is not None else 1.0
        beat = time.monotonic() + every
        while True:
            with self._cond:
                if not self._queue:
                    return True
                if self._closed or (give_up_on_failure and self._failures > failures):
                    return False
                now = time.monotonic()
                if deadline is not None and deadline <= now:
                    return False
                until = min(beat, deadline if deadline is not None else beat)
                self._cond.wait(max(0.0, until - now))
            if time.monotonic() >= beat:
                if heartbeat is not None:
                    heartbeat.send()
                beat = time.monotonic() + every

    def wake(self) -> None:
        """Cut a pause between tries short: someone waits for the uploads (another node's leader,
        whose rank 0 waits for its parts)."""
        self._wake.set()

    def waiting(self) -> tuple[list[int], BaseException | None]:
        """The steps still queued, and the last failure."""
        with self._cond:
            return [c.record.step for c in self._queue], self._last_error

    def take_lost(self) -> list[tuple[int, str]]:
        """The steps that will never be durable since the last call, each with why (``DAMAGED``,
        ``REMOVED``, ``BEHIND``): each is told once."""
        with self._cond:
            lost, self._lost = self._lost, []
            return lost

    def close(self, timeout: float, *, heartbeat: Heartbeat | None = None) -> tuple[list[int], bool]:
        """Wait up to ``timeout`` s while uploads succeed, then stop the thread; the steps left (the
        next start uploads them), and whether the thread is still running (stuck in a request)."""
        deadline = time.monotonic() + timeout
        self.wait(timeout, give_up_on_failure=True, heartbeat=heartbeat)
        with self._cond:
            self._closed = True
            left = sorted(c.record.step for c in self._queue)
            self._cond.notify_all()
        self._wake.set()
        if self._thread is not None:
            # A request in flight may outlast the collective timeout: beat while joining too.
            until = time.monotonic() + max(1.0, deadline - time.monotonic())
            every = heartbeat.every if heartbeat is not None else 1.0
            while self._thread.is_alive() and (left_s := until - time.monotonic()) > 0:
                self._thread.join(timeout=min(every, left_s))
                if heartbeat is not None and self._thread.is_alive():
                    heartbeat.send()
        return left, self._thread is not None and self._thread.is_alive()

    # --- the thread ---------------------------------------------------------------------------------

    def _start(self) -> None:
        with self._cond:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="safeckpt-upload", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                self._work_one()
            except CopyStopped:
                return
            except PartsNotIn as e:  # another node's part, or rank 0's commit of it: not a failure
                logger.debug("safeckpt: %s", e)
            except Exception as e:
                self._failed(e)

    def _work_one(self) -> None:
        """Upload the queue's head; drop it when done, or when it can never be uploaded."""
        with self._cond:
            head = self._current = self._queue[0]
        try:
            try:
                self._upload(head)
            except BehindRootError as e:  # another node went on from the root: never over it
                self._set_aside(head, e, Layout(head.path.parent))
            except LOCAL_COPY_BAD as e:
                self._drop(head, e)
            except PartsNotIn:
                raise  # still first in line: tried again at once
            except OSError as e:
                if fate_of(head.path, head.record) is Fate.SAME:
                    raise  # the local copy is as queued: the durable tier failed, try again
                self._drop(head, e)  # saved again or removed meanwhile: a file of it vanished
        finally:
            with self._cond:
                self._current = None
        with self._cond:
            if self._queue and self._queue[0] is head:
                self._queue.popleft()
            if self._failures:
                self._said.worked()
            self._failures, self._last_error = 0, None
            self._cond.notify_all()

    def _drop(self, head: Committed, error: BaseException) -> None:
        """The local copy cannot be uploaded: replaced since (its newer copy is in line), removed
        (by hand, with ``local_dir`` itself, or moved aside as damaged), or damaged. The last two
        are not durable, and are said so."""
        with self._cond:
            key = (head.record.step, head.record.seq)
            if any(c is not head and (c.record.step, c.record.seq) == key for c in self._queue):
                return  # put back and in line again meanwhile: its next try uploads it
            self._dropped.add(key)
        fate = fate_of(head.path, head.record)
        if fate is Fate.REPLACED:
            logger.info(
                "safeckpt: step %d changed while it was uploaded (%s); not uploaded", head.record.step, error
            )
            return
        with self._cond:
            self._lost.append((head.record.step, DAMAGED if fate is Fate.SAME else REMOVED))
        logger.error(
            "safeckpt: step %d in %s cannot be uploaded: %s. It is not durable; the next commits are "
            "uploaded as usual",
            head.record.step,
            head.path,
            "its local copy is gone (removed before its upload)" if fate is Fate.GONE else error,
        )

    def _set_aside(self, c: Committed, error: BehindRootError, local: Layout, *, tell: bool = True) -> None:
        """A local commit the durable root has moved on past: moved aside under the local lock
        (out of the view: never uploaded, restored or counted), and said in a warning; ``tell``:
        and by the next ``wait(durable=True)``."""
        with self._cond:
            self._dropped.add((c.record.step, c.record.seq))
            if tell:
                self._lost.append((c.record.step, BEHIND))
        where = None
        try:
            where = set_aside(local, self._local_lock, c.path, c.record, str(error))
        except (OSError, CheckpointError) as e:
            logger.warning("safeckpt: could not move step %d of %s aside (%s)", c.record.step, local.root, e)
        if where is not None or fate_of(c.path, c.record) is not Fate.SAME:
            self._local_view.drop([c.record.step])
        logger.warning(
            "safeckpt: %s. It is not uploaded, and never restored%s",
            error,
            f": it is kept in {where.where} (`safeckpt gc {local.root.where}` removes it)"
            if where is not None
            else "",
        )

    def _failed(self, error: BaseException) -> None:
        with self._cond:
            self._failures += 1
            self._last_error = error
            failures = self._failures
            step = self._queue[0].record.step if self._queue else None
            self._cond.notify_all()
        pause = min(_MAX_PAUSE, self._retry_interval * 2 ** (failures - 1))
        self._said.failed(  # one line per kind of failure, not one per try
            type(error).__name__,
            "uploading step %s failed (%s); it stays on the local disk and is tried again, first in %.0f s",
            step,
            error,
            pause,
        )
        self._wake.clear()
        self._wake.wait(pause)

    def _upload(self, local: Committed) -> None:
        """One local commit made durable, then marked as uploaded in its local record."""
        record = read_record(local.path)  # as it is now: a pin since, its checksums
        if record is None or not record.committed or record.seq != local.record.seq:
            raise CheckpointNotFoundError(
                f"{local.path} no longer holds the commit queued", path=str(local.path)
            )
        if record.uploaded is not None:
            return
        durable = self._durable.holds(record)
        if durable is None:
            started = time.monotonic()
            durable = self._durable.upload(local.path, record, should_stop=lambda: self._closed)
            logger.info(
                "safeckpt: uploaded step %d to %s in %.2f s",
                record.step,
                durable.path,
                time.monotonic() - started,
            )
        self._mark(local, durable)

    def _mark(self, local: Committed, durable: Committed) -> None:
        """The local record says where its durable copy is, if it is still the copy uploaded."""
        with self._local_lock:
            current = read_record(local.path)
            if current is None or current.seq != local.record.seq:
                return  # saved again since: the newer copy is in line
            if current.pinned != durable.record.pinned:  # pinned or unpinned while it went up
                self._durable.set_pinned(current.step, current.pinned)
            marked = amend_record(
                local.path, self._local_lock, uploaded=Upload.local_mark(time.time(), str(durable.path.where))
            )
        self._local_view.update(Committed(local.path, marked))


def not_uploaded_error(
    root: object,
    local_dir: object,
    steps: list[int],
    error: BaseException | None,
    *,
    lost: list[tuple[int, str]],
) -> CheckpointError:
    """What ``wait(durable=True)`` raises when uploads are still waiting, or some never will be."""
    said = []
    why = {
        DAMAGED: f"their copies in {local_dir} are damaged (the error logged for each says how)",
        REMOVED: f"their copies in {local_dir} were removed before their upload",
        BEHIND: f"{root} has moved on past them (another node or job committed there since the "
        f"state they were saved from); they are kept aside in {local_dir}/.damaged",
    }
    for kind, reason in why.items():
        of_kind = [step for step, k in lost if k == kind]
        if of_kind:
            said.append(
                f"step(s) {', '.join(map(str, of_kind))} could not be uploaded to {root}: {reason}, "
                "so they are not durable and never will be; the steps saved after them are uploaded "
                "as usual."
            )
    if steps:
        said.append(
            f"step(s) {', '.join(map(str, steps))} are committed in {local_dir} but not uploaded to "
            f"{root}{f' ({error})' if error is not None else ''}. They stay on the local disk, and the "
            "upload is tried again in the background (and by the next start)."
        )
    return SaveFailedError(" ".join(said))
