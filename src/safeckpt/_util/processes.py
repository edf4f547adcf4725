"""Whether a process still runs, and whether a pid means the same process here as where it was read.

A pid says something only inside its own pid namespace on its own boot of its own kernel:
two containers on one kernel can share a hostname and a pid, and a rebooted host reuses
pids. :func:`machine` names that context, so a pid is trusted only where it matches.
"""

from __future__ import annotations

import functools
import os
import socket


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


@functools.cache
def boot_id() -> str | None:
    """This boot of this kernel (Linux's random boot id), or None where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def pid_namespace() -> str | None:
    """This process's pid namespace (``pid:[4026531836]``), or None where it cannot be read.
    Not cached: a forked child may have unshared it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def machine() -> tuple[str, str | None, str | None]:
    """Where a pid means this process table: the hostname, the boot id and the pid namespace."""
    return socket.gethostname(), boot_id(), pid_namespace()
