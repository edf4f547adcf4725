"""A read-only look at a checkpoint root: committed checkpoints, ``latest``, leftovers.

Used by the manager when it opens a root and by the command line. Reads
records and lists directories; changes nothing and takes no lock (records are
replaced atomically, so a reader sees a whole one).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .._store.base import Store
from .._store.loc import Loc, as_loc, as_root
from ..errors import CheckpointError, IncompleteCheckpointError, UnsafeCheckpointError
from .layout import DAMAGED_NOTE, REPLACED, Layout, parse_step_dirname, parse_trash_name
from .record import Record, missing_or_wrong_files, read_record

T = TypeVar("T")


@dataclass(frozen=True)
class Entry:
    """One checkpoint directory: its record, or why it has no usable one.

    ``displaced`` marks the old copy of a step whose replacement a crash
    interrupted (``.trash/step_<N>.replaced.*`` while ``step_<N>`` is missing):
    it is still that step's committed copy until the owner's start-up recovery
    puts it back.
    """

    step: int
    path: Loc
    record: Record | None
    problem: str | None = None
    displaced: bool = False

    @property
    def committed(self) -> bool:
        return self.record is not None and self.problem is None

    @property
    def order(self) -> tuple[int, int]:
        """Commit order: by the record's sequence (records before format 2 first, by step)."""
        seq = self.record.seq if self.record is not None and self.record.seq is not None else -1
        return (seq, self.step)


@dataclass(frozen=True)
class Catalog:
    """What a root holds, as read at one moment."""

    layout: Layout
    entries: tuple[Entry, ...]
    latest_name: str | None
    staging: tuple[Loc, ...] = field(default=())
    trash: tuple[Loc, ...] = field(default=())
    damaged: tuple[Loc, ...] = field(default=())
    """Checkpoints auto-resume found unloadable and moved aside (``.damaged/``): never loaded."""

    @property
    def committed(self) -> dict[int, Entry]:
        return {e.step: e for e in self.entries if e.committed}

    def newest_first(self) -> list[Entry]:
        """Committed checkpoints, the most recent commit first (the order auto-resume tries)."""
        return sorted(self.committed.values(), key=lambda e: e.order, reverse=True)

    @property
    def latest_step(self) -> int | None:
        """The most recently committed step: what auto-resume takes (``latest`` only mirrors it)."""
        newest = self.newest_first()
        return newest[0].step if newest else None

    @property
    def pointer_step(self) -> int | None:
        """The step the ``latest`` pointer names if that step is committed, else None."""
        step = parse_step_dirname(self.latest_name) if self.latest_name else None
        return step if step in self.committed else None

    @property
    def next_seq(self) -> int:
        """The sequence number the next commit gets."""
        seqs = [e.record.seq for e in self.entries if e.record is not None and e.record.seq is not None]
        return max(seqs, default=0) + 1


def scan(root: Loc | Store | str | os.PathLike[str]) -> Catalog:
    """Read every record under ``root``. A directory with a bad record is listed with its problem.

    Reads only (never follows a link out of the root, never opens anything but
    regular files), so it is safe on a root another job is writing. On a store where each read
    is a round trip, the records and the other listings are read side by side.

    ``latest`` is read before the listing, and the step it names is read by name when the listing
    lacks it: a job that commits (and prunes) faster than a whole scan takes then still leaves a
    consistent catalog, as its pointer's step is pruned only after the pointer has moved on, and a
    newer commit in the listing is only a pointer that lags.
    """
    layout = Layout(as_root(root))
    latest_name = layout.store.read_pointer(layout.latest_path.key)
    dirs = layout.committed_dirs()
    with _Reads(layout.store.small_reads_at_once) as reads:
        records = [reads.submit(_entry, step, path) for step, path in dirs]  # first: they may be pruned
        trash_listed = reads.submit(layout.trash_entries)
        staging = reads.submit(layout.staging_entries)
        damaged = reads.submit(layout.damaged_entries)
        entries = [r.result() for r in records]
        trash = tuple(trash_listed.result())
        pointed = parse_step_dirname(latest_name) if latest_name else None
        if pointed is not None and not any(e.step == pointed and e.committed for e in entries):
            by_name = _entry(pointed, layout.step_dir(pointed))  # committed after the listing
            if by_name.committed:
                entries = [e for e in entries if e.step != pointed] + [by_name]
        present = {e.step for e in entries}
        displaced = []
        for path in trash:
            parsed = parse_trash_name(path.name)
            if parsed is not None and parsed[1] == REPLACED and parsed[0] not in present:
                displaced.append(reads.submit(_entry, parsed[0], path))
        for found in displaced:  # in the trash's order: the first committed copy of a step counts
            entry = found.result()
            if entry.committed and entry.step not in present:
                present.add(entry.step)
                entries.append(dataclasses.replace(entry, displaced=True))
        staging_found, damaged_found = tuple(staging.result()), tuple(damaged.result())
    return Catalog(
        layout=layout,
        entries=tuple(sorted(entries, key=lambda e: e.step)),
        latest_name=latest_name,
        staging=staging_found,
        trash=trash,
        damaged=damaged_found,
    )


