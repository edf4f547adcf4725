"""Names and paths inside a checkpoint root. No I/O beyond listing.

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

import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

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
    """Paths of one checkpoint root."""

    root: Path

    @property
    def staging(self) -> Path:
        return self.root / STAGING_NAME

    @property
    def trash(self) -> Path:
        return self.root / TRASH_NAME

    @property
    def damaged(self) -> Path:
        return self.root / DAMAGED_NAME

    @property
    def lock_path(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def latest_path(self) -> Path:
        return self.root / LATEST_NAME

    def step_dir(self, step: int) -> Path:
        return self.root / step_dirname(step)

    def staging_dir(self, step: int, token: str) -> Path:
        """Where a save of ``step`` is written; ``token`` (12 hex digits) is the same on every rank."""
        if not re.fullmatch(r"[0-9a-f]{12}", token):
            raise ValueError(f"a staging token is 12 hex digits, got {token!r}")
        return self.staging / f"{step_dirname(step)}.{token}"

    def new_trash_path(self, step: int, reason: str) -> Path:
        return self.trash / f"{step_dirname(step)}.{reason}.{_token()}"

    def new_damaged_path(self, step: int) -> Path:
        return self.damaged / f"{step_dirname(step)}.{_token()}"

    def committed_dirs(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every ``step_<N>`` directory, sorted by step.

        A listed directory is not necessarily complete: read its record.
        """
        found = []
        for entry in _scandir(self.root):
            step = parse_step_dirname(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                found.append((step, Path(entry.path)))
        return sorted(found)

    def staging_entries(self) -> list[Path]:
        return sorted(Path(e.path) for e in _scandir(self.staging))

    def trash_entries(self) -> list[Path]:
        return sorted(Path(e.path) for e in _scandir(self.trash))

    def damaged_entries(self) -> list[Path]:
        """Moved-aside damaged checkpoints (only names safeckpt made)."""
        return sorted(Path(e.path) for e in _scandir(self.damaged) if parse_damaged_name(e.name) is not None)

    def check_private_dirs(self) -> None:
        """Raise unless ``.staging`` and ``.trash`` are real directories of this root (or absent).

        Everything in them is deleted eventually: through a symlink that would
        delete another directory's contents.
        """
        for path in (self.staging, self.trash, self.damaged):
            if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
                raise UnsafeCheckpointError(
                    f"{path} is {'a symbolic link' if os.path.islink(path) else 'not a directory'}; "
                    "safeckpt deletes what is in it, so it refuses to use it. Remove it (it is not "
                    "a checkpoint) and start again.",
                    path=str(path),
                )


def _scandir(path: Path) -> list[os.DirEntry[str]]:
    if os.path.islink(path):  # never list (and so never act on) another directory through a link
        return []
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []
