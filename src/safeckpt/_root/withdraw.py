"""Taking back a commit that must not count: a node's part of a save that another node failed to
commit. Alone it is no checkpoint, yet its commit moved ``latest`` to it; pruning refuses the step
``latest`` names, so the part goes to the trash here, the copy it replaced (if any) back into its
place, and ``latest`` to the newest commit."""

from __future__ import annotations

from .._format.layout import Layout
from .._store.base import Lock
from .._store.loc import Loc
from .removal import to_trash
from .startup import point_latest_at_newest


def withdraw_checkpoint(layout: Layout, lock: Lock, step: int, *, held: Loc | None = None) -> bool:
    """Move ``step_<N>`` to the trash (the deleter removes it); put ``held``, the copy it replaced,
    back in its place; point ``latest`` at the newest commit. Whether ``held`` was put back.

    A crash in between leaves ``latest`` naming a step that is gone, which the next start
    repairs, or the old copy still held aside, which the next start settles
    (:func:`safeckpt._manager.node_commits.settle_held`)."""
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
