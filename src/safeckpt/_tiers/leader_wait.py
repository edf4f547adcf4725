"""Rank 0 waits for something that may outlast a collective's timeout; the other ranks wait with it.

The upload of a large checkpoint can take longer than the control group's
timeout, and ``wait(durable=True)``, ``close()`` and a start that uploads what
an earlier run left wait for it on rank 0 while the other ranks would sit in
the next collective. So rank 0 sends a heartbeat (a broadcast) several times
per timeout while it waits, and a last one when it is done; the other ranks
wait broadcast by broadcast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .._dist.participants import Participants, portable

T = TypeVar("T")


@dataclass(frozen=True)
class Heartbeat:
    """What a long wait on rank 0 calls every ``every`` seconds."""

    every: float
    send: Callable[[], None]


def on_leader(ranks: Participants, work: Callable[[Heartbeat], T], *, what: str) -> T | None:
    """Collective: rank 0's ``work(heartbeat)`` result (None on the other ranks, which raise what
    ``work`` raised on rank 0)."""
    every = max(0.05, min(5.0, ranks.timeout / 4))
    if not ranks.distributed:
        return work(Heartbeat(every, lambda: None))
    if not ranks.is_leader:
        while (beat := ranks.broadcast(None, ranks.control, what=what)) is False:
            pass
        _, failure = beat
        if failure is not None:
            raise failure
        return None
    error: BaseException | None = None
    try:
        return work(Heartbeat(every, lambda: ranks.broadcast(False, ranks.control, what=what)))
    except BaseException as e:
        error = e
        raise
    finally:
        ranks.broadcast(("done", portable(error)), ranks.control, what=what)
