"""Taking back a commit that must not count: a node's part of a save that another node failed to
commit. Alone it is no checkpoint, yet its commit moved ``latest`` to it; pruning refuses the step
``latest`` names, so the part goes to the trash here, and ``latest`` back to the newest commit left."""

from __future__ import annotations

import contextlib

from .._format.layout import PRUNED, Layout
from .._store.base import Lock
from .startup import point_latest_at_newest


def withdraw_checkpoint(layout: Layout, lock: Lock, step: int) -> None:
    """Move ``step_<N>`` to the trash (the deleter removes it), then point ``latest`` at the newest
    commit left. A crash between the two leaves ``latest`` naming a step that is gone: the next
    start repairs it, as after any prune it catches."""
    with lock:
        layout.store.make_dir(layout.trash.key)
        with contextlib.suppress(FileNotFoundError):  # gone already
            layout.store.move(layout.step_dir(step).key, layout.new_trash_path(step, PRUNED).key)
        point_latest_at_newest(layout, lock)
