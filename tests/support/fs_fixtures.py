"""Filesystem fixtures (a pytest plugin, loaded by conftest.py): local disk and emulated NFS.

* ``root_dir``: a fresh checkpoint root (not created yet), once on local disk
  (id ``local``) and once on the NFS-semantics FUSE filesystem (id ``nfs``,
  marked ``fuse``). A suite that takes it runs on both.
* ``nfs_mount``: a factory, ``nfs_mount(linger=..., ebusy_rmdir_next=...)``,
  mounting a fresh filesystem over tmp dirs; every mount is unmounted at
  teardown, also when the test failed.
* ``needs_fuse`` (and the ``fuse`` marker): a test that needs FUSE is skipped
  with the reason where FUSE is unavailable, and fails instead under CI=true,
  which must run it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from safeckpt.testing import Linger, NFSMount, NFSMountError, fuse_unavailable_reason, mount_nfs

ROOT_DIR_LINGER = Linger(seed=0, fast_max=0.05)
"""``.nfs`` files of the shared ``root_dir[nfs]`` mount go within 50 ms of their last close."""


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@functools.cache
def fuse_problem() -> str | None:
    """Why no NFS test filesystem can be mounted here (checked once per run), or None."""
    reason = fuse_unavailable_reason()
    if reason is not None:
        return reason
    with tempfile.TemporaryDirectory(prefix="safeckpt-fuse-probe-") as tmp:
        try:
            with mount_nfs(Path(tmp, "backing"), Path(tmp, "mnt")) as nfs:
                (nfs.path / "probe").write_bytes(b"ok")
        except (NFSMountError, OSError) as e:
            return f"mounting the NFS test filesystem failed: {e}"
    return None


def require_fuse() -> None:
    """Skip (or, under CI=true, fail) the calling test when FUSE cannot be used."""
    reason = fuse_problem()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"CI=true and the FUSE tests cannot run: {reason}", pytrace=False)
    pytest.skip(f"needs FUSE: {reason}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("fuse") is not None:
        require_fuse()


@pytest.fixture
def needs_fuse() -> None:
    """Skip the test where FUSE is unavailable; fail it under CI=true."""
    require_fuse()


def _files_open_under(mount: Path) -> list[int]:
    prefix = str(mount) + "/"
    fds = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").startswith(prefix):
                fds.append(int(name))
    return fds


def _release_open_roots(mount: Path) -> None:
    """Let go of files this process still has open under ``mount``, so it unmounts cleanly.

    A closed CheckpointManager keeps ``<root>/.lock`` open until its lock object
    is collected (lock.py), and a logged removal error's traceback can keep that
    object alive past the test. So: collect, and point what is still open at
    /dev/null (the fd number stays valid for its owner, which closes it later).
    """
    if not _files_open_under(mount):
        return
    gc.collect()  # ~0.4 s with torch loaded, so only when needed
    leftovers = _files_open_under(mount)
    if leftovers:
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for fd in leftovers:
                os.dup2(null, fd)
        finally:
            os.close(null)


@pytest.fixture
def nfs_mount(tmp_path: Path, needs_fuse: None) -> Iterator[Callable[..., NFSMount]]:
    """``nfs_mount(**mount_nfs_options) -> NFSMount``: a fresh NFS-semantics mount over tmp dirs."""
    with contextlib.ExitStack() as stack:
        count = 0

        def mount(**options: Any) -> NFSMount:
            nonlocal count
            count += 1
            base = tmp_path / f"nfs{count}"
            nfs = stack.enter_context(mount_nfs(base / "backing", base / "mnt", **options))
            stack.callback(_release_open_roots, nfs.path)  # runs before this mount's unmount
            return nfs

        yield mount


@pytest.fixture(scope="session")
def nfs_session_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NFSMount]:
    """One NFS-semantics mount shared by every ``root_dir[nfs]`` test of the run."""
    require_fuse()
    base = tmp_path_factory.mktemp("nfs-shared")
    with mount_nfs(base / "backing", base / "mnt", linger=ROOT_DIR_LINGER) as nfs:
        yield nfs
        _release_open_roots(nfs.path)


@pytest.fixture(params=["local", pytest.param("nfs", marks=pytest.mark.fuse)])
def root_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A fresh checkpoint root (not created yet) on local disk, and on emulated NFS."""
    if request.param == "local":
        return tmp_path / "ckpt"
    nfs: NFSMount = request.getfixturevalue("nfs_session_mount")
    base = nfs.path / tmp_path.name
    base.mkdir()
    return base / "ckpt"
