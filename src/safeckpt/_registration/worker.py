"""Registration off the commit path: a thread that tells a registrar about commits.

The manager commits a checkpoint, hands a :class:`CommitInfo` to its
:class:`RegistrationWorker` and goes on: saves, commits, pruning and agreement
never wait for a registration. The worker calls the registrar on its own
daemon thread, one commit at a time in commit order, and writes the outcome
into the checkpoint's record::

    "registration": {"status": "registered" | "failed" | "skipped" | "unfinished",
                     "error": str | None, "time": float, "registrar": {...}, ...}

plus whatever ``register()`` returned. A registrar that raises anything (also a
``BaseException`` such as DCP's ``CheckpointException``) costs only that
registration; it is retried, oldest first, before the next commit's, and by
``safeckpt register ROOT`` (:func:`~safeckpt._registration.pending.register_pending`).

Guarantees: ``submit`` never blocks; ``close(timeout)`` returns within about
``timeout`` seconds even when ``register()`` hangs, and marks what it did not
finish as ``unfinished``. Not guaranteed: that a registration happens at all
(a process killed before it leaves no status; ``register_pending`` finds it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._format.catalog import scan
from .._format.record import Record, amend_record, check_json_value, read_record
from .._policy.retention import CheckpointInfo, KeepBest
from .._store.base import Lock
from .._store.loc import Loc, as_loc
from ..errors import CheckpointError, IncompleteCheckpointError
from .registrar import Registrar

logger = logging.getLogger(__name__)

REGISTERED = "registered"
FAILED = "failed"
SKIPPED = "skipped"
UNFINISHED = "unfinished"
RETRIED = (FAILED, UNFINISHED)
"""Statuses that a later commit or ``safeckpt register`` tries again."""

# Marking registrations unfinished at close() must not wait long for the sidecar lock.
_CLOSE_LOCK_TIMEOUT = 2.0


@dataclass(frozen=True)
class CommitInfo:
    """What a registrar learns about one commit (rank 0)."""

    step: int
    path: Path | str
    """The committed checkpoint directory (``<root>/step_<N>``): a ``Path`` for a local root, else
    its URL."""
    record: Record
    root: Path | str
    is_best: bool = False
    """The best committed checkpoint by retention's ``keep_best`` metric when it committed."""
    final: bool = False
    """Submitted by ``close()`` for the checkpoint ``latest`` names, not by a commit."""
    location: Loc | None = field(default=None, repr=False, compare=False)
    """Where safeckpt reads and amends the record (its root's store); None: ``path``."""

    @staticmethod
    def of(
        step: int, directory: Loc, record: Record, root: Loc, *, is_best: bool = False, final: bool = False
    ) -> CommitInfo:
        """The info of a commit at ``directory`` of ``root``, paths as a person names them."""
        return CommitInfo(
            step,
            directory.where,
            record,
            root.where,
            is_best=is_best,
            final=final,
            location=directory,
        )

    def _loc(self) -> Loc:
        return self.location if self.location is not None else as_loc(self.path)


def wants(registrar: Registrar, info: CommitInfo) -> bool:
    """Whether ``registrar`` registers ``info``: its ``should_register`` if it has one.

    Without one, every commit is registered and a final info (already
    registered at its commit) is not.
    """
    should = getattr(registrar, "should_register", None)
    if should is None:
        return not info.final
    return bool(should(info))


def best_metric(retention: Any) -> tuple[str, str] | None:
    """``(metric, mode)`` of the first ``keep_best`` rule in ``retention``, or None.

    Accepts a :class:`~safeckpt.Retention`, a :class:`~safeckpt.KeepBest`, or a
    policy combining others (``KeepAny``).
    """
    if retention is None:
        return None
    if isinstance(retention, KeepBest):
        return retention.metric, retention.mode
    if getattr(retention, "keep_best", None) is not None and getattr(retention, "metric", None):
        return str(retention.metric), str(getattr(retention, "mode", "min"))
    policies = getattr(retention, "policies", ()) or ()
    if callable(policies):  # Retention.policies()
        policies = policies()
    for policy in policies:
        found = best_metric(policy)
        if found is not None:
            return found
    return None


def is_best(step: int, infos: Iterable[Any], retention: Any) -> bool:
    """Whether ``step`` is the best of ``infos`` by retention's metric (ties go to the newer step).

    ``infos``: objects with ``step`` and ``metrics`` (``CheckpointInfo``,
    ``CheckpointStatus``). False without a ``keep_best`` metric or when
    ``step`` lacks the metric.
    """
    found = best_metric(retention)
    if found is None:
        return False
    metric, mode = found
    infos = list(infos)
    mine = [i for i in infos if i.step == step]
    if not mine or mine[0].metrics.get(metric) is None:
        return False
    best = KeepBest(1, metric, "max" if mode == "max" else "min")
    return best.keep([CheckpointInfo(i.step, i.metrics) for i in infos]) == frozenset({step})


def _error_text(error: BaseException) -> str:
    """``Type: message``; never raises (DCP's CheckpointException can fail to format itself)."""
    try:
        message = str(error)
    except Exception:
        try:
            message = repr(error)
        except Exception:
            message = "(the error could not be formatted)"
    return f"{type(error).__name__}: {message}"


