"""Whether a process of this host still runs: its pid, its start time, and not a zombie."""

from __future__ import annotations

import os


def process_start(pid: int) -> int | None:
    """The start time (clock ticks since boot) of ``pid``, to tell it from a later process with its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return not zombie(pid)
    # A killed process its parent has not waited for yet (a zombie) still answers kill(0),
    # but it can write nothing more: it is dead.
    return not zombie(pid)


def zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False
