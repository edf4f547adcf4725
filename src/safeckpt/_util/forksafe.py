"""The process-wide hooks safeckpt needs, installed only once it has something to protect.

Importing safeckpt changes no global state. A cache or pool that would be wrong
in a forked child (a lock held by a thread the child lacks, buffers it does not
have) registers its reset with :func:`reset_in_child` the first time it holds
something; the gloo groups of a manager that was never closed are released by
an exit hook installed with the first such group (:func:`at_exit`).
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable

_installed: set[Callable[[], None]] = set()
_guard = threading.Lock()


def reset_in_child(hook: Callable[[], None]) -> None:
    """Run ``hook`` in every child this process forks from now on (once per hook)."""
    if hook in _installed:
        return
    with _guard:
        if hook not in _installed and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=hook)
            _installed.add(hook)


def at_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` when the interpreter exits (once per hook)."""
    if hook in _installed:
        return
    with _guard:
        if hook not in _installed:
            atexit.register(hook)
            _installed.add(hook)
