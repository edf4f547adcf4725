"""Mount the NFS-semantics test filesystem (see :mod:`safeckpt.testing.nfsfs`) for a test.

``mount_nfs(backing, mountpoint, ...)`` starts the filesystem in its own process,
waits until the mount is there, and always unmounts (``fusermount3 -u``, then a
lazy ``-uz`` and a kill), even when the body raised. Requires /dev/fuse,
``fusermount3`` (Debian's ``fuse3``) and ``mfusepy``; :func:`fuse_unavailable_reason`
says which is missing.

    with mount_nfs(tmp / "backing", tmp / "mnt", linger=Linger.constant(0.2)) as nfs:
        ...  # use nfs.path; nfs.stats(), nfs.configure(ebusy_rmdir_next=2)

Also ``python -m safeckpt.testing BACKING MOUNTPOINT --config JSON`` serves in the
foreground (stop it with ``fusermount3 -u MOUNTPOINT`` or by closing its stdin).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import nfsfs
from .nfs_model import Linger, NFSConfig

MOUNT_TIMEOUT = 15.0
"""How long a mount may take to appear (a loaded CI machine starts Python slowly)."""


class NFSMountError(RuntimeError):
    """The test filesystem did not mount, or could not be unmounted; the message says why."""


def fuse_unavailable_reason() -> str | None:
    """Why the NFS test filesystem cannot run here, or None when its prerequisites are there.

    Checks /dev/fuse, ``fusermount3`` and an importable ``mfusepy`` (which loads
    libfuse3); a mount can still fail (e.g. in a container without the FUSE
    capability), which :func:`mount_nfs` reports.
    """
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (no FUSE in this kernel or container)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (`make system-deps` installs Debian's fuse3)"
    if importlib.util.find_spec("mfusepy") is None:
        return "mfusepy is not installed (pip install -e '.[test]')"
    probe = subprocess.run(
        [sys.executable, "-c", "import mfusepy"], capture_output=True, text=True, timeout=60, check=False
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"mfusepy cannot load libfuse3 ({last}); `make system-deps` installs libfuse3-3"
    return None


def is_mounted(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a mount point, per /proc/self/mounts.

    Unlike ``os.path.ismount`` this also sees a mount whose process died
    ("Transport endpoint is not connected"), which must still be unmounted.
    """
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return os.path.ismount(target)
    for line in lines:
        fields = line.split()
        if len(fields) > 1 and _unescape(fields[1]) == target:
            return True
    return False


def _unescape(field: str) -> str:
    """Undo /proc/self/mounts' octal escapes (a space is ``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


class NFSMount:
    """A mounted NFS-semantics filesystem: its paths and its control channel.

    Call rules: methods from any thread of the test process (requests are
    serialised); only while mounted.
    """

    def __init__(self, backing: Path, path: Path, config: NFSConfig, process: subprocess.Popen[str]) -> None:
        self.backing = backing
        self.path = path
        self.config = config
        self.process = process
        self._io = threading.Lock()

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._io:
            stdin, stdout = self.process.stdin, self.process.stdout
            if stdin is None or stdout is None or self.process.poll() is not None:
                raise NFSMountError(f"the NFS test filesystem at {self.path} is not running")
            stdin.write(json.dumps(request) + "\n")
            stdin.flush()
            line = stdout.readline()
        if not line:
            raise NFSMountError(f"the NFS test filesystem at {self.path} exited while answering {request}")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise NFSMountError(f"the NFS test filesystem refused {request}: {reply.get('error')}")
        return reply

    def configure(self, **changes: Any) -> None:
        """Change :class:`NFSConfig` fields now, e.g. ``configure(ebusy_rmdir_next=3)``.

        A new ``linger`` restarts its seeded stream of draws.
        """
        payload = {k: (dataclasses.asdict(v) if isinstance(v, Linger) else v) for k, v in changes.items()}
        self.config = self.config.updated(payload)  # validates before the process sees it
        self._request({"op": "set", **payload})

    def stats(self) -> dict[str, Any]:
        """Counters since the mount: ``silly_renames``, ``open``, ``lingering``, ``reaped``,
        ``lingers`` (each drawn delay), ``silly_paths`` (backing paths of the ``.nfs``
        files now), ``ebusy_injected``, ``rmdir_enotempty``, ``unlink_ebusy``, ``unlink_enoent``."""
        stats: dict[str, Any] = self._request({"op": "stats"})["stats"]
        return stats

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until no ``.nfs`` file is open or lingering; whether that happened in ``timeout`` s."""
        return bool(self._request({"op": "wait_idle", "timeout": timeout})["idle"])

    def silly_files(self) -> list[Path]:
        """The ``.nfs`` files there are now, as paths under the mount point."""
        root = os.path.realpath(self.backing)
        return [self.path / os.path.relpath(p, root) for p in self.stats()["silly_paths"]]


