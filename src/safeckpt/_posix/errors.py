"""What an ``OSError`` on a local root means, in words, and what to do about it."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path


def _human_size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return path


def explain_error(root: Path, error: OSError) -> tuple[str, str]:
    """What an ``OSError`` on ``root`` means, in words, and what to do about it."""
    code = error.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = ""
        with contextlib.suppress(OSError):
            free = f" ({_human_size(shutil.disk_usage(_nearest_existing(root)).free)} free)"
        return f"the filesystem is full{free}", "free space there (or prune old checkpoints), then save again"
    if code == errno.EROFS:
        return "the filesystem is mounted read-only", (
            "mount it read-write, or pass read_only=True for a job that only restores"
        )
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied", (
            "give this user write access to the root and its parent, or pass read_only=True for a "
            "job that only restores"
        )
    if code in (errno.ENOTDIR, errno.EEXIST):
        blocker = _nearest_existing(root)
        return f"{blocker} is a file, not a directory", "choose a root whose parents are directories"
    if code == errno.ENOENT:
        return "a directory of it is missing (removed while the job ran?)", (
            "check that the filesystem is mounted and the root's parent exists"
        )
    return f"{type(error).__name__}: {error}", "check the filesystem and its permissions"