def register_one(
    registrar: Registrar,
    info: CommitInfo,
    lock: Lock,
    *,
    check: bool = True,
    abandoned: Callable[[], bool] = lambda: False,
    retry: bool = False,
) -> str | None:
    """Register ``info`` and write the outcome into its record; the status, or None if nothing was done.

    ``check``: ask ``should_register`` first (a final info it declines leaves
    the record alone; a commit it declines is ``skipped``). Never raises for
    the registrar: any ``BaseException`` from it becomes ``failed``. Nothing is
    done for a checkpoint that is gone or was replaced by a re-save of its step.
    ``abandoned()`` true after ``register()`` returns: the outcome is not
    written (the caller gave up on it and marked it ``unfinished``). ``retry``:
    a failure is logged at INFO, as its first one was warned about.
    """
    current = _current_record(info)
    if current is None:
        logger.debug("safeckpt: step %d is gone; not registering it", info.step)
        return None
    info = dataclasses.replace(info, record=current)
    outcome: dict[str, Any]
    try:
        if check and not wants(registrar, info):
            if info.final:
                return None
            outcome = {"status": SKIPPED, "error": None}
        else:
            started = time.monotonic()
            result = registrar.register(info.step, info.path, current)
            outcome = dict(result or {})
            check_json_value(outcome, "the registrar's result")
            outcome.update(status=REGISTERED, error=None)
            logger.info("safeckpt: registered step %d in %.2f s", info.step, time.monotonic() - started)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        logger.log(
            logging.INFO if retry else logging.WARNING,
            "safeckpt: registering step %d failed (%s); the checkpoint itself is committed and "
            "safe. It is retried at the next commit, or run `safeckpt register %s`.",
            info.step,
            _error_text(e),
            info.root,
        )
        outcome = {"status": FAILED, "error": _error_text(e)}
    if abandoned():
        return None
    outcome["time"] = time.time()
    _attach_registrar(outcome, registrar)
    return outcome["status"] if _write_outcome(info, outcome, lock) else None


def _attach_registrar(outcome: dict[str, Any], registrar: Registrar) -> None:
    to_json = getattr(registrar, "to_json", None)
    if to_json is None:
        return
    try:
        data = dict(to_json())
        check_json_value(data, "the registrar's to_json()")
    except Exception as e:
        logger.warning("safeckpt: the registrar's to_json() failed (%s); not recorded", _error_text(e))
        return
    outcome["registrar"] = data


def _current_record(info: CommitInfo) -> Record | None:
    """The record at ``info.path`` if it is still the checkpoint ``info`` is about."""
    try:
        record = read_record(info._loc())
    except (IncompleteCheckpointError, OSError):
        return None
    if record is None or record.time != info.record.time or record.step != info.step:
        return None  # pruned, or replaced by a re-save of the same step
    return record


def _write_outcome(info: CommitInfo, outcome: dict[str, Any], lock: Lock) -> bool:
    try:
        with lock:
            # Re-checked under the lock: a prune or a re-save may have happened meanwhile.
            if _current_record(info) is None:
                return False
            amend_record(info._loc(), lock, registration=outcome)
            return True
    except (CheckpointError, OSError) as e:
        logger.warning("safeckpt: could not record the registration of step %d: %s", info.step, e)
        return False