@contextlib.contextmanager
def mount_nfs(
    backing: str | os.PathLike[str],
    mountpoint: str | os.PathLike[str],
    *,
    linger: Linger | float = 0.0,
    ebusy_rmdir_next: int = 0,
    ebusy_rmdir_prob: float = 0.0,
    seed: int = 0,
    timeout: float = MOUNT_TIMEOUT,
) -> Iterator[NFSMount]:
    """Mount ``backing`` at ``mountpoint`` (both created if missing) with NFS semantics.

    ``linger``: a :class:`Linger`, or seconds for a constant one. Raises
    :class:`NFSMountError` with the filesystem's stderr when the mount does not
    appear within ``timeout`` s. Unmounts on exit, whatever happened in the body.
    """
    config = NFSConfig(
        linger=linger if isinstance(linger, Linger) else Linger.constant(float(linger)),
        ebusy_rmdir_next=ebusy_rmdir_next,
        ebusy_rmdir_prob=ebusy_rmdir_prob,
        seed=seed,
    )
    backing_path, mount_path = Path(backing).absolute(), Path(mountpoint).absolute()
    backing_path.mkdir(parents=True, exist_ok=True)
    mount_path.mkdir(parents=True, exist_ok=True)
    if is_mounted(mount_path):
        raise NFSMountError(f"{mount_path} is already a mount point; unmount it first (fusermount3 -u)")
    with tempfile.TemporaryFile("w+", prefix="safeckpt-nfs-stderr-") as stderr:
        command = [sys.executable, nfsfs.__file__, str(backing_path), str(mount_path)]
        process = subprocess.Popen(
            [*command, "--config", json.dumps(config.to_json())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,  # a Ctrl-C of the test run reaches the test, not the filesystem first
        )
        try:
            _wait_mounted(mount_path, process, stderr, timeout)
        except BaseException:
            _kill(process)
            _unmount(mount_path, process, stderr)
            raise
        try:
            yield NFSMount(backing_path, mount_path, config, process)
        finally:
            _unmount(mount_path, process, stderr)


def _stderr_text(stderr: Any) -> str:
    stderr.flush()
    stderr.seek(0)
    text = str(stderr.read()).strip()
    return text[-4000:] if text else "(nothing on stderr)"


def _wait_mounted(mount_path: Path, process: subprocess.Popen[str], stderr: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.ismount(mount_path):
        if process.poll() is not None:
            raise NFSMountError(
                f"the NFS test filesystem exited with status {process.returncode} before mounting "
                f"{mount_path}; its stderr:\n{_stderr_text(stderr)}"
            )
        if time.monotonic() > deadline:
            raise NFSMountError(
                f"the NFS test filesystem did not mount {mount_path} within {timeout:.0f} s; "
                f"its stderr:\n{_stderr_text(stderr)}"
            )
        time.sleep(0.02)


def _kill(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def _fusermount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["fusermount3", *args], capture_output=True, text=True, timeout=30, check=False)


def _unmount(mount_path: Path, process: subprocess.Popen[str], stderr: Any) -> None:
    """Unmount for sure: ``-u``; when busy, a lazy ``-uz``; then end the process."""
    problems = []
    if is_mounted(mount_path):
        for _ in range(20):  # FUSE releases are asynchronous: a file closed just now may still count
            done = _fusermount("-u", str(mount_path))
            if done.returncode == 0 or not is_mounted(mount_path):
                break
            time.sleep(0.05)
        else:
            problems.append(f"fusermount3 -u: {done.stderr.strip()}")
            lazy = _fusermount("-u", "-z", str(mount_path))
            if lazy.returncode != 0 and is_mounted(mount_path):
                problems.append(f"fusermount3 -uz: {lazy.stderr.strip()}")
    with contextlib.suppress(OSError):
        if process.stdin is not None:
            process.stdin.close()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        _kill(process)
        problems.append("the filesystem process did not exit after the unmount and was killed")
    if process.stdout is not None:
        process.stdout.close()
    if is_mounted(mount_path):
        raise NFSMountError(
            f"could not unmount {mount_path} ({'; '.join(problems)}); run `fusermount3 -uz {mount_path}`. "
            f"The filesystem's stderr:\n{_stderr_text(stderr)}"
        )
