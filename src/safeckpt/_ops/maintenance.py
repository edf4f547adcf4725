"""Operations on a root from outside a training job (the ``safeckpt`` command uses these).

They are safe to run while a job trains on the same root: each change holds
the sidecar lock, saves in flight (in ``.staging/``) are never touched, and
whatever ``latest`` names is never removed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeGuard

from .._dcp import safe_metadata
from .._format.catalog import Catalog, Entry, damaged_note, scan, settled_scan, verify_files
from .._format.checksums import verify_file
from .._format.layout import Layout, parse_damaged_name, parse_step_dirname
from .._format.record import Record, amend_record
from .._policy.retention import CheckpointInfo, Retention, plan_removals
from .._root.removal import Deleter, discard_checkpoint, recover_interrupted_replacements
from .._store.base import DIR, FILE, LINK, Lock, Store
from .._store.loc import Loc, as_root
from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError


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


def recorded_retention(catalog: Catalog) -> Retention | None:
    """The retention the job that wrote the newest record used, if it says (None: it does not, or
    it used a custom policy, which cannot be rebuilt)."""
    for entry in sorted(catalog.committed.values(), key=lambda e: e.step, reverse=True):
        if entry.record is not None and entry.record.retention is not None:
            try:
                return Retention.from_json(entry.record.retention)
            except (CheckpointError, TypeError):
                return None
    return None


GIVEN = "given"
RECORDED = "recorded"


@dataclass
class PruneResult:
    removed: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    left_in_trash: list[Loc] = field(default_factory=list)
    rule: str = ""
    """The retention applied, in words (``Retention.policy().reason()``)."""
    source: str = GIVEN
    """Where the rule came from: ``"given"`` by the caller, or ``"recorded"`` by the job."""


def prune(
    root: Loc | Store | str | os.PathLike[str],
    retention: Retention | None,
    *,
    dry_run: bool = False,
    drain_timeout: float = 30.0,
) -> PruneResult:
    """Apply ``retention`` to the committed checkpoints of ``root`` and delete what falls out.

    ``retention=None``: the retention the job recorded (its newest record's; see
    :func:`recorded_retention`), read under the lock with the checkpoints it judges, so a
    prune does what the job itself does at its next commit. Raises :class:`ConfigError`
    when the records name none this can apply.
    """
    layout = Layout(as_root(root))
    if not _is_dir(layout.root):
        raise CheckpointNotFoundError(f"{layout.root} is not a directory.", path=str(layout.root))
    lock = layout.store.lock(timeout=300.0)
    try:
        return _prune_locked(layout, lock, retention, dry_run=dry_run, drain_timeout=drain_timeout)
    finally:
        lock.close()


def _prune_locked(
    layout: Layout,
    lock: Lock,
    retention: Retention | None,
    *,
    dry_run: bool,
    drain_timeout: float,
) -> PruneResult:
    result = PruneResult()
    layout.check_private_dirs()
    if not dry_run:
        recover_interrupted_replacements(layout, lock)
    with lock:
        catalog = scan(layout.root)
        if retention is None:
            retention, result.source = _recorded_or_refuse(catalog), RECORDED
        result.rule = retention.policy().reason()
        drop = plan_removals(infos(catalog), retention.policy(), protected_steps(catalog))
        result.kept = sorted(set(catalog.committed) - drop)
        result.removed = sorted(drop)
        if dry_run:
            return result
        result.removed = [s for s in result.removed if discard_checkpoint(layout, lock, s)[0]]
        result.kept = sorted(set(catalog.committed) - set(result.removed))
    result.left_in_trash = Deleter(layout, lock).drain(drain_timeout)
    return result


def _recorded_or_refuse(catalog: Catalog) -> Retention:
    retention = recorded_retention(catalog)
    if retention is None:
        raise ConfigError(
            f"no retention to prune {catalog.layout.root} with: its records name none this can apply "
            "(none recorded, or a custom policy). Give a rule: --keep-last N, --keep-best K --metric "
            "NAME, --keep-every N or --keep-milestones STEPS."
        )
    return retention


def set_pinned(root: Loc | Store | str | os.PathLike[str], step: int, pinned: bool) -> Record:
    """Pin (or unpin) ``step`` in its record, under the sidecar lock."""
    layout = Layout(as_root(root))
    path = layout.step_dir(step)
    if not _is_dir(path):
        raise CheckpointNotFoundError(f"there is no checkpoint of step {step} in {layout.root}.", step=step)
    lock = layout.store.lock(timeout=300.0)
    try:
        return amend_record(path, lock, pinned=pinned)
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
    wanted = list(steps or []) + ([step] if step is not None else [])
    return verify_root(root, steps=wanted or None, progress=progress).checkpoints


@dataclass
class VerifyReport:
    """What :func:`verify_root` found."""

    checkpoints: dict[int, list[str]]
    """Each checkpoint verified, with its problems (empty: sound)."""
    latest_problem: str | None
    """What is wrong with ``latest`` (checked only when every checkpoint is verified)."""
    damaged: list[Damaged]
    """Checkpoints moved aside into ``.damaged/``: never loaded, so no problem of the root."""

    @property
    def ok(self) -> bool:
        return self.latest_problem is None and not any(self.checkpoints.values())


def verify_root(
    root: Loc | str | os.PathLike[str],
    *,
    steps: Sequence[int] | None = None,
    progress: Callable[[int], None] | None = None,
    catalog: Catalog | None = None,
) -> VerifyReport:
    """:func:`verify` of ``steps`` (None: every checkpoint, and ``latest``), safe on a root a job writes.

    The catalog is a :func:`~safeckpt._format.catalog.settled_scan` (or ``catalog``, taken so). A
    checkpoint found broken is looked up again before it is reported: gone (pruned while it
    was read) it is left out; replaced by a new copy of its step, the copy is verified.
    """
    path = as_root(root)
    catalog = catalog if catalog is not None else settled_scan(path)
    entries = {e.step: e for e in catalog.entries}
    if steps:
        missing = [s for s in steps if s not in entries]
        if missing:
            raise CheckpointNotFoundError(
                f"there is no checkpoint of step {missing[0]} in {root}; `safeckpt ls {root}` lists them.",
                step=missing[0],
            )
        entries = {s: entries[s] for s in steps}
    report: dict[int, list[str]] = {}
    for s, entry in sorted(entries.items()):
        problems = _verify_settled(path, entry, progress)
        if problems is not None:
            report[s] = problems
    latest = None if steps else latest_problem(catalog, report)
    return VerifyReport(report, latest, damaged_checkpoints(catalog))


def _verify_settled(root: Loc, entry: Entry, progress: Callable[[int], None] | None) -> list[str] | None:
    """``entry``'s problems, confirmed on a fresh look; None when it went away meanwhile."""
    for _ in range(_REVERIFY_ATTEMPTS):
        problems = verify_entry(entry, progress=progress)
        if not problems:
            return problems
        again = next((e for e in scan(root).entries if e.step == entry.step), None)
        if again is None or again.path.entry() is None:
            return None  # pruned (moved to the trash) while we read it: gone, not broken
        if again.path == entry.path and again.record == entry.record:
            return problems  # the same checkpoint, still broken
        entry = again  # replaced by a new copy of its step while we read it
    return problems


