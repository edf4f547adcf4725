"""Saves in flight, by key: the one mechanism behind invariant 4.

A save is queued, then written, then reaches one terminal state (committed,
cancelled or failed); the first terminal state it is given is the one it keeps.
A removal that reaches a key decides on that key's saves in flight: a queued
one is cancelled and never written; one being written is marked, and its runner
removes what it wrote once its write ends, never during it.

The key is whatever names what a save writes: the manager keys by step, the
Lightning plugin by file path. An entry is a :class:`Flight` (the manager's
``SaveJob``, the plugin's file save); only the ledger changes its state, under
the ledger's lock. Call rules: whoever submits a save calls :meth:`add` before
handing it to its runner; the runner calls :meth:`start` when it picks it up and
:meth:`finish` when it ends, and sets ``done`` once it is through with it (the
:class:`~safeckpt._manager.background.BackgroundWriter` does). What a removal
removes (a file, a directory) is the caller's: the ledger only says when.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .background import CANCELLED, COMMITTED, FAILED, QUEUED, WRITING, SaveState

TERMINAL = (COMMITTED, CANCELLED, FAILED)


@dataclass(eq=False, kw_only=True)
class Flight:
    """The ledger's state of one save; read it freely, change it only through :class:`SaveLedger`.

    Once ``ended`` is true nothing changes any more, so a runner reads
    ``remove_after`` after :meth:`SaveLedger.finish` without the lock.
    """

    status: SaveState = QUEUED
    cancel_requested: bool = False
    """A cancellation that :meth:`SaveLedger.start` carries out (unless withdrawn first)."""
    remove_after: bool = False
    """A removal reached this save while it was being written: remove what it wrote once it ends."""
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    """Set by the runner once it is through with the save (the deferred removal included)."""

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL


K = TypeVar("K")
E = TypeVar("E", bound=Flight)


@dataclass(frozen=True)
class Removal(Generic[E]):
    """What :meth:`SaveLedger.remove` did to a key's saves in flight."""

    cancelled: tuple[E, ...]
    """Queued saves, cancelled: never written."""
    deferred: tuple[E, ...]
    """Saves being written, newly marked ``remove_after``."""
    writing: bool
    """A save of the key is being written: its runner removes the key after the write, so the
    caller must not remove it now (nor later: the runner does)."""


class SaveLedger(Generic[K, E]):
    """Queued and writing saves in submission order, each under a key; thread-safe.

    ``lock`` (reentrant) guards every entry's state; an owner that keeps more
    state beside the ledger may pass its own ``RLock`` and hold it around calls
    to make one decision over both.
    """

    def __init__(self, lock: threading.RLock | None = None) -> None:
        self.lock = lock if lock is not None else threading.RLock()
        self._flight: dict[E, K] = {}  # queued and writing, in submission order (dicts keep it)

    def add(self, key: K, entry: E) -> None:
        """``entry`` (queued, not yet handed to its runner) is in flight under ``key``."""
        with self.lock:
            self._flight[entry] = key

    def start(self, entry: E, *, cancel: bool | None = None) -> bool:
        """The runner picked ``entry`` up; whether to write it.

        False when it ended already (cancelled while queued) or is cancelled now:
        ``cancel``, or, when None, its ``cancel_requested``. True: it is being written.
        """
        with self.lock:
            if entry.ended:
                return False
            if entry.cancel_requested if cancel is None else cancel:
                self._end(entry, CANCELLED)
                return False
            entry.status = WRITING
            return True

    def finish(self, entry: E, status: SaveState, error: BaseException | None = None) -> bool:
        """``entry`` ended as ``status`` (with ``error``, if any); whether this call ended it.

        Only the first terminal state counts: a later one (a failure while cleaning
        up after a failure, say) changes nothing and returns False.
        """
        if status not in TERMINAL:
            raise ValueError(f"not a terminal state: {status!r}")
        with self.lock:
            if entry.ended:
                return False
            entry.error = error
            self._end(entry, status)
            return True

    def cancel(self, entry: E) -> bool:
        """Cancel ``entry`` now if it is still queued (it will never be written); whether it was."""
        with self.lock:
            if entry.status != QUEUED or entry not in self._flight:
                return False
            self._end(entry, CANCELLED)
            return True

    def cancel_queued(self, key: K) -> list[E]:
        """Cancel every queued save of ``key`` now; the ones cancelled, oldest first."""
        with self.lock:
            return [e for e in self.in_flight(key) if self.cancel(e)]

    def request_cancel(self, entry: E) -> bool:
        """Ask for ``entry`` to be cancelled when its runner starts it (for a cancellation
        several processes must agree on first); whether this call asked (it is queued and
        was not asked yet)."""
        with self.lock:
            if entry.status != QUEUED or entry.cancel_requested:
                return False
            entry.cancel_requested = True
            return True

    def withdraw_cancel(self, entry: E) -> None:
        """A cancellation asked for ``entry`` is no longer wanted (it has not started yet, or
        it makes no difference)."""
        with self.lock:
            entry.cancel_requested = False

    def remove(self, key: K) -> Removal[E]:
        """A removal reached ``key``: its queued saves are cancelled, and each one being written
        removes the key after its write ends (``remove_after``), never during it."""
        with self.lock:
            cancelled: list[E] = []
            deferred: list[E] = []
            writing = False
            for entry in self.in_flight(key):
                if entry.status == QUEUED:
                    self._end(entry, CANCELLED)
                    cancelled.append(entry)
                elif entry.status == WRITING:
                    writing = True
                    if not entry.remove_after:
                        entry.remove_after = True
                        deferred.append(entry)
            return Removal(tuple(cancelled), tuple(deferred), writing)

    def in_flight(self, key: K | None = None) -> list[E]:
        """The queued and writing saves (of ``key``, or all), oldest first."""
        with self.lock:
            if key is None:
                return list(self._flight)
            return [e for e, k in self._flight.items() if k == key]

    def keys(self) -> list[K]:
        """The keys with a save in flight, in the order of their oldest one."""
        with self.lock:
            return list(dict.fromkeys(self._flight.values()))

    def wait(self, key: K, timeout: float | None = None) -> bool:
        """Block until the saves of ``key`` in flight now are done (``done`` set); False if
        ``timeout`` (seconds, for all of them) ran out first. Call it where no new save of
        ``key`` is added meanwhile (the thread that adds them)."""
        pending = self.in_flight(key)
        if timeout is None:
            for entry in pending:
                entry.done.wait()
            return True
        deadline = time.monotonic() + timeout
        return all(entry.done.wait(max(0.0, deadline - time.monotonic())) for entry in pending)

    def _end(self, entry: E, status: SaveState) -> None:
        entry.status = status
        self._flight.pop(entry, None)
