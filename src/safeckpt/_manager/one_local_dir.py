"""Several ranks with two tiers: every rank's ``local_dir`` must be the one directory rank 0 holds.

A local commit is made as a save to a shared root is: each rank writes its
own files into the save's staging directory, and rank 0 commits and uploads
the whole checkpoint. That holds when the ranks share the local disk (the
ranks of one node), not when each node has its own: rank 0 would commit a
checkpoint whose other ranks' files it cannot see. So at start rank 0 writes
a probe with a fresh token into its local directory, and every rank reads it
through its own; a rank that cannot is a :class:`ConfigError` on every rank.
"""

from __future__ import annotations

import contextlib
import uuid

from .._dist.participants import Participants
from .._store.base import Store
from ..errors import ConfigError

_PROBE = ".shared-probe.{token}"


def check_one_local_dir(store: Store, parts: Participants, *, read_only: bool) -> None:
    """Collective: raise the same :class:`ConfigError` on every rank unless all see rank 0's
    ``local_dir`` (``store``). A reader writes no probe; it needs none: a rank that cannot see a
    local copy fails its own files check, and every rank then loads the durable copy."""
    if not parts.distributed or read_only:
        return
    name = _PROBE.format(token=uuid.uuid4().hex[:12]) if parts.is_leader else None
    error: BaseException | None = None
    if parts.is_leader:
        assert name is not None
        try:
            store.make_dir("")
            store.write_atomic(name, name.encode())
        except OSError as e:
            error = e
    parts.agree(error, parts.control, what="writing a probe into local_dir")
    name = parts.broadcast(name, parts.control, what="the local_dir probe")
    try:
        seen = store.read_small(name, limit=64, what="probe") == name.encode()
    except OSError:
        seen = False
    sees = parts.gather(seen, parts.control, what="reading the local_dir probe")
    if parts.is_leader:
        with contextlib.suppress(OSError):
            store.remove(name)
    blind = [rank for rank, ok in enumerate(sees) if not ok]
    if blind:
        raise ConfigError(
            f"local_dir={store.where('')} is not the same directory on every rank: rank(s) "
            f"{', '.join(map(str, blind))} do not see what rank 0 wrote there. With several ranks, "
            "local_dir= must be one directory they all share (the ranks of one node, on its disk); "
            "a local tier on each node's own disk is not supported yet. Run one node, or save to the "
            "root directly (without local_dir=)."
        )
