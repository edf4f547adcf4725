"""Registrars: tell something outside the root (a model registry, an index) about a commit.

A registrar runs on rank 0 after a checkpoint is committed and ``latest`` names
it, on the manager's registration thread (:mod:`safeckpt._registration.worker`), so it
never delays a save, a commit or pruning. Whatever it returns is stored in the
record's ``registration`` field. If it raises (anything, ``BaseException``
included), only the registration is lost: the checkpoint stays committed, the
record says ``{"status": "failed", "error": ..., "time": ...}``, a warning is
logged, and the registration is retried at the next commit.

Optional methods a registrar may have: ``should_register(info: CommitInfo) ->
bool`` (default: every commit), ``to_json() -> dict`` with a ``"kind"`` key (so
``safeckpt register`` can rebuild it) and ``close()`` (called once at the end).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .._format.record import Record


@runtime_checkable
class Registrar(Protocol):
    """Called once per chosen committed checkpoint, on rank 0, from the registration thread.

    ``register`` returns JSON data to keep in the record (or None). It may be
    slow (it delays only the registrations after it) and it may raise. It may
    be called again for a step it already registered (a retry, ``safeckpt
    register``): make it idempotent where a duplicate matters. ``path`` is the
    checkpoint directory as a person names it: a ``Path`` for a local root, its
    URL (``s3://bucket/run/step_5``) for a root on object storage.
    """

    def register(self, step: int, path: Path | str, record: Record) -> Mapping[str, Any] | None: ...


class JsonlIndexRegistrar:
    """Appends one JSON line per committed checkpoint to ``index_path`` (fsynced).

    A plain, append-only index that other tools (dashboards, evaluators) can
    tail; lines of checkpoints pruned later stay, with the path they had.
    """

    def __init__(self, index_path: str | os.PathLike[str]) -> None:
        self.index_path = Path(index_path)

    def register(self, step: int, path: Path | str, record: Record) -> Mapping[str, Any]:
        line = json.dumps(
            {"step": step, "path": str(path), "time": record.time, "metrics": dict(record.metrics)},
            allow_nan=True,
        )
        self.index_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.index_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        return {"index": str(self.index_path)}

    def to_json(self) -> dict[str, Any]:
        return {"kind": "jsonl", "index_path": str(self.index_path)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JsonlIndexRegistrar:
        return cls(data["index_path"])