class RegistrationWorker:
    """Runs a registrar on its own daemon thread, in commit order. Rank 0 only.

    Call rules: ``submit`` from any thread after each commit (it never blocks);
    ``close`` once, after the last submit. Failed (or unfinished) registrations
    of checkpoints still on disk, including those found in the root when the
    worker starts, are retried first, oldest first, each time a commit is
    submitted. Records are amended under ``lock``.
    """

    def __init__(
        self,
        registrar: Registrar,
        lock: Lock,
        root: Loc,
        *,
        timeout: float = 60.0,
    ) -> None:
        self.registrar = registrar
        self.root = root
        self.timeout = timeout
        self._lock = lock
        self._cond = threading.Condition()
        self._queue: deque[CommitInfo] = deque()
        self._current: CommitInfo | None = None
        self._current_since = 0.0  # monotonic time the current registration began
        self._failed: OrderedDict[tuple[int, float], CommitInfo] = OrderedDict()
        self._closing = False
        self._abandoned = False
        self._saw_commit = False
        self._thread = threading.Thread(target=self._run, name="safeckpt-registration", daemon=True)
        self._thread.start()

    def submit(self, info: CommitInfo) -> None:
        """Queue ``info``; returns at once. Ignored (with a warning) after ``close``."""
        with self._cond:
            if self._closing:
                logger.warning(
                    "safeckpt: registration of step %d submitted after close(); dropped", info.step
                )
                return
            self._queue.append(info)
            self._saw_commit = self._saw_commit or not info.final
            self._cond.notify_all()

    def pending_steps(self) -> frozenset[int]:
        """Steps whose registration is queued or running: retention keeps them until it ends.

        Empty once the running registration has taken longer than ``timeout``: a
        hung registrar cannot keep checkpoints forever (its registration is then
        likely to find its checkpoint pruned, and fails; ``safeckpt register``
        cannot bring a pruned one back).
        """
        with self._cond:
            if self._abandoned or self._closing:
                return frozenset()
            if self._current is not None and time.monotonic() - self._current_since > self.timeout:
                return frozenset()
            pending = [*self._queue, *([self._current] if self._current is not None else [])]
            return frozenset(info.step for info in pending if not info.final)

    @property
    def saw_commit(self) -> bool:
        """Whether a commit (not a final offer) was submitted: a manager that only read has none."""
        return self._saw_commit

    def close(self, timeout: float | None = None) -> None:
        """Wait at most ``timeout`` s (default: the constructor's) for queued registrations.

        What is still running or queued then is marked ``unfinished`` in its
        record (best effort) and is never written by this worker afterwards;
        the daemon thread is left to end on its own. Calls the registrar's
        ``close()`` when everything finished. Idempotent; never raises.
        """
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
            while self._queue or self._current is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            unfinished = [*([self._current] if self._current is not None else []), *self._queue]
            self._queue.clear()
            self._abandoned = bool(unfinished)
            self._cond.notify_all()
        if unfinished:
            self._mark_unfinished(unfinished, timeout)
            return
        self._thread.join(timeout=max(deadline - time.monotonic(), 0.1))
        close = getattr(self.registrar, "close", None)
        if close is not None:
            try:
                close()
            except BaseException as e:  # a registrar's close costs nothing else
                logger.warning("safeckpt: the registrar's close() failed: %s", _error_text(e))

    def _mark_unfinished(self, infos: list[CommitInfo], timeout: float) -> None:
        logger.warning(
            "safeckpt: %d registration(s) (step %s) did not finish within registration_timeout=%g s; "
            "their records say 'unfinished'. Run `safeckpt register %s` to register them.",
            len(infos),
            ", ".join(str(i.step) for i in infos),
            timeout,
            self.root,
        )
        lock = self.root.store.lock(timeout=_CLOSE_LOCK_TIMEOUT)
        budget = time.monotonic() + 2 * _CLOSE_LOCK_TIMEOUT  # marking is best effort: bounded too
        for info in infos:
            if time.monotonic() > budget:
                logger.warning("safeckpt: not marking the rest as unfinished: the sidecar lock is busy")
                return
            if info.final and self._registered_before(info):
                continue  # keep the commit's registration; the final one was a repeat
            outcome: dict[str, Any] = {
                "status": UNFINISHED,
                "error": f"did not finish within registration_timeout={timeout:g} s",
                "time": time.time(),
            }
            _attach_registrar(outcome, self.registrar)
            _write_outcome(info, outcome, lock)

    @staticmethod
    def _registered_before(info: CommitInfo) -> bool:
        record = _current_record(info)
        registration = record.registration if record is not None else None
        return isinstance(registration, Mapping) and registration.get("status") == REGISTERED

    # --- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        self._load_earlier_failures()
        while True:
            with self._cond:
                while not self._queue and not self._abandoned:
                    if self._closing:
                        return
                    self._cond.wait()
                if self._abandoned:
                    return
                info = self._queue.popleft()
                self._current = info
                self._current_since = time.monotonic()
            try:
                if not info.final:
                    self._retry_failed()
                self._process(info, check=True)
            except BaseException as e:  # the thread must outlive anything a registration does
                logger.warning("safeckpt: the registration of step %d failed: %s", info.step, _error_text(e))
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def _retry_failed(self) -> None:
        """Retry earlier failures, oldest first; stop at the first that fails again.

        A registry still down would fail them all: one attempt per commit
        bounds what an outage costs the registration thread.
        """
        for key, info in list(self._failed.items()):
            if self._abandoned:
                return
            logger.info("safeckpt: retrying the registration of step %d", info.step)
            del self._failed[key]
            if self._process(info, check=False, retry=True) == FAILED:
                self._failed.move_to_end(key, last=False)  # still the oldest
                return

    def _process(self, info: CommitInfo, *, check: bool, retry: bool = False) -> str | None:
        status = register_one(
            self.registrar,
            info,
            self._lock,
            check=check,
            abandoned=lambda: self._abandoned,
            retry=retry,
        )
        if status == FAILED:
            self._failed[(info.step, info.record.time)] = info
        return status

    def _load_earlier_failures(self) -> None:
        """Registrations that failed in an earlier run of this root: retried at the first commit."""
        try:
            catalog = scan(self.root)
        except OSError as e:
            logger.warning("safeckpt: could not look for failed registrations in %s: %s", self.root, e)
            return
        found = []
        for entry in catalog.entries:
            record = entry.record
            if not entry.committed or record is None or not isinstance(record.registration, Mapping):
                continue
            if record.registration.get("status") in RETRIED:
                found.append(CommitInfo.of(record.step, entry.path, record, self.root))
        for info in sorted(found, key=lambda i: i.record.time):
            self._failed.setdefault((info.step, info.record.time), info)
