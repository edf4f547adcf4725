"""``safeckpt upload``: make the local commits of a run with two tiers durable, without training.

What a restarted job does before it trains (:mod:`safeckpt._tiers.uploads`), run by hand: a
node is being drained, or the job is not coming back. It opens the run as a writer would, so a
live job that owns either root is refused, and nothing is uploaded twice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._format.catalog import Catalog, scan
from .._manager.manager import CheckpointManager
from .._policy.retention import CUSTOM_POLICY, CheckpointInfo, Policy, Retention
from .._root.ownership import live_writer
from .._store.loc import Loc, as_root
from .._store.registry import open_store
from ..errors import CheckpointError, ConfigError, RootInUseError


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
    """Upload every committed checkpoint of ``local_dir`` that ``root`` lacks, oldest first.

    The root keeps the retention its job recorded (its newest record's): the uploads are recorded
    with it and the root pruned by it, as the job itself would have done.
    """
    local_top = Loc(open_store(local_dir), "")
    durable_top = Loc(open_store(root, options=storage_options), "")
    for where, top in ((local_dir, local_top), (root, durable_top)):
        owner = live_writer(top)
        if owner is not None:
            raise RootInUseError(
                f"{where} is being written by a live job ({owner.describe()}); it uploads its local "
                "commits itself. Run `safeckpt upload` once it has stopped.",
                path=str(where),
            )
    local = scan(local_top)
    parts = [
        e.step
        for e in local.entries
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
    # Not the defaults: they would record "no retention limit" in the root, and a later plain
    # `safeckpt prune` would keep everything.
    manager = CheckpointManager(
        root,
        local_dir=local_dir,
        async_save=False,
        storage_options=storage_options,
        retention=_recorded(scan(durable_top)) or _UNKNOWN,
    )
    manager.close()
    uploaded, earlier, waiting = [], [], []
    for entry in scan(as_root(local_dir)).newest_first()[::-1]:
        mark = entry.record.uploaded if entry.record is not None else None
        if mark is None:
            waiting.append(entry.step)
        elif (mark.at or 0.0) >= started:
            uploaded.append(entry.step)
        else:
            earlier.append(entry.step)
    return UploadReport(tuple(uploaded), tuple(earlier), tuple(waiting))


@dataclass(frozen=True)
class _AsRecorded:
    """A retention known only by what a record says (a custom policy, or none known): recorded
    again as it was, and keeping every checkpoint, since this process cannot apply it."""

    recorded: Mapping[str, Any]

    def keep(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        return frozenset(i.step for i in infos)

    def reason(self) -> str:
        return str(self.recorded.get("reason") or self.recorded.get(CUSTOM_POLICY))

    def to_json(self) -> dict[str, Any]:
        return dict(self.recorded)  # its custom_policy names the job's policy, not this class


# No record of the root names a retention: the upload keeps everything and says it did not know,
# so a later `safeckpt prune` without rules asks for them instead of keeping everything.
_UNKNOWN = _AsRecorded(
    {CUSTOM_POLICY: "unknown", "reason": "unknown to `safeckpt upload` (no record named one)"}
)


def _recorded(catalog: Catalog) -> Retention | Policy | None:
    """The retention of the newest commit whose record names one (None: no record does)."""
    for entry in catalog.newest_first():
        recorded = entry.record.retention if entry.record is not None else None
        if recorded is not None:
            try:
                return Retention.from_json(recorded)
            except (CheckpointError, TypeError, ValueError):  # a custom policy: carried as recorded
                return _AsRecorded(recorded)
    return None
