"""One writer per root: a writer claims the root before it restores, keeps it by a heartbeat,
and writes nothing once it has lost it.

The protocol (also in ``docs/format.md``, "One writer per root"):

* A writable manager's rank 0 claims the root in its constructor, before any
  restore: afterwards it owns the root, or it raised :class:`RootInUseError`
  naming the owner. Never a restore followed by a refused save. Only the owner
  collects leftovers (staging, trash, orphans) and repairs ``latest``.
* A claim takes the root when there is no owner record, or the owner is proven
  dead (:mod:`.owner_record`): on the same machine at once, by its pid; from
  elsewhere once its record has stayed the same for the ``dead_after`` seconds it
  promised, on the claimant's own monotonic clock (a live pid on this machine
  whose heartbeat, stamped by this machine's clock, is older than that promise,
  is dead too: a paused process, or a manager dropped without close()). A live
  owner is :class:`RootInUseError` at once (elsewhere: once its record is seen to
  change). While it waits, the claimant says so once, naming the owner and the
  time left.
* The owner's heartbeat thread rewrites the record every ``beat_every`` s while it
  is still its own.
* A writer that was paused (SIGSTOP, a frozen VM) or cut off long enough to be
  taken over finds out at its next write: every write under the root's lock goes
  through :class:`OwnedLock`, which checks, under the lock, that the record still
  names it, and raises :class:`RootInUseError` otherwise. It touches nothing of
  the new owner's.
* ``close()`` removes the record if it is still ours.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
import weakref
from types import TracebackType
from typing import Any

from .._store.base import Lock
from .._store.loc import Loc
from .._util.failure_log import FailureLog
from .._util.processes import machine, process_start
from ..errors import CheckpointError, RootInUseError
from . import owner_record
from .owner_record import OWNER_NAME, Owner, OwnerWatch, Verdict, read_owner, read_owner_raw

logger = logging.getLogger(__name__)

__all__ = ["OWNER_NAME", "OwnedLock", "Owner", "Ownership", "in_use_error", "live_writer", "read_owner"]

_POLL = 0.5

# The claims of this process still held by a live Ownership object: an owner record with this
# process's pid but a token not in here belongs to a manager that was dropped without close().
_live_claims: weakref.WeakValueDictionary[str, Ownership] = weakref.WeakValueDictionary()


def _held_here(token: str) -> bool:
    return token in _live_claims


def in_use_error(root: Loc, owner: Owner | None, *, lost: bool = False) -> RootInUseError:
    """The error for a root that ``owner``, a live process, writes (``lost``: it took the root
    over from this process while this process was paused or cut off)."""
    who = owner.describe() if owner is not None else "another process"
    if lost:
        what = (
            f"{root} was taken over by {who} while this job could not show it was alive (it was "
            "paused, or cut off from the storage, for longer than its heartbeat's promise); this "
            "process writes nothing more there, and nothing of the new owner's was touched."
        )
        todo = "Stop one of the two jobs; give each run its own root."
    else:
        what = f"{root} is being written by {who}; a root has one writer at a time."
        if owner is not None and owner.pid == os.getpid() and owner.on_this_machine():
            todo = "That is this process: close() the other CheckpointManager of this root first."
        else:
            todo = (
                "Wait for that job to finish (or stop it), give this run its own root, or pass "
                "read_only=True to only restore."
            )
    return RootInUseError(
        f"{what} {todo} Reading (restore with read_only=True, safeckpt.load, `safeckpt ls`) needs "
        "no ownership.",
        path=str(root),
        owner=None if owner is None else owner.to_json(),
    )


def live_writer(root: Loc, *, patience: float = 0.0) -> Owner | None:
    """The live process that owns ``root``, or None.

    An owner on another machine is watched for up to ``patience`` s (up to the ``dead_after`` it
    promised); one not proven dead by then counts as live. Unreadable: None.
    """
    watch = OwnerWatch(root, live_token=_held_here)
    deadline = time.monotonic() + patience
    said = False
    while True:
        try:
            look = watch.look()
        except (OSError, CheckpointError):
            return None
        if look.verdict in (Verdict.FREE, Verdict.DEAD):
            return None
        if look.verdict is Verdict.ALIVE or time.monotonic() >= deadline:
            return look.owner
        if not said:
            _say_waiting(root, look, min(look.left, deadline - time.monotonic()))
            said = True
        time.sleep(min(_POLL, look.left))


def _say_waiting(root: Loc, look: owner_record.Look, left: float) -> None:
    assert look.owner is not None
    logger.warning(
        "safeckpt: %s is owned by %s; waiting up to %.0f s to see whether it is alive (its record "
        "changes every %g s while it runs; if it does not, it is taken for dead).",
        root,
        look.owner.describe(),
        left,
        look.owner.beat_every,
    )


class Ownership:
    """This process's claim on one root. Every change holds the root's lock.

    Call rules: :meth:`claim` (from the training thread) before anything is written;
    :meth:`release` at ``close()``; the heartbeat runs on its own thread meanwhile.
    """

    def __init__(self, root: Loc, lock: Lock) -> None:
        self._path = root / OWNER_NAME
        self._root = root
        self._lock = lock  # the store's own lock: the checks of OwnedLock are made here by hand
        self._token = uuid.uuid4().hex
        self._started = time.time()
        self._beat = 0
        self._beat_every = owner_record.BEAT_EVERY  # read at each claim: tests shorten them
        self._dead_after = owner_record.DEAD_AFTER
        self._heart: threading.Thread | None = None
        self._beat_lock: Lock | None = None
        self._stop = threading.Event()
        self._failures = FailureLog(logger, f"the heartbeat of {root}")
        self.claimed = False
        self.lost_to: Owner | None = None
        _live_claims[self._token] = self

    @property
    def writing(self) -> bool:  # every claim is a writer's (kept for the callers that ask)
        return self.claimed

    @property
    def token(self) -> str:
        return self._token

    def _record(self) -> Owner:
        pid = os.getpid()
        host, boot, namespace = machine()
        self._beat += 1
        return Owner(
            host=host,
            pid=pid,
            token=self._token,
            started=self._started,
            heartbeat=time.time(),
            writing=True,
            pid_start=process_start(pid),
            boot_id=boot,
            pid_ns=namespace,
            beat=self._beat,
            beat_every=self._beat_every,
            dead_after=self._dead_after,
        )

    def _write(self) -> None:
        self._path.store.write_atomic(self._path.key, (json.dumps(self._record().to_json()) + "\n").encode())

    def claim(self) -> bool:
        """Own the root, or raise :class:`RootInUseError` naming its live owner (see the module doc).

        Returns whether the root was taken from someone (a dead owner), so the caller collects
        what it left. Waits while the owner's record has not yet shown it alive or dead; raises
        ``OSError`` when the root cannot be read or written.
        """
        self._beat_every = owner_record.BEAT_EVERY
        self._dead_after = owner_record.DEAD_AFTER
        watch = OwnerWatch(self._root, token=self._token, live_token=_held_here)
        said = False
        while True:
            look = watch.look()
            if look.verdict is Verdict.ALIVE:
                raise in_use_error(self._root, look.owner)
            if look.verdict is Verdict.WATCHING:
                if not said:
                    _say_waiting(self._root, look, look.left)
                    said = True
                time.sleep(min(_POLL, look.left))
                continue
            with self._lock:  # the verdict again, under the lock: of two claimants, one wins
                again = watch.look()
                if again.verdict is not look.verdict or again.owner != look.owner:
                    continue
                if look.verdict is Verdict.DEAD and look.owner is not None:
                    logger.warning(
                        "safeckpt: taking over %s from a dead owner (%s)", self._root, look.owner.describe()
                    )
                self._write()
                self.claimed, self.lost_to = True, None
            self._start_heart()
            return look.verdict is Verdict.DEAD

    def still_ours(self) -> bool:
        """Whether the record names this claim (``OSError`` if it cannot be read)."""
        owner = owner_record.parse_owner(read_owner_raw(self._root))
        return owner is not None and owner.token == self._token

    def check(self) -> None:
        """Under the lock, before a write: :class:`RootInUseError` unless the root is still ours."""
        if not self.claimed:
            if self.lost_to is not None:
                raise in_use_error(self._root, self.lost_to, lost=True)
            raise RootInUseError(
                f"this job does not hold {self._root} now (its owner record went away, with the root "
                "or by hand); nothing is written under it until its next save claims it again.",
                path=str(self._root),
            )
        owner = owner_record.parse_owner(read_owner_raw(self._root))
        if owner is not None and owner.token == self._token:
            return
        self._lose(owner)
        if owner is not None:
            raise in_use_error(self._root, owner, lost=True)
        raise RootInUseError(
            f"the owner record of {self._root} is gone (the root was removed, or the record deleted "
            "by hand) while this job held it; nothing is written under it until this job claims it "
            "again, which its next save() does.",
            path=str(self._root),
        )

    def _lose(self, owner: Owner | None) -> None:
        if self.claimed:
            self.claimed = False
            self.lost_to = owner
            self._stop.set()
            if owner is not None:
                logger.error(
                    "safeckpt: %s was taken over by %s; this job writes nothing more to it",
                    self._root,
                    owner.describe(),
                )

    def heartbeat(self) -> None:
        """Rewrite the record if it is still ours (the heartbeat thread, and tests).

        Its own handle on the lock, with a timeout of one beat: a lock held long (a commit, a
        `safeckpt` command) delays a beat, never the thread for the session's whole lock_timeout.
        """
        if self._beat_lock is None:
            self._beat_lock = self._root.store.lock(timeout=self._beat_every)
        with self._beat_lock:
            owner = owner_record.parse_owner(read_owner_raw(self._root))
            if owner is None or owner.token != self._token:
                self._lose(owner)
                return
            self._write()

    def _start_heart(self) -> None:
        if self._heart is not None and self._heart.is_alive() and not self._stop.is_set():
            return  # (a heart told to stop, still ending, is replaced: it ends on its own event)
        self._stop = threading.Event()
        self._heart = threading.Thread(
            target=_beat_while_held,
            args=(weakref.ref(self), self._stop, self._beat_every),
            name="safeckpt-heartbeat",
            daemon=True,
        )
        self._heart.start()

    def release(self) -> None:
        """Give the root up (at ``close()``), if it is still ours. Never raises ``OSError``.

        A record left behind (a root that became read-only) names a process that is gone, so the
        next opener takes the root over.
        """
        self._stop.set()
        _live_claims.pop(self._token, None)  # closed: a record left behind names a dead claim
        if self._heart is not None and self._heart is not threading.current_thread():
            # Bounded: a beat stuck on unreachable storage must not hold close() up. Whatever it
            # does after this is checked under the lock, so it cannot undo the release below.
            self._heart.join(timeout=self._beat_every)
        self._heart = None
        if not self.claimed:
            return
        try:
            with self._lock:
                if self.still_ours():
                    with contextlib.suppress(FileNotFoundError):
                        self._path.store.remove(self._path.key)
                        self._root.store.sync(self._root.key)
        except (OSError, CheckpointError) as e:
            logger.warning(
                "safeckpt: could not remove the owner record %s (%s); the next job to open the root "
                "takes it over, as its owner is gone",
                self._path,
                e,
            )
        self.claimed = False


def _beat_while_held(ref: weakref.ref[Ownership], stop: threading.Event, every: float) -> None:
    """The heartbeat thread: holds its Ownership weakly, so a manager dropped without close() is
    collected (and its claim then counts as dead), and the thread ends with it."""
    while not stop.wait(every):
        ownership = ref()
        if ownership is None:
            return
        try:
            ownership.heartbeat()
            ownership._failures.worked("heartbeat")
        except (OSError, CheckpointError) as e:  # a lock held long, the storage down: try again
            ownership._failures.failed("heartbeat", "could not refresh the owner record (%s); retrying", e)
        if not ownership.claimed:
            return
        del ownership


class OwnedLock:
    """The root's lock as its owner takes it: held, it also proves the root is still this
    process's (:meth:`Ownership.check`, once per outermost acquisition), so a writer that lost
    the root raises :class:`RootInUseError` instead of writing under a new owner's feet."""

    def __init__(self, lock: Lock, ownership: Ownership) -> None:
        self._lock = lock
        self._ownership = ownership
        self.path = getattr(lock, "path", None)
        self.timeout = lock.timeout

    def acquire(self) -> None:
        outermost = not self._lock.held()
        self._lock.__enter__()
        if not outermost:
            return
        try:
            self._ownership.check()
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise

    def release(self) -> None:
        self._lock.__exit__(None, None, None)

    def held(self) -> bool:
        return self._lock.held()

    def close(self) -> None:
        self._lock.close()

    def __enter__(self) -> OwnedLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lock, name)
