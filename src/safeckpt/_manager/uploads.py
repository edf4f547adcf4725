"""Uploading each local commit to the durable tier, in commit order, on a thread of its own.

A local commit is queued here once it is committed. The upload thread copies it
to the durable root (:class:`~.durable.DurableTier`), and once that commit is
made it marks the local record as uploaded; only then may local retention
prune it. A failed upload (the durable tier unreachable) stays first in the
queue and is tried again with growing pauses, so later commits wait behind it
and nothing is uploaded out of order. A commit that the durable root already
holds (the same step and bytes: a crash came between its durable commit and
the local mark) is marked, never uploaded twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from .._format.record import amend_record, read_record
from .._store.base import Lock
from ..errors import CheckpointError
from .durable import DurableTier
from .saves import Committed, SaveView

logger = logging.getLogger("safeckpt.manager")

_MAX_PAUSE = 30.0  # between tries while the durable tier cannot be reached
_BACKLOG_WARNING = 3  # local commits waiting before the warning says the backlog grows


class Uploader:
    """The queue of local commits to make durable, and the thread that works it.

    Call rules: ``submit`` from the local writer thread (or start-up); ``wait``,
    ``pending_steps`` and ``close`` from any thread.
    """

    def __init__(
        self, durable: DurableTier, local_view: SaveView, local_lock: Lock, *, retry_interval: float
    ) -> None:
        self._durable = durable
        self._local_view = local_view
        self._local_lock = local_lock
        self._retry_interval = retry_interval
        self._queue: deque[Committed] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._failures = 0  # tries in a row that failed (the pause grows with them)
        self._last_error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # --- the queue ---------------------------------------------------------------------------------

    def submit(self, committed: Committed) -> None:
        """Queue a local commit; the thread starts on the first one."""
        with self._cond:
            if any(c.record.step == committed.record.step for c in self._queue):
                # The same step saved again before its upload: the newer copy replaces it in line.
                self._queue = deque(c for c in self._queue if c.record.step != committed.record.step)
            self._queue.append(committed)
            waiting = len(self._queue)
            self._cond.notify_all()
        self._start()
        if waiting >= _BACKLOG_WARNING and self._failures:
            logger.warning(
                "safeckpt: %d local checkpoint(s) wait to be uploaded to %s (the last try failed: %s); "
                "they are kept on the local disk until they are",
                waiting,
                self._durable.root,
                self._last_error,
            )

    def upload_earlier(self, committed: list[Committed]) -> None:
        """At start: upload the local commits an earlier run left without an upload, before training
        goes on; if the durable tier cannot be reached, they wait in the queue (with a warning)."""
        waiting = sorted(
            (c for c in committed if c.record.uploaded is None),
            key=lambda c: (c.record.seq if c.record.seq is not None else -1, c.record.step),
        )
        if not waiting:
            return
        with self._cond:
            self._queue.extend(waiting)
        logger.info(
            "safeckpt: uploading step(s) %s, committed locally but not uploaded by the last run",
            ", ".join(str(c.record.step) for c in waiting),
        )
        try:
            self.upload_now()
        except Exception as e:
            logger.warning(
                "safeckpt: could not upload step(s) %s to %s (%s); training goes on, and they are "
                "uploaded in the background once it can be reached",
                ", ".join(map(str, sorted(self.pending_steps()))),
                self._durable.root,
                e,
            )
            self._start()

    def pending_steps(self) -> frozenset[int]:
        """Local steps not uploaded yet (local retention keeps them)."""
        with self._cond:
            return frozenset(c.record.step for c in self._queue)

    def _start(self) -> None:
        with self._cond:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="safeckpt-upload", daemon=True)
                self._thread.start()

    def wait(self, timeout: float | None = None, *, give_up_on_failure: bool = False) -> bool:
        """Until the queue is empty (True), ``timeout`` passes, or, with ``give_up_on_failure``, a try
        fails. False when something is still waiting."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            failures = self._failures
            while self._queue:
                if self._closed or (give_up_on_failure and self._failures > failures):
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
            return True

    def upload_now(self) -> None:
        """Work the queue on this thread until it is empty; raises the first failure (start-up, the CLI)."""
        while True:
            with self._cond:
                if not self._queue:
                    return
                head = self._queue[0]
            self._upload(head)
            with self._cond:
                if self._queue and self._queue[0] is head:
                    self._queue.popleft()
                self._cond.notify_all()

    def close(self, timeout: float) -> list[int]:
        """Stop the thread after at most ``timeout`` s of waiting; the steps left (uploaded by the next
        start, or ``safeckpt upload``)."""
        self.wait(timeout, give_up_on_failure=True)
        with self._cond:
            self._closed = True
            left = sorted(c.record.step for c in self._queue)
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(timeout, 1.0))
        return left

    # --- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                head = self._queue[0]
            try:
                self._upload(head)
            except Exception as e:
                self._failed(head, e)
                continue
            with self._cond:
                if self._queue and self._queue[0] is head:
                    self._queue.popleft()
                self._failures, self._last_error = 0, None
                self._cond.notify_all()

    def _failed(self, head: Committed, error: BaseException) -> None:
        with self._cond:
            self._failures += 1
            self._last_error = error
            failures = self._failures
            self._cond.notify_all()
        pause = min(_MAX_PAUSE, self._retry_interval * 2 ** (failures - 1))
        log = logger.warning if failures == 1 or failures % 10 == 0 else logger.info
        log(
            "safeckpt: uploading step %d to %s failed (%s); it stays on the local disk and is tried "
            "again in %.0f s",
            head.record.step,
            self._durable.root,
            error,
            pause,
        )
        with self._cond:
            if not self._closed:
                self._cond.wait(pause)

    def _upload(self, local: Committed) -> None:
        """One local commit made durable, then marked as uploaded in its local record."""
        record = read_record(local.path)  # as it is now: a pin since, its checksums
        if record is None or not record.committed:
            raise CheckpointError(f"{local.path} has no committed record to upload", path=str(local.path))
        if record.uploaded is not None:
            return
        durable = self._durable.holds(record)
        if durable is None:
            started = time.monotonic()
            durable = self._durable.upload(local.path, record)
            logger.info(
                "safeckpt: uploaded step %d to %s in %.2f s",
                record.step,
                durable.path,
                time.monotonic() - started,
            )
        marked = amend_record(
            local.path, self._local_lock, uploaded={"at": time.time(), "to": str(durable.path.where)}
        )
        self._local_view.update(Committed(local.path, marked))
