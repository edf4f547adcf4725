"""Removing checkpoints: to the trash at once, deleted in the background, with retries.

On NFS a file deleted while some process still holds it open becomes a hidden
``.nfsXXXX`` file until the last close, so ``rmtree`` of its directory fails with
ENOTEMPTY (or EBUSY) for a while, usually well under a second. So a pruned
checkpoint is first renamed into ``<root>/.trash/`` (instant, and invisible to
resume), and a background :class:`Deleter` removes trash entries in passes:

* ``rmtree`` is retried on ENOTEMPTY, EBUSY, or ENOENT while the directory
  still exists; every other error is tried once;
* all removals of one pass share the waits 0.05, 0.1, 0.2 and 0.4 s, so a pass
  sleeps at most 0.75 s however many directories keep failing;
* every attempt holds the sidecar lock; the waits do not;
* what a pass leaves is retried by the next one, and warned about once;
* ``drain()`` (called by ``close()``) keeps passing for a longer budget, so a
  server that keeps a ``.nfs`` file for seconds leaves nothing behind;
* a trash that cannot be reached at all (object storage down) is left for the
  next pass, the next start or ``safeckpt gc``, with one warning per kind of
  failure: pruning never fails training, nor ``close()``.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .._format.layout import (
    ABANDONED,
    PRUNED,
    REPLACED,
    Layout,
    parse_staging_name,
    parse_trash_name,
    step_dirname,
)
from .._format.record import Record, read_record
from .._store.base import Lock
from .._store.loc import Loc
from .._util.failure_log import FailureLog
from ..errors import CheckpointError, IncompleteCheckpointError, RootInUseError

logger = logging.getLogger(__name__)

RETRY_WAITS: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4)
_TRANSIENT = {errno.ENOTEMPTY, errno.EBUSY}


class RetryBudget:
    """The waits one cleanup pass may still spend, shared by all its removals."""

    def __init__(self, waits: Sequence[float] = RETRY_WAITS) -> None:
        self._waits = list(waits)
        self.slept = 0.0

    def next_wait(self) -> float | None:
        return self._waits.pop(0) if self._waits else None

    def exhausted(self) -> bool:
        return not self._waits


@dataclass
class RemovalResult:
    """What one :func:`remove_tree` call did."""

    removed: bool
    attempts: int = 0
    error: OSError | None = None


def _transient(error: OSError, path: Loc) -> bool:
    if error.errno in _TRANSIENT:
        return True
    # ENOENT while the directory is still there: rmtree raced with a .nfs file
    # vanishing under it; try again. ENOENT with the directory gone is success.
    return error.errno == errno.ENOENT and path.entry() is not None


def remove_tree(path: Loc, budget: RetryBudget, lock: Lock) -> RemovalResult:
    """Remove ``path``, retrying transient errors while ``budget`` has waits left.

    Each attempt holds ``lock``; each wait does not. Never raises ``OSError``:
    the result says whether the tree is gone and carries the last error.
    """
    result = RemovalResult(removed=False)
    while True:
        result.attempts += 1
        try:
            with lock:
                path.store.remove(path.key)
        except OSError as e:
            if e.errno == errno.ENOENT and path.entry() is None:
                result.removed, result.error = True, None
                return result
            result.error = e
            if not _transient(e, path):
                return result
            wait = budget.next_wait()
            if wait is None:
                return result
            path.store.sleep(wait)
            budget.slept += wait
        else:
            result.removed, result.error = True, None
            return result


@dataclass
class PassResult:
    """One cleanup pass over the trash."""

    removed: list[Loc] = field(default_factory=list)
    remaining: dict[Loc, OSError | None] = field(default_factory=dict)
    slept: float = 0.0
    attempts: int = 0


class Deleter:
    """Deletes what is in ``<root>/.trash`` in passes; in the background once started.

    Call rules: ``schedule()`` from any thread; ``run_pass()`` and ``drain()``
    from any thread (passes are serialised); ``close()`` once, from the owner.
    Only a process that owns the root's writes (rank 0 of the training job, or
    a ``safeckpt`` command under the sidecar lock) runs a deleter.
    """

    def __init__(self, layout: Layout, lock: Lock, *, retry_interval: float = 1.0) -> None:
        self._layout = layout
        self._lock = lock
        self._retry_interval = retry_interval
        self._pass_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._warned: set[str] = set()
        self._thread: threading.Thread | None = None
        self._failures = FailureLog(logger, f"the deleter of {layout.root}")
        self.passes = 0

    def start(self) -> None:
        """Start the thread, or start it again if it stopped (the root was lost, then claimed again)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="safeckpt-deleter", daemon=True)
            self._thread.start()

    def schedule(self) -> None:
        """Ask for a pass soon (after a prune)."""
        self._wake.set()

    def run_pass(self, waits: Sequence[float] = RETRY_WAITS) -> PassResult:
        """Try every trash entry once, sharing ``waits`` among them."""
        with self._pass_lock:
            self.passes += 1
            budget = RetryBudget(waits)
            result = PassResult()
            for entry in self._layout.trash_entries():
                if _is_replaced(entry):
                    continue  # only recover_interrupted_replacements() decides about these
                removal = remove_tree(entry, budget, self._lock)
                result.attempts += removal.attempts
                if removal.removed:
                    result.removed.append(entry)
                    if entry.name in self._warned:
                        logger.info("removed %s after earlier failures", entry)
                        self._warned.discard(entry.name)
                else:
                    result.remaining[entry] = removal.error
                    self._warn_once(entry, removal.error)
            result.slept = budget.slept
            return result

    def drain(self, timeout: float) -> list[Loc]:
        """Pass until the trash is empty or ``timeout`` s have gone; what is left. Never raises:
        a trash that cannot be reached now is left, with a warning, for the next start or gc."""
        deadline = time.monotonic() + timeout
        pause = 0.05
        while True:
            try:
                result = self.run_pass()
            except (OSError, CheckpointError) as e:
                logger.warning(
                    "safeckpt: could not empty the trash of %s now (%s); what it holds stays there, "
                    "out of resume's way, for the next start or `safeckpt gc`",
                    self._layout.root,
                    e,
                )
                return []
            if not result.remaining:
                return []
            left = deadline - time.monotonic()
            # Only transient errors (a .nfs file still open somewhere) are worth waiting for;
            # a permission error or a read-only filesystem will not clear within the budget.
            waiting = any(e is not None and _transient(e, p) for p, e in result.remaining.items())
            if left <= 0 or not waiting:
                for entry, error in result.remaining.items():
                    logger.warning(
                        "safeckpt: %s could not be deleted%s (%s); it stays in the trash, out of "
                        "resume's way, and the next cleanup tries again",
                        entry,
                        f" within the {timeout:.1f} s drain budget" if waiting else "",
                        error,
                    )
                return list(result.remaining)
            self._layout.store.sleep(min(pause, left))
            pause = min(pause * 2, 1.0)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=self._retry_interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if self._layout.trash_entries():
                    self.run_pass()
                self._failures.worked("deleting the trash")
            except RootInUseError as e:  # the root was taken over: nothing of it is ours to delete
                self._failures.failed("ownership", "stopped: %s", e)
                return
            except Exception as e:  # pruning never fails training: the next pass tries again
                self._failures.failed(
                    "deleting the trash",
                    "could not delete pruned checkpoints now (%s: %s); they stay in the trash, out of "
                    "resume's way, and are retried (or collected by the next start or `safeckpt gc`)",
                    type(e).__name__,
                    e,
                )

    def _warn_once(self, entry: Loc, error: OSError | None) -> None:
        if entry.name in self._warned:
            return
        self._warned.add(entry.name)
        logger.warning(
            "safeckpt: could not delete pruned checkpoint %s yet (%s); it is out of the way "
            "in the trash and will be retried. On NFS this is usually a file still open "
            "somewhere (.nfsXXXX).",
            entry,
            error,
        )


