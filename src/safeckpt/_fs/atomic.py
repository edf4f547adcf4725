"""Atomic writes, the ``latest`` pointer swap, and atomic directory replacement.

Guarantees, on a POSIX filesystem that honours fsync: after each function
returns, the change is durable and a reader saw either the old or the new
state, never a mix. No locking here: callers hold the sidecar lock where the
design asks for it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO

from ..errors import CheckpointError
from .fileops import FileOps
from .safe_open import read_small

# Filesystems without symlinks (some FUSE, SMB and object-store mounts) say so
# with one of these; ``latest`` then becomes a small file naming the directory.
_NO_SYMLINK = {errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}
# RENAME_EXCHANGE never legitimately fails with ENOTEMPTY or EEXIST: those come from
# a FUSE filesystem that drops the flag and attempts a plain rename.
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOTEMPTY, errno.EEXIST}


def _temp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp.{uuid.uuid4().hex[:12]}")


def atomic_write(path: Path, data: bytes, ops: FileOps) -> None:
    """Write ``data`` to ``path`` through a temp file: write, fsync, ``os.replace``, dir fsync."""
    tmp = _temp_sibling(path)
    try:
        ops.write_file(tmp, data)
        ops.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    ops.fsync_dir(path.parent)


def atomic_write_stream(path: Path, write: Callable[[IO[bytes]], object], ops: FileOps) -> None:
    """:func:`atomic_write` for data produced by ``write(file)`` (a ``torch.save`` of a 1 GiB
    checkpoint is not built in memory first): temp sibling, fsync, ``os.replace``, dir fsync."""
    tmp = _temp_sibling(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        ops.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    ops.fsync_dir(path.parent)


def swap_pointer(pointer: Path, target_name: str, ops: FileOps) -> None:
    """Point ``pointer`` at sibling ``target_name`` atomically (symlink, else a small file)."""
    tmp = _temp_sibling(pointer)
    try:
        ops.symlink(target_name, tmp)
    except OSError as e:
        if e.errno not in _NO_SYMLINK:
            raise
        atomic_write(pointer, (target_name + "\n").encode(), ops)
        return
    try:
        ops.replace(tmp, pointer)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    ops.fsync_dir(pointer.parent)


def read_pointer(pointer: Path) -> str | None:
    """The name ``pointer`` designates, or None when it is missing, unreadable or not a pointer.

    Only a symlink or a small regular file is a pointer; anything else (a
    directory, a FIFO) is treated as missing, never opened.
    """
    try:
        info = os.lstat(pointer)
    except OSError:
        return None
    if stat.S_ISLNK(info.st_mode):
        try:
            return os.readlink(pointer)
        except OSError:
            return None
    if not stat.S_ISREG(info.st_mode) or info.st_size > _POINTER_LIMIT:
        return None
    try:
        text = read_small(pointer, limit=_POINTER_LIMIT, what="pointer").decode("utf-8").strip()
    except (OSError, UnicodeDecodeError, CheckpointError):
        return None
    return text or None


_POINTER_LIMIT = 4096


def clear_non_pointer(pointer: Path, aside: Path) -> bool:
    """Move whatever sits at ``pointer`` out of the way if it is not a pointer (a directory, a FIFO).

    It is renamed to ``aside`` (kept, not deleted: it is not ours). Returns whether it moved.
    """
    try:
        info = os.lstat(pointer)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(info.st_mode) or stat.S_ISREG(info.st_mode):
        return False
    os.replace(pointer, aside)
    return True


def replace_dir(src: Path, dst: Path, displaced: Path, retired: Path, ops: FileOps) -> bool:
    """Move directory ``src`` to ``dst``; an existing ``dst`` ends up at ``retired``.

    With ``renameat2(RENAME_EXCHANGE)`` there is no instant without a complete
    ``dst``. Where the filesystem lacks it (NFS, FUSE), the old copy is renamed
    to ``displaced`` first and to ``retired`` once the new copy is in place; a
    crash between the renames leaves it at ``displaced``, a name start-up
    recovery knows to put back, and a failed rename puts it back at once.
    Returns whether a ``dst`` existed. Fsyncs the parents of ``dst`` and ``retired``.
    """
    if not os.path.lexists(dst):
        ops.replace(src, dst)
        ops.fsync_dir(dst.parent)
        return False
    try:
        ops.exchange(src, dst)
    except OSError as e:
        if e.errno not in _NO_EXCHANGE:
            raise
        ops.replace(dst, displaced)
        ops.fsync_dir(displaced.parent)
        try:
            ops.replace(src, dst)
        except BaseException:
            # Put the old copy back, so the step is not missing until the next start.
            with contextlib.suppress(OSError):
                ops.replace(displaced, dst)
            raise
        ops.replace(displaced, retired)
    else:
        ops.replace(src, retired)  # src now holds the old copy
    ops.fsync_dir(retired.parent)
    ops.fsync_dir(dst.parent)
    return True
