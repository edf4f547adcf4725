"""A checkpoint root on a POSIX filesystem: the :class:`~safeckpt._store.Store` on ``_fs``.

Every change the fault tests reach goes through the root's
:class:`~safeckpt._fs.fileops.FileOps` (file writes, renames and exchanges, links,
tree removals, directory fsyncs); making a directory and removing a single file
(``remove`` of a record, the owner record) call the OS directly. Directory commits use
``renameat2(RENAME_EXCHANGE)`` where the filesystem has it (two renames and a
displaced copy where it has not: NFS, FUSE); small files are written through a
temp file, fsync, ``os.replace`` and a directory fsync; DCP's data files go
through ``O_DIRECT`` where the filesystem takes it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._fs.atomic import atomic_write, atomic_write_stream, read_pointer, replace_dir, swap_pointer
from .._fs.fileops import DEFAULT_FILE_OPS, FileOps
from .._fs.lock import SidecarLock
from .._fs.safe_open import RegularFile, read_small
from .._store.base import DIR, FILE, LINK, OTHER, Entry
from .._store.registry import LOCAL, register
from .errors import explain_error

LOCK_NAME = ".lock"


class PosixStore:
    """A root directory on a POSIX filesystem (see :mod:`safeckpt._store.base` for the contract)."""

    def __init__(self, root: str | os.PathLike[str], ops: FileOps | None = None) -> None:
        self.root = Path(root).absolute()
        self.ops = ops or DEFAULT_FILE_OPS
        self.url = str(self.root)
        self.small_reads_at_once = 1

    def __repr__(self) -> str:
        return f"PosixStore({str(self.root)!r})"

    def path(self, name: str = "") -> Path:
        """The path of ``name``; a name that would leave the root is a programming error."""
        if not name:
            return self.root
        parts = name.split("/")
        if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"not a name inside a root: {name!r}")
        return self.root.joinpath(*parts)

    def where(self, name: str = "") -> str:
        return str(self.path(name))

    # --- names ---------------------------------------------------------------

    def entries(self, name: str = "") -> list[Entry]:
        """What is in directory ``name``, by name; never through a link (a linked directory is empty)."""
        path = self.path(name)
        if os.path.islink(path):
            return []
        try:
            with os.scandir(path) as it:
                found = list(it)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for item in found:
            try:
                info = item.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed since the listing
                continue
            out.append(_entry(item.name, info, item.path))
        return sorted(out, key=lambda e: e.name)

    def entry(self, name: str) -> Entry | None:
        path = self.path(name)
        try:
            info = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return _entry(path.name, info, path)

    def make_dir(self, name: str) -> None:
        os.makedirs(self.path(name), exist_ok=True)

    def move(self, src: str, dst: str) -> None:
        self.ops.replace(self.path(src), self.path(dst))

    def commit_dir(self, staged: str, final: str, *, displaced: str, retired: str) -> bool:
        return replace_dir(
            self.path(staged), self.path(final), self.path(displaced), self.path(retired), self.ops
        )

    def remove(self, name: str) -> None:
        path = self.path(name)
        if stat.S_ISDIR(os.lstat(path).st_mode):
            self.ops.rmtree(path)  # the tree removal faults are injected into (and retried on NFS)
        else:
            os.unlink(path)

    def sync(self, name: str = "") -> None:
        self.ops.fsync_dir(self.path(name))

    # --- files -----------------------------------------------------------------

    def read_small(self, name: str, *, limit: int, what: str) -> bytes:
        return read_small(self.path(name), limit=limit, what=what)

    def open_read(self, name: str) -> RegularFile:
        return RegularFile.open(self.path(name))

    def write_atomic(self, name: str, data: bytes) -> None:
        atomic_write(self.path(name), data, self.ops)

    def write_new(self, name: str, data: bytes) -> None:
        self.ops.write_file(self.path(name), data)

    def write_stream(self, name: str, write: Callable[[Any], object]) -> None:
        atomic_write_stream(self.path(name), write, self.ops)

    def read_pointer(self, name: str) -> str | None:
        return read_pointer(self.path(name))

    def write_pointer(self, name: str, target: str) -> None:
        swap_pointer(self.path(name), target, self.ops)

    # --- checkpoints' bytes (DCP) ------------------------------------------------

    def dcp_writer(self, directory: str, *, direct_io: bool, dcp_own: bool, reuse: Any = None) -> Any:
        # torch and DCP only here and in the reads below: opening a root (`safeckpt ls`) needs neither
        from torch.distributed.checkpoint import FileSystemWriter

        from .._storage.writer import RawFileSystemWriter

        options: dict[str, Any] = dict(sync_files=True, single_file_per_rank=True, thread_count=1)
        if dcp_own:
            return FileSystemWriter(self.path(directory), **options)
        earlier = None if reuse is None else reuse.earlier_dir

        def share(file: Any) -> bool:
            assert earlier is not None
            return self._hard_link(f"{earlier}/{file.name}", f"{directory}/{file.name}", file.size)

        return RawFileSystemWriter(
            self.path(directory),
            direct_io=direct_io,
            reuse=reuse,
            share=share if earlier is not None else None,
            **options,
        )

    def _hard_link(self, src: str, dst: str, size: int) -> bool:
        """Make ``dst`` another name of the earlier checkpoint's file ``src`` (of ``size`` bytes);
        False where that cannot be (gone, another size, no hard links here): the caller writes it.

        The new name becomes durable with the directory fsync of the record's write, before the
        commit; the bytes are durable since the earlier commit. A hard link keeps each checkpoint
        whole: removing one name never takes the bytes another one has.
        """
        source = self.path(src)
        try:
            info = os.lstat(source)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                return False
            self.ops.link(source, self.path(dst))
        except OSError:
            return False
        return True

    def dcp_reader(
        self,
        directory: str,
        *,
        checksums: Mapping[str, Any] | None,
        step: int | None,
        direct_io: bool,
        dcp_own: bool,
        metadata: Callable[[], Any],
    ) -> Any:
        from .readers import PosixDcpOwnReader, PosixDcpReader

        reader = PosixDcpOwnReader if dcp_own else PosixDcpReader
        return reader(
            self.path(directory), checksums=checksums, step=step, direct_io=direct_io, metadata=metadata
        )

    def dcp_prefetch(self, directory: str, rank: int, *, direct_io: bool) -> Callable[[], None]:
        from .._storage.prefetch import prefetch

        return prefetch(self.path(directory), rank, direct_io=direct_io)

    # --- the root as a whole -------------------------------------------------------

    def lock(self, *, timeout: float) -> SidecarLock:
        return SidecarLock(self.path(LOCK_NAME), timeout=timeout)

    def explain_error(self, error: OSError) -> tuple[str, str]:
        return explain_error(self.root, error)

    def sleep(self, seconds: float) -> None:
        self.ops.sleep(seconds)

    def free_space(self) -> int | None:
        for candidate in (self.root, *self.root.parents):
            if os.path.lexists(candidate):
                try:
                    return shutil.disk_usage(candidate).free
                except OSError:
                    return None
        return None


def _entry(name: str, info: os.stat_result, path: str | Path) -> Entry:
    size = info.st_size if stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode) else 0
    target = ""
    if stat.S_ISLNK(info.st_mode):
        with contextlib.suppress(OSError):  # replaced since the stat: no target to tell
            target = os.readlink(path)
    return Entry(name, _kind(info.st_mode), size, target)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return LINK
    if stat.S_ISDIR(mode):
        return DIR
    if stat.S_ISREG(mode):
        return FILE
    return OTHER


register(LOCAL, PosixStore)