def _is_replaced(entry: Loc) -> bool:
    parsed = parse_trash_name(entry.name)
    return parsed is not None and parsed[1] == REPLACED


def recover_interrupted_replacements(layout: Layout, lock: Lock) -> list[int]:
    """Finish or undo replacements of a step that a crash interrupted; the steps put back.

    A ``step_<N>.replaced.*`` trash entry exists only between the two renames of
    a replacement on a filesystem without ``RENAME_EXCHANGE``. If ``step_<N>``
    is missing, the new copy never landed: the old copy goes back. Otherwise the
    new copy landed and the old one is relabelled as pruned. Holds the sidecar lock.
    """
    restored = []
    with lock:
        for entry in layout.trash_entries():
            parsed = parse_trash_name(entry.name)
            if parsed is None or parsed[1] != REPLACED:
                continue
            step = parsed[0]
            target = layout.step_dir(step)
            store = layout.store
            if target.entry() is not None:
                store.move(entry.key, layout.new_trash_path(step, PRUNED).key)
                continue
            store.move(entry.key, target.key)
            store.sync(target.parent.key)
            restored.append(step)
            logger.warning(
                "safeckpt: put back %s as %s: a save that replaced it was interrupted",
                entry,
                target,
            )
    return restored


def collect_abandoned_staging(
    layout: Layout, lock: Lock, *, only: Loc | None = None, keep: Callable[[str], bool] | None = None
) -> list[Loc]:
    """Move ``.staging`` leftovers (or just ``only``) into the trash; the trash paths.

    Every leftover only at start, before any save; ``only`` for a save that
    failed. Holds the sidecar lock. An entry already gone is skipped, and one
    whose name ``keep`` says is in use (other writers' uploads of this run).
    """
    moved = []
    with lock:
        entries = [only] if only is not None else layout.staging_entries()
        for entry in entries:
            if entry.entry() is None or (only is None and keep is not None and keep(entry.name)):
                continue
            step = parse_staging_name(entry.name)
            target = layout.new_trash_path(step if step is not None else 0, ABANDONED)
            layout.store.make_dir(layout.trash.key)
            layout.store.move(entry.key, target.key)
            moved.append(target)
    return moved


def discard_checkpoint(layout: Layout, lock: Lock, step: int) -> tuple[bool, Record | None]:
    """Move ``step_<N>`` to the trash, unless it is pinned or ``latest`` names it.

    Both are re-checked on disk under the sidecar lock (a ``safeckpt pin`` from
    another process changes only the record). Returns whether it moved, and the
    record as read (None if unreadable). A directory already gone counts as moved.
    """
    path = layout.step_dir(step)
    with lock:
        try:
            record = read_record(path)
        except IncompleteCheckpointError:
            record = None
        if record is not None and record.pinned:
            return False, record
        if layout.store.read_pointer(layout.latest_path.key) == step_dirname(step):
            return False, record
        to_trash(layout, path, step)  # already gone (pruned from outside): counts as moved
    return True, record


def to_trash(layout: Layout, entry: Loc, step: int) -> bool:
    """Move ``entry`` (of ``step``) into the trash, which the deleter empties; whether it was there.
    The caller holds the sidecar lock."""
    layout.store.make_dir(layout.trash.key)
    try:
        layout.store.move(entry.key, layout.new_trash_path(step, PRUNED).key)
    except FileNotFoundError:
        return False
    return True
