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
from collections.abc import Callable, Iterator

from .._format.catalog import Catalog, scan
from .._format.layout import LATEST_NAME, Layout, step_dirname
from .._store.base import DIR, FILE, LINK, Lock
from .._store.loc import Loc
from .removal import collect_abandoned_staging, recover_interrupted_replacements

logger = logging.getLogger(__name__)

# Temp files of safeckpt's own atomic writes (``.<name>.tmp.<12 hex>``) and DCP's ``.metadata.tmp``:
# the only names orphan collection removes.
_ROOT_ORPHAN = re.compile(r"^\.(latest|owner)\.tmp\.[0-9a-f]{12}$")
_CHECKPOINT_ORPHAN = re.compile(r"^\..+\.tmp\.[0-9a-f]{12}$|^\.metadata\.tmp$")


def take_root(layout: Layout, lock: Lock, *, keep: Callable[[str], bool] | None = None) -> Catalog:
    """Recover interrupted replacements, collect staging leftovers and orphans, repair ``latest``.

    ``keep``: staging names in use (see :func:`collect_abandoned_staging`). Returns the catalog as
    it is afterwards. Each step that fails on the
    filesystem (an unwritable ``.trash``, a full disk) is warned about and left
    for the next start: collecting leftovers never keeps a job from training.
    """
    layout.check_private_dirs()
    with _or_warn(layout, "creating .staging and .trash"):
        layout.store.make_dir(layout.staging.key)
        layout.store.make_dir(layout.trash.key)
    with _or_warn(layout, "recovering an interrupted replacement"):
        recover_interrupted_replacements(layout, lock)
    with _or_warn(layout, "collecting interrupted saves"):
        abandoned = collect_abandoned_staging(layout, lock, keep=keep)
        if abandoned:
            logger.info("safeckpt: collecting %d interrupted save(s) from %s", len(abandoned), layout.root)
    catalog = scan(layout.root)
    with _or_warn(layout, "removing orphan temp files"):
        orphans = collect_orphans(catalog, lock)
        if orphans:
            logger.info("safeckpt: removed %d orphan temp file(s) from %s", len(orphans), layout.root)
    with _or_warn(layout, "repairing `latest`"):
        repair_latest(catalog, lock)
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


def orphan_files(catalog: Catalog) -> list[Loc]:
    """Temp files an interrupted write of safeckpt's own left (and only those)."""
    root = catalog.layout.root
    store = root.store
    found = [root / e.name for e in store.entries(root.key) if _ROOT_ORPHAN.match(e.name) and e.kind != DIR]
    for entry in catalog.entries:
        if entry.displaced or not entry.committed:
            continue
        found += [
            entry.path / f.name
            for f in store.entries(entry.path.key)
            if _CHECKPOINT_ORPHAN.match(f.name) and f.kind == FILE
        ]
    return sorted(found, key=lambda loc: loc.key)


def collect_orphans(catalog: Catalog, lock: Lock) -> list[Loc]:
    removed = []
    with lock:
        for path in orphan_files(catalog):
            with contextlib.suppress(FileNotFoundError):
                path.store.remove(path.key)
                removed.append(path)
    return removed


def point_latest_at_newest(layout: Layout, lock: Lock) -> None:
    """After a commit was taken out of the root (moved aside, withdrawn): ``latest`` names the newest
    commit left, or is removed when none is left."""
    catalog = scan(layout.root)
    if catalog.latest_step is not None:
        repair_latest(catalog, lock)
        return
    if catalog.latest_name is not None:  # it named the step taken out, the last one there was
        with contextlib.suppress(FileNotFoundError):
            layout.store.remove(layout.latest_path.key)
        layout.store.sync(layout.root.key)


def repair_latest(catalog: Catalog, lock: Lock) -> bool:
    """Point ``latest`` at the newest commit if it names anything else; whether it changed.

    Whatever sits at ``latest`` that is not a pointer (a directory, a FIFO) is
    moved aside to ``latest.not-a-pointer.<n>`` and kept.
    """
    newest = catalog.latest_step
    if newest is None or catalog.latest_name == step_dirname(newest):
        return False
    root = catalog.layout.root
    store = root.store
    latest = catalog.layout.latest_path
    with lock:
        aside = root / f"{LATEST_NAME}.not-a-pointer.{os.getpid()}"
        found = latest.entry()
        if found is not None and found.kind not in (LINK, FILE):  # a directory, a FIFO: kept, not ours
            store.move(latest.key, aside.key)
            logger.warning("safeckpt: %s was not a pointer; moved it to %s", latest, aside)
        store.write_pointer(latest.key, step_dirname(newest))
    logger.info(
        "safeckpt: `latest` in %s named %s; repaired to step %d, the newest commit",
        root,
        catalog.latest_name or "nothing",
        newest,
    )
    return True
