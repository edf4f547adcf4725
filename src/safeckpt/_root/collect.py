"""Collecting what crashes and old versions leave in a root (``safeckpt gc``).

What is collected:

* ``staging``: ``.staging/`` entries, unless a live writer owns the root (never a
  live owner's saves in flight). A root with no owner record has no live writer:
  a writer claims the root (writes its owner record, under the sidecar lock gc
  holds) before it stages anything, and removes the record only at ``close()``,
  so staging found without one is the leftover of a crash or an older version;
* ``trash``: ``.trash/`` entries (pruned or abandoned checkpoints), unless a live
  writer owns the root (its own deleter removes them);
* ``nfs`` / ``fuse``: ``.nfs*`` and ``.fuse_hidden*`` files that are no longer in
  use (removal is tried; a file still open somewhere refuses it and is skipped);
* ``temp``: orphan temp files of atomic writes (``.latest.tmp.*``, ``.<name>.tmp.*``
  in step directories, DCP's ``.metadata.tmp``);
* ``damaged``: ``.damaged/`` entries, checkpoints auto-resume found unloadable and
  moved aside (never loaded, never pruned: kept for a look until gc removes them),
  live writer or not, since no writer uses them again; only one without its
  ``damaged.json`` note is left to a live writer (it may be moving it aside).

Every decision and every removal attempt holds the sidecar lock, so a file a live
writer is still writing (its temp files exist only while it holds the lock) is
never seen. Removal goes through :mod:`safeckpt._root.removal` (retries on ENOTEMPTY,
EBUSY, ENOENT with a bounded budget). Nothing is loaded and no checkpoint that
``latest`` or a record names is touched.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .._format.catalog import damaged_note
from .._format.layout import STAGING_NAME, TRASH_NAME, Layout, parse_step_dirname
from .._store.base import DIR, FILE, Entry, Lock, Store
from .._store.loc import Loc, as_root
from ..errors import CheckpointError, CheckpointNotFoundError
from .owner_record import read_owner_raw
from .ownership import live_writer, read_owner
from .removal import (
    Deleter,
    RetryBudget,
    collect_abandoned_staging,
    recover_interrupted_replacements,
    remove_tree,
)

STAGING = "staging"
TRASH = "trash"
NFS = "nfs"
FUSE = "fuse"
TEMP = "temp"
DAMAGED = "damaged"

REMOVED = "removed"
WOULD_REMOVE = "would remove"
SKIPPED = "skipped"

# ``.probe-*``: the conditional-write check of a writer killed mid-check (safeckpt._objstore.conditions).
_ROOT_TEMP = (".latest.tmp.*", ".*.tmp.*", ".probe-*")
_STEP_TEMP = (".*.tmp.*", ".metadata.tmp")


@dataclass
class GcItem:
    """One leftover: where, what kind, its size, and what gc did with it."""

    path: Loc
    kind: str
    size: int
    action: str = WOULD_REMOVE
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "kind": self.kind,
            "size": self.size,
            "action": self.action,
            "reason": self.reason,
        }


@dataclass
class GcReport:
    """What :func:`collect_garbage` found and did."""

    root: Loc
    dry_run: bool
    owner: str
    """Who owns the root, in words (for the report)."""
    owner_alive: bool | None
    """True: a live writer owns the root; False: its owner is gone; None: no owner record."""
    items: list[GcItem] = field(default_factory=list)
    restored_steps: list[int] = field(default_factory=list)
    """Steps put back from an interrupted replacement (recovered, not removed)."""

    @property
    def bytes_freed(self) -> int:
        return sum(i.size for i in self.items if i.action == REMOVED)

    def to_json(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "dry_run": self.dry_run,
            "owner": self.owner,
            "owner_alive": self.owner_alive,
            "items": [i.to_json() for i in self.items],
            "restored_steps": self.restored_steps,
            "bytes_freed": self.bytes_freed,
            "bytes_found": sum(i.size for i in self.items if i.action != SKIPPED),
        }


def owner_state(root: Loc, *, stale_after: float | None = None) -> tuple[bool | None, str, bytes | None]:
    """Whether the writer that owns ``root`` is alive (None: no owner record), who it is, and its
    record's bytes as last seen.

    An owner whose pid cannot tell is watched for up to ``stale_after`` s (default: the
    ``dead_after`` it promised, saying so once), and counts as alive unless it is proven dead.
    Never called with the root's lock held: the owner's heartbeat needs it to show it is alive.
    """
    owner = read_owner(root)
    if owner is None:
        return None, "no owner record", None
    live = live_writer(root, patience=owner.dead_after if stale_after is None else stale_after)
    alive = live is not None
    return alive, f"{(live or owner).describe()} ({'alive' if alive else 'gone'})", _record_bytes(root)


def _record_bytes(root: Loc) -> bytes | None:
    try:
        return read_owner_raw(root)
    except (OSError, CheckpointError):
        return None


def collect_garbage(
    root: Loc | Store | str | os.PathLike[str],
    *,
    dry_run: bool = False,
    drain_timeout: float = 10.0,
    stale_after: float | None = None,
) -> GcReport:
    """Find, and unless ``dry_run`` remove, the leftovers of ``root`` (see the module doc).

    Safe while a training job writes to ``root``: its staging is left alone and every
    step holds the sidecar lock. ``drain_timeout`` bounds the retries of trash deletions
    (a ``.nfs`` file still open elsewhere); what stays is reported as skipped.
    ``stale_after``: how long an owner on another machine is watched for a heartbeat (see
    :func:`owner_state`).
    """
    layout = Layout(as_root(root))
    top = layout.root.entry()
    if top is None or top.kind != DIR:
        raise CheckpointNotFoundError(
            f"{layout.root} is not a directory; pass a checkpoint root.", path=str(layout.root)
        )
    lock = layout.store.lock(timeout=300.0)
    try:
        return _collect(layout, lock, dry_run=dry_run, drain_timeout=drain_timeout, stale=stale_after)
    finally:
        lock.close()


def _collect(
    layout: Layout,
    lock: Lock,
    *,
    dry_run: bool,
    drain_timeout: float,
    stale: float | None,
) -> GcReport:
    alive, who, seen = owner_state(layout.root, stale_after=stale)  # outside the lock: see there
    with lock:
        if alive is not True and _record_bytes(layout.root) != seen:  # a heartbeat, or a new owner
            current = read_owner(layout.root)
            alive = True
            who = f"{current.describe()} (alive)" if current is not None else who
        report = GcReport(layout.root, dry_run, who, alive)
        # no live writer: its owner is gone, or there is no owner record (nobody claimed the root;
        # a writer claims it under this lock before it stages a save, so none can start meanwhile)
        writer_gone = alive is not True
        if writer_gone and not dry_run:
            report.restored_steps = recover_interrupted_replacements(layout, lock)
        for entry in layout.staging_entries():
            item = GcItem(entry, STAGING, _tree_size(entry))
            if not writer_gone:
                item.action = SKIPPED
                item.reason = "the root's writer is alive; a save may be in flight"
            report.items.append(item)
        for entry in layout.trash_entries():
            item = GcItem(entry, TRASH, _tree_size(entry))
            if alive:
                # the live writer's own deleter removes its trash (with its retries), and the old
                # copy of a replacement in progress is its; nothing touches a live owner's files
                item.action = SKIPPED
                item.reason = "the root's live writer deletes its own trash"
            report.items.append(item)
        for entry in layout.damaged_entries():
            item = GcItem(entry, DAMAGED, _tree_size(entry))
            if alive and not damaged_note(entry):
                item.action = SKIPPED
                item.reason = "it has no note yet: the live writer may be moving it aside"
            report.items.append(item)
        for path, kind in _loose_files(layout):
            item = GcItem(path, kind, _tree_size(path))
            at_top = path.parent == layout.root
            if kind == TEMP and at_top and alive and not path.name.startswith(".latest."):
                # a live writer may update its own files (the owner record's heartbeat) without
                # the lock; only `latest` is always swapped under it
                item.action = SKIPPED
                item.reason = "may be a live writer's write in progress"
            report.items.append(item)
        if dry_run:
            return report
        # Staging of a gone writer goes to the trash in the same lock hold as the owner check:
        # a new writer needs this lock to take ownership, so none can start in between.
        moved: dict[Loc, Loc] = {}
        for item in report.items:
            if item.kind == STAGING and item.action == WOULD_REMOVE:
                for target in collect_abandoned_staging(layout, lock, only=item.path):
                    moved[item.path] = target
    budget = RetryBudget()
    for item in report.items:
        if item.kind in (NFS, FUSE, TEMP, DAMAGED) and item.action == WOULD_REMOVE:
            result = remove_tree(item.path, budget, lock)
            _conclude(item, result.removed, result.error)
    if not alive and any(i.kind in (STAGING, TRASH) and i.action == WOULD_REMOVE for i in report.items):
        Deleter(layout, lock).drain(drain_timeout)
    for item in report.items:
        if item.kind in (STAGING, TRASH) and item.action == WOULD_REMOVE:
            gone = moved.get(item.path, item.path).entry() is None
            _conclude(item, gone, None if gone else "the filesystem kept refusing (a file still open?)")
    return report


def _conclude(item: GcItem, removed: bool, error: object) -> None:
    if removed:
        item.action = REMOVED
    else:
        item.action = SKIPPED
        item.reason = f"in use or not removable: {error}" if error else "not removable"


def _loose_files(layout: Layout) -> Iterator[tuple[Loc, str]]:
    """``.nfs*``, ``.fuse_hidden*`` and orphan temp files outside ``.staging/`` and ``.trash/``."""
    store = layout.store
    for entry in store.entries(layout.root.key):
        if entry.name in (STAGING_NAME, TRASH_NAME):
            continue
        if entry.kind == DIR:
            if parse_step_dirname(entry.name) is not None:
                yield from _step_dir_leftovers(layout.root / entry.name)
            continue
        kind = _hidden_kind(entry.name)
        if kind is None and any(fnmatch.fnmatchcase(entry.name, p) for p in _ROOT_TEMP):
            kind = TEMP
        if kind is not None:
            yield layout.root / entry.name, kind


def _step_dir_leftovers(step_dir: Loc) -> Iterator[tuple[Loc, str]]:
    for directory, entries in _walk(step_dir):
        for entry in entries:
            kind = _hidden_kind(entry.name)
            if kind is None and directory == step_dir and entry.kind != DIR:
                kind = TEMP if any(fnmatch.fnmatchcase(entry.name, p) for p in _STEP_TEMP) else None
            if kind is not None:
                yield directory / entry.name, kind


def _walk(top: Loc) -> Iterator[tuple[Loc, list[Entry]]]:
    """Every directory under ``top`` (never through a link) with what it holds."""
    entries = top.store.entries(top.key)
    yield top, entries
    for entry in entries:
        if entry.kind == DIR:
            yield from _walk(top / entry.name)


def _hidden_kind(name: str) -> str | None:
    # On NFS a file deleted while open stays as .nfsXXXX until the last close; FUSE does the
    # same with .fuse_hiddenXXXX. Once nothing holds them they are just lost space.
    if name.startswith(".nfs"):
        return NFS
    if name.startswith(".fuse_hidden"):
        return FUSE
    return None


def _tree_size(path: Loc) -> int:
    entry = path.entry()
    if entry is None:
        return 0
    if entry.kind != DIR:
        return entry.size
    files = sum(e.size for _, entries in _walk(path) for e in entries if e.kind == FILE)
    return files + _unfinished_bytes(path)


def _unfinished_bytes(path: Loc) -> int:
    """Bytes of unfinished uploads under ``path``, on a store that has them (S3's multipart
    uploads, which a save cut short leaves): stored, yet in no listing of files."""
    count = getattr(path.store, "unfinished_bytes", None)
    if count is None:
        return 0
    try:
        return int(count(path.key))
    except OSError:  # a size in a report: the removal does not depend on it
        return 0
