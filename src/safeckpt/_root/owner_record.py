"""The owner record ``<root>/.owner``, and the evidence that its owner is alive or dead.

Evidence, never a guess (see :mod:`.ownership` for the protocol built on it):

* On the same machine as the owner (the same hostname, boot id and pid namespace, so
  neither a container on the same kernel nor a rebooted host is fooled), at once: a pid
  that is gone (or now another process's) is dead; a live pid whose heartbeat time, written
  by this same machine's clock, is within its promise is alive; one whose heartbeat is
  older (a paused process, or one that dropped its manager without closing it) is dead.
* On another machine, by watching: the owner rewrites its record every ``beat_every`` s,
  so a record that changes while it is watched names a live owner, and one that stays the
  same for the ``dead_after`` s its owner promised, measured on the watcher's own
  monotonic clock, names a dead one. No time written by another host is compared with
  this host's clock, so clock skew cannot make a live owner look dead.
"""

from __future__ import annotations

import enum
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from .._store.base import Store
from .._store.loc import Loc, as_root
from .._util.processes import machine, pid_alive, process_start
from ..errors import CheckpointError

OWNER_NAME = ".owner"
BEAT_EVERY = 5.0
"""How often an owner rewrites its record (its heartbeat)."""
DEAD_AFTER = 20.0
"""How long an owner's record may stay unchanged before a watcher takes it for dead: four
heartbeats, so a writer whose storage is slow for a few seconds keeps its root."""
_OLD_DEAD_AFTER = 120.0  # a record of a safeckpt before heartbeats were promised (beats every 10 s)
_LONGEST_PROMISE = 3600.0  # a record cannot make a watcher wait longer than this
_RECORD_LIMIT = 64 << 10


@dataclass(frozen=True)
class Owner:
    """Who holds a root's writes: the owner record, as written by its owner."""

    host: str
    pid: int
    token: str
    started: float
    heartbeat: float
    """The owner's wall-clock time at its last heartbeat: shown to people, never compared."""
    writing: bool
    pid_start: int | None = None
    boot_id: str | None = None
    pid_ns: str | None = None
    beat: int = 0
    """Heartbeats so far: the record changes at each, whatever the owner's clock says."""
    beat_every: float = BEAT_EVERY
    dead_after: float = DEAD_AFTER

    def on_this_machine(self) -> bool:
        """Whether the owner's pid means a process of this machine (see the module doc).

        A record of an older safeckpt (no boot id) is judged by hostname alone, as it was then.
        """
        host, boot, namespace = machine()
        if self.host != host:
            return False
        if self.boot_id is None:
            return True
        return self.boot_id == boot and self.pid_ns is not None and self.pid_ns == namespace

    def process_alive(self) -> bool:
        """On this machine: whether the owner's process still runs (its pid, started when it was)."""
        if not pid_alive(self.pid):
            return False
        current = process_start(self.pid)
        return self.pid_start is None or current is None or current == self.pid_start

    def alive(self) -> bool:
        """An instant answer: on this machine, whether the process runs; elsewhere True, since only
        watching the record can prove an owner dead there (:class:`OwnerWatch`)."""
        return self.process_alive() if self.on_this_machine() else True

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host}, since {since}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Owner:
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")

        def optional(name: str, kind: type) -> Any:
            value = data.get(name)
            return None if value is None else kind(value)

        return cls(
            host=str(data["host"]),
            pid=int(data["pid"]),
            token=str(data["token"]),
            started=float(data["started"]),
            heartbeat=float(data["heartbeat"]),
            writing=bool(data["writing"]),
            pid_start=optional("pid_start", int),
            boot_id=optional("boot_id", str),
            pid_ns=optional("pid_ns", str),
            beat=int(data.get("beat", 0)),
            beat_every=float(data.get("beat_every", BEAT_EVERY)),
            dead_after=min(max(float(data.get("dead_after", _OLD_DEAD_AFTER)), 0.1), _LONGEST_PROMISE),
        )


def read_owner_raw(root: Loc) -> bytes | None:
    """The owner record's bytes, or None where there is none. ``OSError`` if it cannot be read."""
    path = root / OWNER_NAME
    try:
        return path.store.read_small(path.key, limit=_RECORD_LIMIT, what="owner record")
    except FileNotFoundError:
        return None


def parse_owner(raw: bytes | None) -> Owner | None:
    if raw is None:
        return None
    try:
        return Owner.from_json(json.loads(raw))
    except (ValueError, TypeError, KeyError):
        return None


def read_owner(root: Loc | Store | str | os.PathLike[str]) -> Owner | None:
    """The owner record of ``root``, or None (none, or unreadable: then nobody can prove ownership)."""
    try:
        return parse_owner(read_owner_raw(as_root(root)))
    except (OSError, CheckpointError):
        return None


class Verdict(enum.Enum):
    FREE = "free"  # no owner record (or one nobody can read as one)
    OURS = "ours"
    ALIVE = "alive"
    DEAD = "dead"
    WATCHING = "watching"  # not proven either way yet: look again


@dataclass(frozen=True)
class Look:
    verdict: Verdict
    owner: Owner | None = None
    left: float = 0.0
    """While WATCHING: the seconds after which an unchanged record proves its owner dead."""


class OwnerWatch:
    """Evidence about one root's owner, gathered over successive looks (see the module doc).

    ``token``: this process's own claim (its record is OURS); ``same_process``: whether a
    record of this process's pid with another token belongs to a live claim of this process.
    """

    def __init__(self, root: Loc, *, token: str | None = None, live_token: Any = None) -> None:
        self._root = root
        self._token = token
        self._live_token = live_token  # token -> bool: a claim of this process still held
        self._seen: bytes | None = None
        self._since = 0.0

    def look(self) -> Look:
        """What the record says now. ``OSError`` if it cannot be read."""
        raw = read_owner_raw(self._root)
        owner = parse_owner(raw)
        if owner is None:
            return Look(Verdict.FREE)
        if owner.token == self._token:
            return Look(Verdict.OURS, owner)
        if owner.on_this_machine():
            if owner.pid == os.getpid() and self._live_token is not None:
                alive = bool(self._live_token(owner.token))  # a manager of this process, or one dropped
                return Look(Verdict.ALIVE if alive else Verdict.DEAD, owner)
            if not owner.process_alive():
                return Look(Verdict.DEAD, owner)
            # Its heartbeat's time was written by this machine's own clock: a fresh one proves it
            # alive at once; a stale one (a paused process, a manager dropped without close())
            # proves it has not beaten for its whole promise.
            stale = time.time() - owner.heartbeat > owner.dead_after
            return Look(Verdict.DEAD if stale else Verdict.ALIVE, owner)
        now = time.monotonic()
        if raw != self._seen:
            if self._seen is not None:
                return Look(Verdict.ALIVE, owner)  # it changed while watched: a heartbeat
            self._seen, self._since = raw, now
        left = owner.dead_after - (now - self._since)
        return Look(Verdict.DEAD, owner) if left <= 0 else Look(Verdict.WATCHING, owner, left)
