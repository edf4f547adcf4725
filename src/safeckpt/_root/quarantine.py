"""Moving a checkpoint that auto-resume found unloadable out of the run's way, kept for inspection.

A committed checkpoint whose bytes do not match its record would otherwise
stay the newest step: every restart would step over it again, and the next
``save()`` of an earlier step would be refused as going back. So the root's
owner moves it to ``.damaged/step_<N>.<token>`` with a ``damaged.json`` note
(why, when, which commit). From there it is never loaded, never pruned, shown
by ``safeckpt ls`` and removed by ``safeckpt gc``. ``latest`` is repaired to
the newest commit left (or removed when none is left).

Only the owner of the root moves anything (readers never change a root), under
the sidecar lock, and only if the directory still holds the very commit that
failed: a re-save that replaced it meanwhile is not touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

from .._format.identity import Fate, fate_of
from .._format.layout import DAMAGED_NOTE, Layout
from .._format.record import Record
from .._store.base import Lock
from .._store.loc import Loc
from .startup import point_latest_at_newest

logger = logging.getLogger(__name__)


def move_aside(layout: Layout, lock: Lock, directory: Loc, record: Record, reason: str) -> Loc | None:
    """Move the damaged checkpoint at ``directory`` into ``.damaged/``; where it went, or None when
    the directory no longer holds the commit ``record`` describes (nothing is moved then)."""
    target = move_into_damaged(layout, lock, directory, record, {"reason": reason})
    if target is None:
        return None
    logger.warning(
        "safeckpt: moved the unloadable step %d aside to %s: it is never loaded and no longer counts "
        "as the newest step. Inspect it there, or remove it with `safeckpt gc %s`.",
        record.step,
        target,
        layout.root,
    )
    return target


def move_into_damaged(
    layout: Layout, lock: Lock, directory: Loc, record: Record, note: dict[str, object]
) -> Loc | None:
    """The move itself, under the sidecar lock, if ``directory`` still holds ``record``'s commit:
    into ``.damaged/`` with a ``damaged.json`` (``note`` and which commit), then ``latest`` to the
    newest commit left. Where it went, or None."""
    with lock:
        if fate_of(directory, record) is not Fate.SAME:
            return None
        layout.check_private_dirs()
        store = layout.store
        store.make_dir(layout.damaged.key)
        target = layout.new_damaged_path(record.step)
        store.move(directory.key, target.key)
        store.sync(directory.parent.key)
        store.sync(layout.damaged.key)
        written = {"step": record.step, "seq": record.seq, "time": time.time(), **note}
        with contextlib.suppress(OSError):  # the move is what matters; the note only explains it
            store.write_atomic((target / DAMAGED_NOTE).key, (json.dumps(written, indent=2) + "\n").encode())
        point_latest_at_newest(layout, lock)
    return target
