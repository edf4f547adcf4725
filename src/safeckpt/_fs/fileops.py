"""The filesystem operations that change a checkpoint root, behind one seam.

Every mutation safeckpt makes to a root (apart from the tensor data DCP writes)
goes through a :class:`FileOps`, so tests hand in a subclass that injects faults
(an ``rmtree`` that raises ENOTEMPTY three times), records the lock state of each
call, or SIGKILLs the process at the N-th operation. Call rules: methods are
called from the training thread, the writer thread and the deleter thread; a
subclass must be thread-safe if it keeps state.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import time
from pathlib import Path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _load_renameat2():  # -> callable | None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


class FileOps:
    """Real filesystem operations. Subclass to inject faults; see the module doc."""

    def write_file(self, path: Path, data: bytes) -> None:
        """Create or truncate ``path``, write ``data`` and fsync the file.

        No directory fsync: the caller decides when the name must be durable.
        """
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_dir(self, path: Path) -> None:
        """Make the names in directory ``path`` durable (creations, renames, removals)."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        except OSError as e:
            # Some filesystems (certain FUSE and network mounts) refuse fsync on a
            # directory; their metadata operations are synchronous already.
            if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
                raise
        finally:
            os.close(fd)

    def replace(self, src: Path, dst: Path) -> None:
        """Atomically rename ``src`` to ``dst`` (``os.replace``); no fsync."""
        os.replace(src, dst)

    def exchange(self, a: Path, b: Path) -> None:
        """Atomically swap two existing paths (``renameat2(RENAME_EXCHANGE)``).

        Raises ``OSError(EINVAL/ENOSYS/ENOTSUP)`` where the filesystem or libc
        lacks it; the caller falls back to two renames.
        """
        if _renameat2 is None:
            raise OSError(errno.ENOSYS, "renameat2 is not available", str(a))
        rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(a), None, str(b))

    def link(self, src: Path, dst: Path) -> None:
        """Make ``dst`` a hard link of the existing file ``src`` (one inode, two names); no fsync.

        Raises ``OSError`` where the filesystem has no hard links (EPERM, ENOTSUP), across
        filesystems (EXDEV) or past its link count (EMLINK); the caller writes the file instead.
        """
        os.link(src, dst, follow_symlinks=False)

    def symlink(self, target: str, link: Path) -> None:
        """Create symlink ``link`` pointing at ``target`` (relative text)."""
        os.symlink(target, link)

    def rmtree(self, path: Path) -> None:
        """Remove a directory tree (or a lone file or link); errors propagate (the caller retries)."""
        if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
            os.unlink(path)
        else:
            shutil.rmtree(path)

    def sleep(self, seconds: float) -> None:
        """Wait between removal retries (a seam so tests can count the waits)."""
        time.sleep(seconds)


DEFAULT_FILE_OPS = FileOps()
