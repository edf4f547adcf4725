"""Taking back a commit that must not count.

A node's part of a save that another node failed to commit: alone it is no
checkpoint, yet its commit moved ``latest`` to it; pruning refuses the step
``latest`` names, so the part goes to the trash here, the copy it replaced (if
any) back into its place, and ``latest`` to the newest commit.

A local commit its durable root has moved on past (:mod:`safeckpt._format.lineage`):
it must never be uploaded or restored, nor hold its step's name, but it is the
only copy of what its node trained, so it is set aside, not removed: into
``.damaged/`` with a note saying why, where nothing loads or prunes it, ``safeckpt
ls`` shows it and ``safeckpt gc`` removes it.
"""

from __future__ import annotations

from .._format.layout import Layout
from .._format.record import Record
from .._root.quarantine import move_into_damaged
from .._root.removal import to_trash
from .._root.startup import point_latest_at_newest
from .._store.base import Lock
from .._store.loc import Loc


def withdraw_checkpoint(layout: Layout, lock: Lock, step: int, *, held: Loc | None = None) -> bool:
    """Move ``step_<N>`` to the trash (the deleter removes it); put ``held``, the copy it replaced,
    back in its place; point ``latest`` at the newest commit. Whether ``held`` was put back.

    A crash in between leaves ``latest`` naming a step that is gone, which the next start
    repairs, or the old copy still held aside, which the next start settles
    (:func:`safeckpt._tiers.node_commits.settle_held`)."""
    target = layout.step_dir(step)
    put_back = False
    with lock:
        to_trash(layout, target, step)
        if held is not None and held.entry() is not None:
            layout.store.move(held.key, target.key)
            layout.store.sync(target.parent.key)
            put_back = True
        point_latest_at_newest(layout, lock)
    return put_back


def set_aside(layout: Layout, lock: Lock, directory: Loc, record: Record, reason: str) -> Loc | None:
    """Move the commit ``record`` describes out of ``directory`` into ``.damaged/``, with a note
    (``reason``, and ``"behind": true``); where it went, or None when the directory no longer holds
    that commit (nothing is moved then). Holds the sidecar lock."""
    return move_into_damaged(layout, lock, directory, record, {"reason": reason, "behind": True})
