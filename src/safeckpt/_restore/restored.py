"""What ``CheckpointManager.restore()`` gives back: the step, and what was stored next to the weights.

The value is the same on every rank: rank 0 chooses the checkpoint and
broadcasts its record, and every rank builds its result from that record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._format.record import Record


@dataclass(frozen=True)
class Restored:
    """The result of ``restore()``; falsy when nothing was restored.

    The loop idiom: ``start = (r := mgr.restore(state)).step or 0``, then
    ``r.extra.get("wandb_run_id")`` and the like on a resumed run.
    """

    step: int | None = None
    """The step of the checkpoint loaded, or None when there was none (a fresh start)."""

    path: Path | str | None = None
    """The checkpoint directory loaded (as rank 0 named it): a ``Path`` on a local root, a URL
    (``s3://bucket/run/step_5``) on object storage."""

    metrics: dict[str, Any] = field(default_factory=dict)
    """The ``metrics`` passed to the ``save()`` of that step."""

    extra: dict[str, Any] = field(default_factory=dict)
    """The ``extra`` passed to the ``save()`` of that step (JSON data)."""

    record: Record | None = None
    """The checkpoint's whole record."""

    missing: tuple[str, ...] = ()
    """Paths of the state (``model.layers.3.w``) the checkpoint lacks: left as they were."""

    unexpected: tuple[str, ...] = ()
    """Paths the checkpoint holds that the state passed to ``restore()`` lacks: not loaded."""

    def __bool__(self) -> bool:
        return self.step is not None

    @classmethod
    def from_record(
        cls,
        record: Record,
        path: Path | str,
        *,
        missing: tuple[str, ...] = (),
        unexpected: tuple[str, ...] = (),
    ) -> Restored:
        """The result of loading the checkpoint at ``path`` whose record is ``record``."""
        return cls(
            step=record.step,
            path=path,
            metrics=dict(record.metrics),
            extra=dict(record.extra),
            record=record,
            missing=tuple(missing),
            unexpected=tuple(unexpected),
        )
