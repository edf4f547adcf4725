"""One writer per root: the owner record ``<root>/.owner``, under the sidecar lock.

The protocol (also in ``docs/format.md``):

* A manager's rank 0 *claims* the root when it opens it, if nobody else holds
  it: no owner record, an owner that is dead, or one that has not saved
  (``writing: false``). Only a claimant collects leftovers (staging, trash,
  orphans) and repairs ``latest``. Where a live owner is writing, the manager
  is a *reader*: it collects nothing and writes nothing, and can restore.
* The first ``save()`` (or ``pin``) makes the claim a writing one. If another
  live process is writing, it raises :class:`RootInUseError` within
  ``LIVE_OWNER_GRACE`` seconds (the grace covers an owner that is closing
  right then). It never touches that owner's staging or trash. Opening such a
  root warns, naming the owner.
* An owner is dead when it ran on this host and its process is gone (pid and
  process start time checked), or, from another host, when its heartbeat is
  older than ``stale_after``. The deleter thread refreshes the heartbeat.
  A dead owner is taken over with a warning.
* ``close()`` removes the record if it is still ours.

On NFS across hosts, liveness rests on the heartbeat alone: a host whose
clock runs far behind, or a job paused (SIGSTOP) for longer than
``stale_after``, can be taken for dead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
import weakref
from dataclasses import asdict, dataclass
from typing import Any

from .._store.base import Lock, Store
from .._store.loc import Loc, as_root
from .._util.processes import pid_alive, process_start
from ..errors import CheckpointError, RootInUseError

logger = logging.getLogger(__name__)

OWNER_NAME = ".owner"
HEARTBEAT_EVERY = 10.0
STALE_AFTER = 120.0
LIVE_OWNER_GRACE = 3.0
_POLL = 0.25


@dataclass(frozen=True)
class Owner:
    """Who holds a root's writes."""

    host: str
    pid: int
    token: str
    started: float
    heartbeat: float
    writing: bool
    pid_start: int | None = None

    def alive(self, *, stale_after: float = STALE_AFTER, now: float | None = None) -> bool:
        """Whether the owner still runs (see the module doc for how that is decided)."""
        if self.host == socket.gethostname():
            if not pid_alive(self.pid):
                return False
            current = process_start(self.pid)
            return self.pid_start is None or current is None or current == self.pid_start
        return (time.time() if now is None else now) - self.heartbeat < stale_after

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        age = max(0.0, time.time() - self.heartbeat)
        return f"pid {self.pid} on {self.host}, since {since}, last heartbeat {age:.0f} s ago"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Owner:
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        pid_start = data.get("pid_start")
        return cls(
            host=str(data["host"]),
            pid=int(data["pid"]),
            token=str(data["token"]),
            started=float(data["started"]),
            heartbeat=float(data["heartbeat"]),
            writing=bool(data["writing"]),
            pid_start=None if pid_start is None else int(pid_start),
        )


def read_owner(root: Loc | Store | str | os.PathLike[str]) -> Owner | None:
    """The owner record of ``root``, or None (none, or unreadable: then nobody can prove ownership)."""
    try:
        path = as_root(root) / OWNER_NAME
        raw = path.store.read_small(path.key, limit=64 << 10, what="owner record")
        return Owner.from_json(json.loads(raw))
    except (OSError, ValueError, TypeError, KeyError, CheckpointError):
        return None


# The claims of this process still held by a live Ownership object: an owner record with this
# process's pid but a token not in here belongs to a manager that was dropped without close().
_live_claims: weakref.WeakValueDictionary[str, Ownership] = weakref.WeakValueDictionary()


def _alive(owner: Owner, stale_after: float) -> bool:
    if owner.host == socket.gethostname() and owner.pid == os.getpid():
        return owner.token in _live_claims
    return owner.alive(stale_after=stale_after)


