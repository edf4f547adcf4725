"""What the owner of a root does when it takes the root: recover, collect, repair.

Only the process that claimed the root (see :mod:`safeckpt._root.ownership`) runs
this, and only before its first save, so nothing here can be a live save of
its own, and no other live writer exists. Every change holds the sidecar lock.
A reader never runs it: resume does not need it (the catalog already sees a
displaced copy of an interrupted replacement, and ``latest`` only mirrors the
newest commit).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

from .._format.catalog import Catalog, scan
from .._format.layout import LATEST_NAME, Layout, step_dirname
from .._fs.atomic import clear_non_pointer, swap_pointer
from .._fs.fileops import FileOps
from .._fs.lock import SidecarLock
from .removal import collect_abandoned_staging, recover_interrupted_replacements

logger = logging.getLogger(__name__)

# Temp files of safeckpt's own atomic writes (``.<name>.tmp.<12 hex>``) and DCP's ``.metadata.tmp``:
# the only names orphan collection removes.
_ROOT_ORPHAN = re.compile(r"^\.(latest|owner)\.tmp\.[0-9a-f]{12}$")
_CHECKPOINT_ORPHAN = re.compile(r"^\..+\.tmp\.[0-9a-f]{12}$|^\.metadata\.tmp$")


def take_root(layout: Layout, lock: SidecarLock, ops: FileOps) -> Catalog:
    """Recover interrupted replacements, collect staging leftovers and orphans, repair ``latest``.

    Returns the catalog as it is afterwards. Each step that fails on the
    filesystem (an unwritable ``.trash``, a full disk) is warned about and left
    for the next start: collecting leftovers never keeps a job from training.
    """
    layout.check_private_dirs()
    with _or_warn(layout, "creating .staging and .trash"):
        layout.staging.mkdir(exist_ok=True)
        layout.trash.mkdir(exist_ok=True)
    with _or_warn(layout, "recovering an interrupted replacement"):
        recover_interrupted_replacements(layout, lock, ops)
    with _or_warn(layout, "collecting interrupted saves"):
        abandoned = collect_abandoned_staging(layout, lock, ops)
        if abandoned:
            logger.info("safeckpt: collecting %d interrupted save(s) from %s", len(abandoned), layout.root)
    catalog = scan(layout.root)
    with _or_warn(layout, "removing orphan temp files"):
        orphans = collect_orphans(catalog, lock)
        if orphans:
            logger.info("safeckpt: removed %d orphan temp file(s) from %s", len(orphans), layout.root)
    with _or_warn(layout, "repairing `latest`"):
        repair_latest(catalog, lock, ops)
    return scan(layout.root)


@contextlib.contextmanager
def _or_warn(layout: Layout, doing: str) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        logger.warning(
            "safeckpt: %s in %s failed (%s: %s); training goes on, and the next start tries again. "
            "Check the permissions and free space of the root.",
            doing,
            layout.root,
            type(e).__name__,
            e,
        )


def orphan_files(catalog: Catalog) -> list[Path]:
    """Temp files an interrupted write of safeckpt's own left (and only those)."""
    found = []
    with contextlib.suppress(OSError), os.scandir(catalog.layout.root) as entries:
        found += [Path(e.path) for e in entries if _ROOT_ORPHAN.match(e.name) and not e.is_dir()]
    for entry in catalog.entries:
        if entry.displaced or not entry.committed:
            continue
        with contextlib.suppress(OSError), os.scandir(entry.path) as files:
            found += [
                Path(f.path)
                for f in files
                if _CHECKPOINT_ORPHAN.match(f.name) and f.is_file(follow_symlinks=False)
            ]
    return sorted(found)


def collect_orphans(catalog: Catalog, lock: SidecarLock) -> list[Path]:
    removed = []
    with lock:
        for path in orphan_files(catalog):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    return removed


def repair_latest(catalog: Catalog, lock: SidecarLock, ops: FileOps) -> bool:
    """Point ``latest`` at the newest commit if it names anything else; whether it changed.

    Whatever sits at ``latest`` that is not a pointer (a directory, a FIFO) is
    moved aside to ``latest.not-a-pointer.<n>`` and kept.
    """
    newest = catalog.latest_step
    if newest is None or catalog.latest_name == step_dirname(newest):
        return False
    root = catalog.layout.root
    with lock:
        aside = root / f"{LATEST_NAME}.not-a-pointer.{os.getpid()}"
        if clear_non_pointer(catalog.layout.latest_path, aside):
            logger.warning(
                "safeckpt: %s was not a pointer; moved it to %s", catalog.layout.latest_path, aside
            )
        swap_pointer(catalog.layout.latest_path, step_dirname(newest), ops)
    logger.info(
        "safeckpt: `latest` in %s named %s; repaired to step %d, the newest commit",
        root,
        catalog.latest_name or "nothing",
        newest,
    )
    return True
