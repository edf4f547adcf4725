"""``safeckpt upload``: make the local commits of a run with two tiers durable, without training.

What a restarted job does before it trains (:mod:`safeckpt._manager.uploads`), run by hand: a
node is being drained, or the job is not coming back. It opens the run as a writer would, so a
live job that owns either root is refused, and nothing is uploaded twice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._format.catalog import scan
from .._manager.manager import CheckpointManager
from .._root.ownership import live_writer
from .._store.loc import Loc, as_root
from .._store.registry import open_store
from ..errors import ConfigError, RootInUseError


@dataclass(frozen=True)
class UploadReport:
    uploaded: tuple[int, ...]
    """Steps uploaded now."""
    earlier: tuple[int, ...]
    """Local steps uploaded before (by the job, or an earlier ``safeckpt upload``)."""
    waiting: tuple[int, ...]
    """Local steps still not uploaded (the durable tier could not be reached)."""

    def to_json(self) -> dict[str, Any]:
        return {"uploaded": list(self.uploaded), "earlier": list(self.earlier), "waiting": list(self.waiting)}


def upload_local(
    root: str | os.PathLike[str],
    local_dir: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> UploadReport:
    """Upload every committed checkpoint of ``local_dir`` that ``root`` lacks, oldest first."""
    for where, options in ((local_dir, None), (root, storage_options)):
        owner = live_writer(Loc(open_store(where, options=options), ""))
        if owner is not None:
            raise RootInUseError(
                f"{where} is being written by a live job ({owner.describe()}); it uploads its local "
                "commits itself. Run `safeckpt upload` once it has stopped.",
                path=str(where),
            )
    parts = [
        e.step
        for e in scan(as_root(local_dir)).entries
        if e.record is not None and e.record.part is not None and e.record.uploaded is None
    ]
    if parts:
        raise ConfigError(
            f"{local_dir} holds one node's parts of step(s) {', '.join(map(str, sorted(parts)))} (a "
            "local tier on each node's disk): a part alone cannot be committed in the root. The "
            "job's next start, on every node, uploads them.",
            path=str(local_dir),
        )
    started = time.time()
    manager = CheckpointManager(root, local_dir=local_dir, async_save=False, storage_options=storage_options)
    manager.close()
    uploaded, earlier, waiting = [], [], []
    for entry in scan(as_root(local_dir)).newest_first()[::-1]:
        mark = entry.record.uploaded if entry.record is not None else None
        if mark is None:
            waiting.append(entry.step)
        elif float(mark.get("at", 0.0)) >= started:
            uploaded.append(entry.step)
        else:
            earlier.append(entry.step)
    return UploadReport(tuple(uploaded), tuple(earlier), tuple(waiting))