def in_use_error(root: Loc, owner: Owner | None) -> RootInUseError:
    """The error for a root that ``owner``, a live process, writes."""
    who = owner.describe() if owner is not None else "another process"
    if owner is not None and owner.pid == os.getpid() and owner.host == socket.gethostname():
        todo = "That is this process: close() the other CheckpointManager of this root first."
    else:
        todo = "Wait for that job to finish (or stop it), or give this run its own root."
    return RootInUseError(
        f"{root} is being written by {who}; a root has one writer at a time. {todo} "
        "Reading (restore, safeckpt.load, `safeckpt ls`) needs no ownership.",
        path=str(root),
        owner=None if owner is None else owner.to_json(),
    )


def live_writer(root: Loc, *, stale_after: float = STALE_AFTER) -> Owner | None:
    """The live process writing ``root`` (one that saved, and runs still), or None."""
    owner = read_owner(root)
    if owner is None or not owner.writing or not _alive(owner, stale_after):
        return None
    return owner


class Ownership:
    """This process's claim on one root. Every change holds the sidecar lock."""

    def __init__(self, root: Loc, lock: Lock, *, stale_after: float = STALE_AFTER):
        self._path = root / OWNER_NAME
        self._root = root
        self._lock = lock
        self._stale_after = stale_after
        self._token = uuid.uuid4().hex
        self._started = time.time()
        self._last_beat = 0.0
        self.claimed = False
        self.writing = False
        _live_claims[self._token] = self

    def _record(self, writing: bool) -> Owner:
        pid = os.getpid()
        return Owner(
            host=socket.gethostname(),
            pid=pid,
            token=self._token,
            started=self._started,
            heartbeat=time.time(),
            writing=writing,
            pid_start=process_start(pid),
        )

    def _write(self, owner: Owner) -> None:
        self._path.store.write_atomic(self._path.key, (json.dumps(owner.to_json()) + "\n").encode())
        self._last_beat = time.monotonic()

    def try_claim(self, *, writing: bool) -> bool:
        """Claim the root now if nobody else holds it (see the module doc); whether it is ours."""
        with self._lock:
            current = read_owner(self._root)
            other = current is not None and current.token != self._token
            live = other and current is not None and _alive(current, self._stale_after)
            if live and current is not None and (current.writing or not writing):
                return False  # a live writer, or a live claimant while we only open
            if current is not None and current.token != self._token and current.writing:
                logger.warning(
                    "safeckpt: taking over %s from a dead owner (%s)", self._root, current.describe()
                )
            self._write(self._record(writing))
            self.claimed = True
            self.writing = self.writing or writing
            return True

    def claim_for_writing(self, grace: float = LIVE_OWNER_GRACE) -> None:
        """Make this process the root's writer, or raise :class:`RootInUseError` after ``grace`` s.

        Only a live owner refuses a claim, and a live owner rarely ends within
        seconds: waiting longer would only stall training before the same error.
        """
        deadline = time.monotonic() + grace
        while not self.try_claim(writing=True):
            if time.monotonic() >= deadline:
                raise in_use_error(self._root, read_owner(self._root))
            time.sleep(_POLL)

    def still_ours(self) -> bool:
        current = read_owner(self._root)
        return current is not None and current.token == self._token

    def heartbeat(self) -> None:
        """Refresh the heartbeat if due and the root is still ours (from the deleter thread)."""
        if not self.claimed or time.monotonic() - self._last_beat < HEARTBEAT_EVERY:
            return
        try:
            with self._lock:
                if self.still_ours():
                    self._write(self._record(self.writing))
                else:
                    self.claimed = self.writing = False
        except OSError as e:  # a full disk or a removed root: the next save() says what it is
            logger.debug("safeckpt: could not refresh the heartbeat of %s: %s", self._root, e)

    def release(self) -> None:
        """Give the root up (at ``close()``), if it is still ours. Never raises ``OSError``.

        A record left behind (a root that became read-only) names a process
        that is gone, so the next opener takes the root over.
        """
        if not self.claimed:
            return
        try:
            with self._lock:
                if self.still_ours():
                    with contextlib.suppress(FileNotFoundError):
                        self._path.store.remove(self._path.key)
                        self._root.store.sync(self._root.key)
        except OSError as e:
            logger.warning(
                "safeckpt: could not remove the owner record %s (%s); the next job to open the root "
                "takes it over, as its owner is gone",
                self._path,
                e,
            )
        self.claimed = self.writing = False
