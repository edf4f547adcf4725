"""Real operating-system conditions (a pytest plugin, loaded by conftest.py).

* ``small_fs``: a factory, ``small_fs(size)``, mounting a fresh tmpfs of ``size``
  bytes (a disk that really fills up); unmounted at teardown.
* ``read_only_bind``: a factory, ``read_only_bind(path)``, bind-mounting
  ``path`` read-only over itself (a real read-only directory, for root too);
  unmounted at teardown.
* ``run_unprivileged``: runs ``python -c CODE ARGS...`` as root without
  ``CAP_DAC_OVERRIDE`` (``setpriv``), so file permissions apply to it as to any
  user: a directory without write permission refuses it with EACCES.

Each needs root (mount, setpriv); where that is missing the test is skipped
with the reason, and fails instead under CI=true, which must run it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fs_fixtures import in_ci


def _require(reason: str | None) -> None:
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"CI=true and this test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def _mount_problem() -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount"
    if shutil.which("mount") is None:
        return "no mount command"
    return None


def _unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    _require(_mount_problem())
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
        mounted.append(where)
        return where

    try:
        yield mount
    finally:
        for where in reversed(mounted):
            _unmount(where)


@pytest.fixture
def read_only_bind() -> Iterator[Callable[[Path], Path]]:
    _require(_mount_problem())
    mounted: list[Path] = []

    def bind(path: Path) -> Path:
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
        mounted.append(path)
        subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True)
        return path

    try:
        yield bind
    finally:
        for path in reversed(mounted):
            _unmount(path)


def fill(directory: Path) -> None:
    """Write into ``directory`` until its filesystem has no byte left."""
    with contextlib.suppress(OSError), open(directory / "filler", "wb") as f:
        while True:
            f.write(b"\0" * (64 << 10))
            f.flush()
    with contextlib.suppress(OSError), open(directory / "filler-tail", "wb") as f:
        while True:
            f.write(b"\0" * 512)
            f.flush()


@pytest.fixture
def run_unprivileged() -> Callable[..., subprocess.CompletedProcess[str]]:
    setpriv = shutil.which("setpriv")
    _require("needs root and setpriv (util-linux)" if os.geteuid() != 0 or setpriv is None else None)

    def run(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        dropped = "-dac_override,-dac_read_search"
        argv = [setpriv, f"--bounding-set={dropped}", f"--inh-caps={dropped}", "--", sys.executable]
        return subprocess.run(
            [*argv, "-c", code, *args], capture_output=True, text=True, timeout=timeout, check=False
        )

    return run
