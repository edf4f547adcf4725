"""A read-only look at a checkpoint root: committed checkpoints, ``latest``, leftovers.

Used by the manager when it opens a root and by the command line. Reads
records and lists directories; changes nothing and takes no lock (records are
replaced atomically, so a reader sees a whole one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .atomic import read_pointer
from .errors import IncompleteCheckpointError
from .layout import Layout, parse_step_dirname
from .record import Record, missing_or_wrong_files, read_record


@dataclass(frozen=True)
class Entry:
    """One ``step_<N>`` directory: its record, or why it has no usable one."""

    step: int
    path: Path
    record: Record | None
    problem: str | None = None

    @property
    def committed(self) -> bool:
        return self.record is not None and self.problem is None


@dataclass(frozen=True)
class Catalog:
    """What a root holds, as read at one moment."""

    layout: Layout
    entries: tuple[Entry, ...]
    latest_name: str | None
    staging: tuple[Path, ...] = field(default=())
    trash: tuple[Path, ...] = field(default=())

    @property
    def committed(self) -> dict[int, Entry]:
        return {e.step: e for e in self.entries if e.committed}

    @property
    def latest_step(self) -> int | None:
        """The step ``latest`` names if that step is committed, else None."""
        step = parse_step_dirname(self.latest_name) if self.latest_name else None
        return step if step in self.committed else None


def scan(root: Path) -> Catalog:
    """Read every record under ``root``. A directory with a bad record is listed with its problem."""
    layout = Layout(root)
    entries = []
    for step, path in layout.committed_dirs():
        try:
            record = read_record(path)
        except IncompleteCheckpointError as e:
            entries.append(Entry(step, path, None, str(e)))
            continue
        if record is None:
            entries.append(Entry(step, path, None, "no record (a save that never finished, or not ours)"))
        elif not record.committed:
            entries.append(Entry(step, path, record, f"record status is {record.status!r}"))
        elif record.step != step:
            entries.append(Entry(step, path, record, f"record is of step {record.step}"))
        else:
            entries.append(Entry(step, path, record))
    return Catalog(
        layout=layout,
        entries=tuple(entries),
        latest_name=read_pointer(layout.latest_path),
        staging=tuple(layout.staging_entries()),
        trash=tuple(layout.trash_entries()),
    )


def verify_files(entry: Entry) -> list[str]:
    """What is wrong with ``entry``'s files against its record (empty: complete)."""
    if entry.record is None:
        return [entry.problem or "no record"]
    problems = [entry.problem] if entry.problem else []
    return problems + missing_or_wrong_files(entry.path, entry.record)
