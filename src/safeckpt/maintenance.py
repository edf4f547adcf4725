"""Operations on a root from outside a training job (the ``safeckpt`` command uses these).

They are safe to run while a job trains on the same root: each change holds
the sidecar lock, saves in flight (in ``.staging/``) are never touched, and
whatever ``latest`` names is never removed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import dcp_io
from .catalog import Catalog, Entry, scan, verify_files
from .errors import CheckpointError, CheckpointNotFoundError
from .fileops import DEFAULT_FILE_OPS, FileOps
from .integrity import verify_file
from .layout import Layout
from .lock import SidecarLock
from .record import Record, amend_record
from .removal import Deleter, discard_checkpoint, recover_interrupted_replacements
from .retention import CheckpointInfo, Retention, plan_removals


def protected_steps(catalog: Catalog) -> set[int]:
    """What no prune may remove: the newest commit (what auto-resume takes) and the step the
    ``latest`` pointer names, which a lagging pointer can make two different steps."""
    protected = {catalog.latest_step, catalog.pointer_step}
    return {s for s in protected if s is not None}


def infos(catalog: Catalog) -> list[CheckpointInfo]:
    """Retention's view of the committed checkpoints that a prune could remove (in place, not a
    displaced copy waiting in the trash for start-up recovery)."""
    out = []
    for step, entry in sorted(catalog.committed.items()):
        record = entry.record
        assert record is not None
        if not entry.displaced:
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
    layout.check_private_dirs()
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


def verify(
    root: str | os.PathLike[str],
    step: int | None = None,
    *,
    steps: Sequence[int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[int, list[str]]:
    """For each committed checkpoint (or ``step``, or ``steps``): what is wrong with it (empty: sound).

    Reads every byte of every file and checks it against the checksums in the
    record; checks the record itself, every file's presence and size, and that
    DCP's ``.metadata`` reads through the restricted unpickler and names only
    files of its checkpoint. ``progress(n)`` is called as ``n`` more bytes are read.
    Needs no lock and no ownership: a checkpoint that a running job prunes while
    it is read is left out of the report (it is gone, not broken).
    """
    catalog = scan(Path(root).absolute())
    entries = {e.step: e for e in catalog.entries}
    wanted = list(steps or []) + ([step] if step is not None else [])
    if wanted:
        missing = [s for s in wanted if s not in entries]
        if missing:
            raise CheckpointNotFoundError(
                f"there is no checkpoint of step {missing[0]} in {root}; `safeckpt ls {root}` lists them.",
                step=missing[0],
            )
        entries = {s: entries[s] for s in wanted}
    report: dict[int, list[str]] = {}
    for s, entry in sorted(entries.items()):
        problems = verify_entry(entry, progress=progress)
        if problems and not os.path.lexists(entry.path):
            continue  # pruned (moved to the trash) while we read it
        report[s] = problems
    return report


def total_bytes(root: str | os.PathLike[str], steps: Sequence[int] | None = None) -> int:
    """What :func:`verify` reads, in bytes (for a progress bar's total)."""
    catalog = scan(Path(root).absolute())
    return sum(
        e.record.size
        for e in catalog.entries
        if e.record is not None and (not steps or e.step in steps)
    )


@dcp_io.parsed_kept()  # the checksums, parsed once for the files and .metadata
def verify_entry(entry: Entry, *, progress: Callable[[int], None] | None = None) -> list[str]:
    """What is wrong with one checkpoint, reading all of its bytes (empty: sound)."""
    problems = verify_files(entry)
    if problems or entry.record is None:
        return problems
    record = entry.record
    try:
        checksums = dcp_io.checksums_of(record, entry.path, for_load=False)
    except CheckpointError as e:
        return [str(e)]
    if checksums is None:
        problems.append("written without checksums (by an older safeckpt): its bytes cannot be verified")
    else:
        for name, checksum in sorted(checksums.items()):
            try:
                verify_file(entry.path / name, checksum, step=entry.step, progress=progress)
            except (CheckpointError, OSError) as e:
                problems.append(str(e))
    try:
        dcp_io.read_metadata(entry.path, record=record)
    except (CheckpointError, OSError) as e:
        problems.append(str(e))
    return problems
