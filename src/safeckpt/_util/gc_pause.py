"""Python's cyclic garbage collector, paused while a save or a restore makes many small objects.

A restore of 10,000 tensors allocates hundreds of thousands of short-lived
objects (DCP's read items and sizes, views, buffers); every few hundred
allocations start a collection, and the full ones walk every object the
process holds, the model's and the training loop's included: paused, such a
restore takes far less time. What a save or a restore creates is
freed by reference counting; cyclic garbage made meanwhile waits for the next
collection after the pause.

Pauses nest and may overlap across threads (two managers restoring at once):
the collector runs again when the last one ends, if it ran before the first.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

__all__ = ["collector_paused"]

_lock = threading.Lock()
_pauses = 0
_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (a context manager, or a decorator)."""
    global _pauses, _was_enabled
    with _lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                gc.enable()


def _end_pauses_in_child() -> None:
    # A child forked by another thread during a pause has no one to end it.
    global _pauses, _lock
    _lock = threading.Lock()  # it may have been held by a thread the child does not have
    if _pauses and _was_enabled:
        gc.enable()
    _pauses = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_end_pauses_in_child)
