"""Paths of a test's tmp_path as names in a local store (what the layers above the seam take)."""

from __future__ import annotations

from pathlib import Path

from safeckpt._posix.store import PosixStore
from safeckpt._store.loc import Loc


def loc(path: Path, ops: object = None) -> Loc:
    """``path`` as a name in the store of its parent directory (``ops``: its file operations)."""
    path = Path(path).absolute()
    return Loc(PosixStore(path.parent, ops), path.name)  # type: ignore[arg-type]


def root(path: Path, ops: object = None) -> Loc:
    """``path`` as the top of its own store."""
    return Loc(PosixStore(path, ops), "")  # type: ignore[arg-type]