_REVERIFY_ATTEMPTS = 3


def latest_problem(catalog: Catalog, report: dict[int, list[str]] | None = None) -> str | None:
    """What is wrong with ``latest`` in ``catalog`` (None: nothing): missing while there are
    checkpoints, naming something that is not a committed checkpoint of the root (outside it,
    a missing step, an incomplete one), or (with ``report``) naming a broken one."""
    name = catalog.latest_name
    broken = {step for step, problems in (report or {}).items() if problems}
    newest = next((e.step for e in catalog.newest_first() if e.step not in broken), None)
    fallback = (
        f"; auto-resume takes the newest complete checkpoint (step {newest}) instead"
        if newest is not None
        else "; auto-resume finds no complete checkpoint and would start fresh"
    )
    if name is None:
        return None if not catalog.committed else "`latest` is missing" + fallback
    step = parse_step_dirname(name)
    target = catalog.layout.root / name
    if step is None:
        return f"`latest` points to {name}, not to a checkpoint directory of this root" + fallback
    found = target.entry()
    if found is not None and found.kind == LINK:
        return (
            f"`latest` names {name}, a symbolic link to {found.target}, not a checkpoint of this root"
            + fallback
        )
    if step not in catalog.committed:
        what = "is not a committed checkpoint" if found is not None else "does not exist"
        return f"`latest` names {name}, which {what}" + fallback
    if step in broken:
        return f"`latest` names step {step}, which is broken" + fallback
    return None


@dataclass(frozen=True)
class Damaged:
    """A checkpoint auto-resume found unloadable and moved aside into ``.damaged/`` (never loaded).

    ``reason``, ``time`` and ``seq`` come from its ``damaged.json`` note; None where it has
    none (or a malformed one)."""

    step: int
    path: Loc
    reason: str | None
    time: float | None
    seq: int | None
    size: int

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "path": str(self.path),
            "reason": self.reason,
            "time": self.time,
            "seq": self.seq,
            "size": self.size,
        }


def damaged_checkpoints(catalog: Catalog) -> list[Damaged]:
    """The moved-aside checkpoints of ``catalog``, by step, with what their notes say."""
    found = []
    for path in catalog.damaged:
        step = parse_damaged_name(path.name)
        if step is None:
            continue
        note = damaged_note(path)
        reason, when, seq = note.get("reason"), note.get("time"), note.get("seq")
        found.append(
            Damaged(
                step=step,
                path=path,
                reason=reason if isinstance(reason, str) else None,
                time=float(when) if _finite_number(when) else None,
                seq=seq if isinstance(seq, int) and not isinstance(seq, bool) else None,
                size=_flat_size(path),
            )
        )
    return sorted(found, key=lambda d: (d.step, d.path.name))


def _finite_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _flat_size(path: Loc) -> int:
    """The bytes of the regular files in ``path``, its record and note included (what gc frees)."""
    try:
        return sum(e.size for e in path.store.entries(path.key) if e.kind == FILE)
    except OSError:  # unreadable
        return 0


def _is_dir(loc: Loc) -> bool:
    entry = loc.entry()
    return entry is not None and entry.kind == DIR


def total_bytes(root: str | os.PathLike[str], steps: Sequence[int] | None = None) -> int:
    """What :func:`verify` reads, in bytes (for a progress bar's total)."""
    catalog = scan(as_root(root))
    return sum(
        e.record.size for e in catalog.entries if e.record is not None and (not steps or e.step in steps)
    )


@safe_metadata.parsed_kept()  # the checksums, parsed once for the files and .metadata
def verify_entry(entry: Entry, *, progress: Callable[[int], None] | None = None) -> list[str]:
    """What is wrong with one checkpoint, reading all of its bytes (empty: sound)."""
    problems = verify_files(entry)
    if problems or entry.record is None:
        return problems
    record = entry.record
    try:
        checksums = safe_metadata.checksums_of(record, entry.path, for_load=False)
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
        safe_metadata.read_metadata(entry.path, record=record)
    except (CheckpointError, OSError) as e:
        problems.append(str(e))
    return problems
