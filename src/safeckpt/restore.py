"""Resuming: which checkpoint to load, whether it is whole, and loading it.

Rank 0 calls :func:`choose_checkpoint`; every rank then calls
:func:`load_checkpoint` on the directory rank 0 chose.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from . import dcp_io
from .atomic import read_pointer
from .distributed import Participants
from .errors import (
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    UnsupportedStateError,
)
from .layout import Layout, parse_step_dirname
from .record import Record, missing_or_wrong_files, read_record
from .state import (
    apply_targets,
    apply_train_state,
    dcp_keys,
    load_targets,
    read_train_state,
    restore_rng,
    train_state_filename,
)

logger = logging.getLogger(__name__)


def verify_checkpoint(directory: Path) -> Record:
    """The record of a committed, complete checkpoint at ``directory``; raises otherwise.

    Complete: every file the record lists exists with its recorded size, and
    DCP's ``.metadata`` reads through the restricted unpickler.
    """
    if not directory.is_dir():
        raise CheckpointNotFoundError(
            f"there is no checkpoint at {directory}.",
            path=str(directory),
            step=parse_step_dirname(directory.name),
        )
    record = read_record(directory)
    if record is None or not record.committed:
        raise IncompleteCheckpointError(
            f"{directory} is not a committed checkpoint (it has no committed record): it may be "
            "a save that never finished. Restore another step.",
            path=str(directory),
        )
    problems = missing_or_wrong_files(directory, record)
    if problems:
        raise IncompleteCheckpointError(
            f"{directory} does not match its record: {'; '.join(problems[:5])}. The checkpoint "
            "was damaged after it was written; restore another step.",
            path=str(directory),
            step=record.step,
        )
    dcp_io.read_metadata(directory)
    return record


def choose_checkpoint(
    layout: Layout, step: int | None, path: str | os.PathLike[str] | None
) -> tuple[Path, Record] | None:
    """Rank 0: the checkpoint to restore, or None for a fresh start.

    An explicit ``path`` or ``step`` is verified and returned, or raises. Else
    the one ``latest`` names if it is whole, else the newest whole one (with a
    warning). A checkpoint that asks to run code raises even then.
    """
    if path is not None and step is not None:
        raise ConfigError("restore(): pass step= or path=, not both.")
    if path is not None:
        directory = Path(path).absolute()
        return directory, verify_checkpoint(directory)
    if step is not None:
        directory = layout.step_dir(step)
        return directory, verify_checkpoint(directory)
    candidates = sorted((s for s, _ in layout.committed_dirs()), reverse=True)
    name = read_pointer(layout.latest_path)
    latest = parse_step_dirname(name) if name else None
    if latest is not None:
        candidates = [latest] + [s for s in candidates if s != latest]
    elif candidates:
        logger.warning(
            "safeckpt: %s has checkpoints but `latest` is %s; using the newest complete one",
            layout.root,
            "missing" if name is None else f"unreadable ({name!r})",
        )
    for candidate in candidates:
        directory = layout.step_dir(candidate)
        try:
            record = verify_checkpoint(directory)
        except (CheckpointNotFoundError, IncompleteCheckpointError) as e:
            logger.warning("safeckpt: skipping step %d: %s", candidate, e)
            continue
        if candidate != latest and latest is not None:
            logger.warning(
                "safeckpt: `latest` names step %d, which is not loadable; falling back to "
                "step %d, the newest complete checkpoint",
                latest,
                candidate,
            )
        return directory, record
    return None


def load_checkpoint(
    state: MutableMapping[str, Any],
    directory: Path,
    record: Record,
    parts: Participants,
    *,
    strict: bool,
    with_rng: bool,
) -> None:
    """Load ``directory`` into ``state`` in place (collective over ``parts.control``)."""
    metadata = dcp_io.read_metadata(directory)
    saved_keys = {fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata}
    rank_file = directory / train_state_filename(parts.rank)
    own_file = rank_file.exists()
    if not own_file:
        rank_file = directory / train_state_filename(0)
        logger.warning(
            "safeckpt: step %d was saved by %d rank(s); rank %d loads rank 0's training "
            "state (data loader, scheduler) and keeps its own RNG state",
            record.step,
            record.world_size,
            parts.rank,
        )
    train = read_train_state(rank_file)
    entries = train["entries"]
    wanted = set(dcp_keys(state))
    missing = sorted((wanted - saved_keys) | {k for k in state if k not in wanted and k not in entries})
    if missing and strict:
        raise UnsupportedStateError(
            f"step {record.step} in {directory} has no entry for {missing}, which the state "
            "passed to restore() has. Restore with strict=False to load what is there and "
            "leave these as they are.",
            step=record.step,
            path=str(directory),
        )
    targets = load_targets(state, wanted & saved_keys)
    if targets.dcp:
        try:
            dcp_io.load(targets.dcp, directory, parts.control)
        except CheckpointException as e:
            raise IncompleteCheckpointError(
                f"loading step {record.step} from {directory} failed: {e}. If the model or "
                "optimizer changed shape since the save, restore into the original ones.",
                step=record.step,
                path=str(directory),
            ) from e
        apply_targets(targets)
    apply_train_state(state, entries)
    if with_rng and own_file and train["rng"] is not None:
        restore_rng(train["rng"])