class _Reads:
    """Reads run ``at_once`` at a time on a pool, or one by one as they are submitted (1)."""

    def __init__(self, at_once: int) -> None:
        self._pool = ThreadPoolExecutor(at_once, thread_name_prefix="safeckpt-scan") if at_once > 1 else None

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        done: Future[T] = Future()
        try:
            done.set_result(fn(*args))
        except Exception as e:  # raised at result(), as from the pool; an interrupt goes on at once
            done.set_exception(e)
        return done

    def __enter__(self) -> _Reads:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


# Waits between the scans of settled_scan(): a commit moves `latest` and prunes within
# milliseconds, so a few short tries see a settled root; bounded, 0.35 s in all.
_RESCAN_WAITS = (0.01, 0.02, 0.04, 0.08, 0.2)


def settled_scan(root: Loc | Store | str | os.PathLike[str]) -> Catalog:
    """:func:`scan`, taken again (a few bounded times) while it caught a writer mid-commit.

    A scan reads ``latest``, lists the step directories, then reads their records: a commit
    (and the pruning after it) in between can make a listed directory vanish, or the pointer's
    step be pruned before it is read (a writer that commits faster than one record read). A
    reader on a root a job is writing (``safeckpt verify``, ``ls``) takes the catalog this way;
    what still disagrees after the last try is reported. Entries that vanished (pruned) after
    the listing are left out.
    """
    catalog = scan(root)
    for wait in _RESCAN_WAITS:
        if _settled(catalog):
            break
        time.sleep(wait)
        catalog = scan(root)
    present = tuple(e for e in catalog.entries if e.committed or e.path.entry() is not None)
    return dataclasses.replace(catalog, entries=present)


def _settled(catalog: Catalog) -> bool:
    """Whether ``catalog`` shows no sign of a commit or prune that ran while it was read."""
    if catalog.latest_name is not None and catalog.pointer_step is None:
        return False  # `latest` names a step the listing has not (yet) seen committed
    if catalog.latest_name is None and catalog.committed:
        return False  # a first commit: its directory is in place, `latest` not yet
    return all(e.committed or e.path.entry() is not None for e in catalog.entries)


def _entry(step: int, path: Loc) -> Entry:
    try:
        record = read_record(path, step=step)
    except (IncompleteCheckpointError, UnsafeCheckpointError) as e:
        return Entry(step, path, None, str(e))
    except OSError as e:  # gone meanwhile (pruned), or unreadable
        return Entry(step, path, None, f"unreadable ({e})")
    if record is None:
        return Entry(step, path, None, "no record (a save that never finished, or not ours)")
    if not record.committed:
        return Entry(step, path, record, f"record status is {record.status!r}")
    return Entry(step, path, record)


def verify_files(entry: Entry) -> list[str]:
    """What is wrong with ``entry``'s files against its record (empty: complete). Stats only."""
    if entry.record is None:
        return [entry.problem or "no record"]
    problems = [entry.problem] if entry.problem else []
    return problems + missing_or_wrong_files(entry.path, entry.record)


def damaged_note(path: Loc | str | os.PathLike[str]) -> dict[str, object]:
    """What the ``damaged.json`` note of a moved-aside checkpoint says (empty when it has none)."""
    try:
        note = as_loc(path) / DAMAGED_NOTE
        data = json.loads(note.store.read_small(note.key, limit=64 << 10, what="damage note"))
    except (OSError, ValueError, CheckpointError):
        return {}
    return data if isinstance(data, dict) else {}
