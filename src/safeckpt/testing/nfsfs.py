"""The NFS-semantics passthrough filesystem: its configuration and the FUSE process.

Runs as its own process (``python nfsfs.py BACKING MOUNTPOINT --config JSON``, or
through :func:`safeckpt.testing.nfs.mount_nfs`), so a test's own file access
never waits on a filesystem that needs the test's GIL. This file imports only
the standard library and, lazily, ``mfusepy``: it runs as a plain script,
without importing ``safeckpt`` (and so torch), and starts in a fraction of a second.

What it emulates, on top of a passthrough of every operation to BACKING:

* silly rename: libfuse's high-level API already hides a file that is unlinked
  (or replaced by a rename) while some process holds it open: it renames it to
  ``.fuse_hiddenXXXXXXXXYYYYYYYY`` and unlinks that name at the last release. Here
  that name is stored as ``.nfs00000000XXXXXXXXYYYYYYYY`` in the same directory, so
  ``rmdir`` of the directory fails with ENOTEMPTY, as on an NFS client. As on
  Linux's NFS client, unlinking such a file while it is still open fails with
  EBUSY; FUSE's ``release`` is asynchronous, so a file closed a moment ago
  can still be hidden, like NFS's "deleted right after a write";
* linger: after the last close the ``.nfs`` file stays for a delay drawn per
  file from a seeded :class:`Linger` (a server that is slow to drop it); an
  ``unlink`` of it then fails with ENOENT while it is still listed, the race a
  client sees while its asynchronous removal is in flight;
* injected EBUSY on ``rmdir``: the next N calls, or each with a probability;
* no ``RENAME_EXCHANGE`` (or any rename flag): EINVAL, as on NFS.

Control, while mounted: one JSON object a line on stdin, one JSON reply a line
on stdout: ``{"op": "set", ...NFSConfig fields}``, ``{"op": "stats"}``,
``{"op": "wait_idle", "timeout": s}``. End of stdin (the parent went away)
ends the filesystem, and libfuse unmounts it: a killed test run leaves no mount behind.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import random
import signal
import sys
import threading
from typing import Any

logger = logging.getLogger("safeckpt.testing.nfsfs")

# Run as a script by path (the FUSE process imports no safeckpt), or imported from the package.
if __package__:
    from .nfs_model import HIDDEN_PREFIX, NFSConfig, SillyFiles, silly_name
else:  # pragma: no cover - the FUSE process
    # the same module, found beside this file when run by path
    from nfs_model import HIDDEN_PREFIX, NFSConfig, SillyFiles, silly_name  # type: ignore[import-not-found, no-redef]


def _make_operations(backing: str, config: NFSConfig) -> Any:
    """The mfusepy ``Operations`` of the filesystem (mfusepy is imported here, lazily)."""
    import mfusepy

    class NFSOperations(mfusepy.Operations):
        use_ns = True

        def __init__(self) -> None:
            self.root = os.path.realpath(backing)
            self.config = config
            self.silly = SillyFiles(config.linger)
            self._guard = threading.Lock()
            self._ebusy_next = config.ebusy_rmdir_next
            self._rng = random.Random(config.seed)
            self.counts = {"ebusy_injected": 0, "rmdir_enotempty": 0, "unlink_ebusy": 0, "unlink_enoent": 0}

        # --- control ---------------------------------------------------------

        def configure(self, changes: dict[str, Any]) -> None:
            with self._guard:
                self.config = self.config.updated(changes)
                if "ebusy_rmdir_next" in changes:
                    self._ebusy_next = self.config.ebusy_rmdir_next
                if "seed" in changes:
                    self._rng = random.Random(self.config.seed)
            if "linger" in changes:
                self.silly.set_linger(self.config.linger)

        def stats(self) -> dict[str, Any]:
            with self._guard:
                counts = dict(self.counts)
            return {**self.silly.snapshot(), **counts}

        def _count(self, name: str) -> None:
            with self._guard:
                self.counts[name] += 1

        # --- paths -------------------------------------------------------------

        def _real(self, path: str) -> str:
            head, _, name = path.rpartition("/")
            if name.startswith(HIDDEN_PREFIX):
                name = silly_name(name)
            return self.root + head + "/" + name if head else self.root + "/" + name

        # --- the NFS parts -----------------------------------------------------

        def unlink(self, path: str) -> int:
            real = self._real(path)
            if os.path.basename(path).startswith(HIDDEN_PREFIX):
                self.silly.closed(real)  # libfuse: the last close of a hidden file
                return 0
            state = self.silly.state(real)
            if state == SillyFiles.OPEN:
                self._count("unlink_ebusy")  # Linux's NFS client: a silly-renamed file in use
                raise mfusepy.FuseOSError(errno.EBUSY)
            if state == SillyFiles.LINGERING:
                self._count("unlink_enoent")  # its asynchronous removal is in flight
                raise mfusepy.FuseOSError(errno.ENOENT)
            os.unlink(real)
            return 0

        def rename(self, old: str, new: str) -> int:
            real_old, real_new = self._real(old), self._real(new)
            os.rename(real_old, real_new)
            if os.path.basename(new).startswith(HIDDEN_PREFIX):
                self.silly.added(real_new)  # unlinked or replaced while open: silly rename
            else:
                self.silly.moved(real_old, real_new)
            return 0

        def rmdir(self, path: str) -> int:
            with self._guard:
                inject = self._ebusy_next > 0 or (
                    self.config.ebusy_rmdir_prob > 0 and self._rng.random() < self.config.ebusy_rmdir_prob
                )
                if self._ebusy_next > 0:
                    self._ebusy_next -= 1
                if inject:
                    self.counts["ebusy_injected"] += 1
            if inject:
                raise mfusepy.FuseOSError(errno.EBUSY)
            try:
                os.rmdir(self._real(path))
            except OSError as e:
                if e.errno == errno.ENOTEMPTY:
                    self._count("rmdir_enotempty")
                raise
            return 0

        # --- plain passthrough --------------------------------------------------

        def init_with_config(self, conn_info: Any, config_3: Any) -> None:
            if config_3 is not None:
                # No kernel caching of names or attributes: a .nfs file the reaper
                # removes behind the kernel's back must not be seen as still there.
                config_3.entry_timeout = 0.0
                config_3.attr_timeout = 0.0
                config_3.negative_timeout = 0.0
                config_3.hard_remove = 0  # keep libfuse's hiding of unlinked-but-open files

        def destroy(self, path: str) -> None:
            self.silly.reap_all()

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = os.fstat(fh) if fh is not None else os.lstat(self._real(path))
            return {
                "st_mode": st.st_mode,
                "st_nlink": st.st_nlink,
                "st_size": st.st_size,
                "st_uid": st.st_uid,
                "st_gid": st.st_gid,
                "st_blocks": st.st_blocks,
                "st_atime": st.st_atime_ns,
                "st_mtime": st.st_mtime_ns,
                "st_ctime": st.st_ctime_ns,
            }

        def access(self, path: str, amode: int) -> int:
            if not os.access(self._real(path), amode, follow_symlinks=False):
                raise mfusepy.FuseOSError(errno.EACCES)
            return 0

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._real(path))]

        def readlink(self, path: str) -> str:
            return os.readlink(self._real(path))

        def mkdir(self, path: str, mode: int) -> int:
            os.mkdir(self._real(path), mode)
            return 0

        def symlink(self, target: str, source: str) -> int:
            os.symlink(source, self._real(target))
            return 0

        def link(self, target: str, source: str) -> int:
            os.link(self._real(source), self._real(target))
            return 0

        def chmod(self, path: str, mode: int) -> int:
            os.chmod(self._real(path), mode)
            return 0

        def chown(self, path: str, uid: int, gid: int) -> int:
            os.lchown(self._real(path), uid, gid)
            return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            if times is None:
                os.utime(self._real(path), follow_symlinks=False)
            else:
                os.utime(self._real(path), ns=(int(times[0]), int(times[1])), follow_symlinks=False)
            return 0

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(self._real(path), length)
            return 0

        def open(self, path: str, flags: int) -> int:
            return os.open(self._real(path), flags)

        def create(self, path: str, mode: int, flags: int = os.O_WRONLY) -> int:
            return os.open(self._real(path), flags | os.O_CREAT, mode)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            return os.pwrite(fh, data, offset)

        def flush(self, path: str, fh: int) -> int:
            return 0

        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            if datasync:
                os.fdatasync(fh)
            else:
                os.fsync(fh)
            return 0

        def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
            return 0  # the backing directory's metadata is written through at once

        def statfs(self, path: str) -> dict[str, int]:
            sv = os.statvfs(self.root)
            keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree")
            return {key: getattr(sv, key) for key in keys} | {"f_namemax": sv.f_namemax}

    return NFSOperations()


def _serve_control(ops: Any, mountpoint: str) -> None:
    """Answer control requests on stdin; on its end, unmount (the parent is gone)."""
    for line in sys.stdin:
        try:
            request = json.loads(line)
            op = request.pop("op")
            if op == "set":
                ops.configure(request)
                reply: dict[str, Any] = {"ok": True}
            elif op == "stats":
                reply = {"ok": True, "stats": ops.stats()}
            elif op == "wait_idle":
                idle = ops.silly.wait_idle(float(request.get("timeout", 30.0)))
                reply = {"ok": True, "idle": idle, "stats": ops.stats()}
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as e:  # a bad request must not end the filesystem
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    # libfuse's SIGTERM handler ends the session loop, and fuse_main then unmounts.
    _stopping.set()
    os.kill(os.getpid(), signal.SIGTERM)


_stopping = threading.Event()


def serve(backing: str, mountpoint: str, config: NFSConfig) -> None:
    """Mount and serve until unmounted (blocks). Needs libfuse3 and ``mfusepy``."""
    import mfusepy

    class _FUSE(mfusepy.FUSE):
        # mfusepy drops rename flags; NFS has no RENAME_EXCHANGE or RENAME_NOREPLACE.
        def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
            if flags:
                return -errno.EINVAL
            return self.rename_fuse_2(old, new)

    ops = _make_operations(backing, config)
    threading.Thread(target=_serve_control, args=(ops, mountpoint), name="nfs-control", daemon=True).start()
    try:
        _FUSE(ops, mountpoint, foreground=True, fsname="safeckpt-nfs", subtype="safeckpt-nfs")
    except RuntimeError:
        if not _stopping.is_set():  # libfuse reports the loop ended by our SIGTERM as an error
            raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Mount BACKING at MOUNTPOINT with NFS file semantics.")
    parser.add_argument("backing")
    parser.add_argument("mountpoint")
    parser.add_argument("--config", default="{}", help="NFSConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    serve(args.backing, args.mountpoint, NFSConfig.from_json(json.loads(args.config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
