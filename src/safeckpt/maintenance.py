"""Operations on a root from outside a training job (the ``safeckpt`` command uses these).

They are safe to run while a job trains on the same root: each change holds
the sidecar lock, saves in flight (in ``.staging/``) are never touched, and
whatever ``latest`` names is never removed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from . import dcp_io
from .catalog import Catalog, scan, verify_files
from .errors import CheckpointError, CheckpointNotFoundError
from .fileops import DEFAULT_FILE_OPS, FileOps
from .layout import Layout
from .lock import SidecarLock
from .record import Record, amend_record
from .removal import Deleter, discard_checkpoint, recover_interrupted_replacements
from .retention import CheckpointInfo, Retention, plan_removals


def protected_steps(catalog: Catalog) -> set[int]:
    """What no prune may remove: the step ``latest`` names, or the newest committed
    one when ``latest`` is missing or broken (auto-resume falls back to it)."""
    if catalog.latest_step is not None:
        return {catalog.latest_step}
    return {max(catalog.committed)} if catalog.committed else set()


def infos(catalog: Catalog) -> list[CheckpointInfo]:
    out = []
    for step, entry in sorted(catalog.committed.items()):
        record = entry.record
        assert record is not None
        out.append(CheckpointInfo(step, record.metrics, record.time, record.pinned))
    return out


@dataclass
class PruneResult:
    removed: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    left_in_trash: list[Path] = field(default_factory=list)


def prune(
    root: str | os.PathLike[str],
    retention: Retention,
    *,
    dry_run: bool = False,
    drain_timeout: float = 30.0,
    file_ops: FileOps | None = None,
) -> PruneResult:
    """Apply ``retention`` to the committed checkpoints of ``root`` and delete what falls out."""
    ops = file_ops or DEFAULT_FILE_OPS
    layout = Layout(Path(root).absolute())
    if not layout.root.is_dir():
        raise CheckpointNotFoundError(f"{layout.root} is not a directory.", path=str(layout.root))
    lock = SidecarLock(layout.lock_path)
    try:
        return _prune_locked(layout, lock, ops, retention, dry_run=dry_run, drain_timeout=drain_timeout)
    finally:
        lock.close()


def _prune_locked(
    layout: Layout,
    lock: SidecarLock,
    ops: FileOps,
    retention: Retention,
    *,
    dry_run: bool,
    drain_timeout: float,
) -> PruneResult:
    result = PruneResult()
    if not dry_run:
        recover_interrupted_replacements(layout, lock, ops)
    with lock:
        catalog = scan(layout.root)
        drop = plan_removals(infos(catalog), retention.policy(), protected_steps(catalog))
        result.kept = sorted(set(catalog.committed) - drop)
        result.removed = sorted(drop)
        if dry_run:
            return result
        result.removed = [s for s in result.removed if discard_checkpoint(layout, lock, ops, s)[0]]
        result.kept = sorted(set(catalog.committed) - set(result.removed))
    result.left_in_trash = Deleter(layout, lock, ops).drain(drain_timeout)
    return result


def set_pinned(
    root: str | os.PathLike[str], step: int, pinned: bool, *, file_ops: FileOps | None = None
) -> Record:
    """Pin (or unpin) ``step`` in its record, under the sidecar lock."""
    layout = Layout(Path(root).absolute())
    path = layout.step_dir(step)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"there is no checkpoint of step {step} in {layout.root}.", step=step)
    lock = SidecarLock(layout.lock_path)
    try:
        return amend_record(path, lock, file_ops or DEFAULT_FILE_OPS, pinned=pinned)
    finally:
        lock.close()


def verify(root: str | os.PathLike[str], step: int | None = None) -> dict[int, list[str]]:
    """For each committed checkpoint (or just ``step``): what is wrong with it (empty: sound).

    Checks the record, every file's presence and size, and that DCP's
    ``.metadata`` reads through the restricted unpickler.
    """
    catalog = scan(Path(root).absolute())
    entries = {e.step: e for e in catalog.entries}
    if step is not None:
        if step not in entries:
            raise CheckpointNotFoundError(f"there is no checkpoint of step {step} in {root}.", step=step)
        entries = {step: entries[step]}
    report: dict[int, list[str]] = {}
    for s, entry in sorted(entries.items()):
        problems = verify_files(entry)
        if not problems:
            try:
                dcp_io.read_metadata(entry.path)
            except CheckpointError as e:
                problems.append(str(e))
        report[s] = problems
    return report
