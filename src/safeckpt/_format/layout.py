"""Names inside a checkpoint root. No I/O beyond listing (through the root's store).

<root>/step_<N>/          a committed checkpoint (``metadata.json`` is its record)
<root>/latest             pointer to the newest committed checkpoint
<root>/.staging/<name>    a save in progress: step_<N>.<token>
<root>/.trash/<name>      removed checkpoints waiting for deletion:
                          step_<N>.<pruned|replaced|abandoned>.<token>
<root>/.damaged/<name>    checkpoints auto-resume found unloadable, moved aside for
                          inspection: step_<N>.<token>, with ``damaged.json`` inside
                          saying why; never loaded, never pruned, removed by ``gc``
<root>/.lock              the inter-process sidecar lock
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from .._store.base import DIR, LINK, Store
from .._store.loc import Loc
from ..errors import UnsafeCheckpointError

RECORD_NAME = "metadata.json"
LATEST_NAME = "latest"
STAGING_NAME = ".staging"
TRASH_NAME = ".trash"
DAMAGED_NAME = ".damaged"
DAMAGED_NOTE = "damaged.json"  # inside a moved-aside checkpoint: why, when, what it was
LOCK_NAME = ".lock"
DATA_SUFFIX = ".distcp"  # a rank's tensor data, as DCP names it: __<rank>_<n>.distcp

# Why a checkpoint went to the trash. "replaced" ones are the previous copy of a
# step saved twice; start-up recovery puts one back if its successor never landed.
PRUNED = "pruned"
REPLACED = "replaced"
ABANDONED = "abandoned"  # a staging leftover of an interrupted save

_STEP_DIR = re.compile(r"^step_(0|[1-9][0-9]*)$")
_STAGING_DIR = re.compile(r"^step_(0|[1-9][0-9]*)\.([0-9a-f]{12})$")
_DAMAGED_DIR = re.compile(r"^step_(0|[1-9][0-9]*)\.([0-9a-f]{12})$")
_TRASH_DIR = re.compile(r"^step_(0|[1-9][0-9]*)\.(pruned|replaced|abandoned)\.([0-9a-f]{12})$")


_FLAT_NAME = re.compile(r"[^/\\\x00]+")


def check_member_name(name: str, *, where: str) -> None:
    """A file a checkpoint names must be a plain name inside it: no ``/``, no ``..``, not absolute."""
    if not isinstance(name, str) or not _FLAT_NAME.fullmatch(name) or name in (".", ".."):
        raise UnsafeCheckpointError(
            f"{where} names the file {name!r}, which is not inside the checkpoint (absolute, with "
            "'..' or a directory part). safeckpt reads only files inside a checkpoint; the "
            "checkpoint was modified. Restore another one.",
            path=where,
        )


def step_dirname(step: int) -> str:
    return f"step_{step}"


def parse_step_dirname(name: str) -> int | None:
    """The step a committed directory name stands for, or None for any other name."""
    match = _STEP_DIR.fullmatch(name)  # not .match: $ accepts a trailing newline
    return int(match.group(1)) if match else None


def parse_trash_name(name: str) -> tuple[int, str] | None:
    """``(step, reason)`` of a trash entry, or None for a name safeckpt did not make."""
    match = _TRASH_DIR.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


def parse_staging_name(name: str) -> int | None:
    match = _STAGING_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def parse_damaged_name(name: str) -> int | None:
    """The step of a moved-aside damaged checkpoint, or None for a name safeckpt did not make."""
    match = _DAMAGED_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def _token() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Layout:
    """Names of one checkpoint root, as :class:`~safeckpt._store.Loc` of its store."""

    root: Loc

    @property
    def store(self) -> Store:
        return self.root.store

    @property
    def staging(self) -> Loc:
        return self.root / STAGING_NAME

    @property
    def trash(self) -> Loc:
        return self.root / TRASH_NAME

    @property
    def damaged(self) -> Loc:
        return self.root / DAMAGED_NAME

    @property
    def latest_path(self) -> Loc:
        return self.root / LATEST_NAME

    def step_dir(self, step: int) -> Loc:
        return self.root / step_dirname(step)

    def staging_dir(self, step: int, token: str) -> Loc:
        """Where a save of ``step`` is written; ``token`` (12 hex digits) is the same on every rank."""
        if not re.fullmatch(r"[0-9a-f]{12}", token):
            raise ValueError(f"a staging token is 12 hex digits, got {token!r}")
        return self.staging / f"{step_dirname(step)}.{token}"

    def new_trash_path(self, step: int, reason: str) -> Loc:
        return self.trash / f"{step_dirname(step)}.{reason}.{_token()}"

    def new_damaged_path(self, step: int) -> Loc:
        return self.damaged / f"{step_dirname(step)}.{_token()}"

    def committed_dirs(self) -> list[tuple[int, Loc]]:
        """``(step, location)`` of every ``step_<N>`` directory, sorted by step.

        A listed directory is not necessarily complete: read its record.
        """
        found = []
        for entry in self.store.entries(self.root.key):
            step = parse_step_dirname(entry.name)
            if step is not None and entry.kind == DIR:
                found.append((step, self.root / entry.name))
        return sorted(found, key=lambda f: f[0])

    def staging_entries(self) -> list[Loc]:
        return self._children(self.staging)

    def trash_entries(self) -> list[Loc]:
        return self._children(self.trash)

    def damaged_entries(self) -> list[Loc]:
        """Moved-aside damaged checkpoints (only names safeckpt made)."""
        return [loc for loc in self._children(self.damaged) if parse_damaged_name(loc.name) is not None]

    def _children(self, directory: Loc) -> list[Loc]:
        # the store never lists through a link: nothing is acted on in another directory through one
        return [directory / e.name for e in self.store.entries(directory.key)]

    def check_private_dirs(self) -> None:
        """Raise unless ``.staging``, ``.trash`` and ``.damaged`` are real directories of this root
        (or absent).

        Everything in them is deleted eventually: through a symlink that would
        delete another directory's contents.
        """
        for loc in (self.staging, self.trash, self.damaged):
            entry = loc.entry()
            if entry is not None and entry.kind != DIR:
                raise UnsafeCheckpointError(
                    f"{loc} is {'a symbolic link' if entry.kind == LINK else 'not a directory'}; "
                    "safeckpt deletes what is in it, so it refuses to use it. Remove it (it is not "
                    "a checkpoint) and start again.",
                    path=str(loc),
                )
