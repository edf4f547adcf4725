"""Which copy a run with two tiers (``local_dir=``) restores: the newest commit across both.

The local tier is tried first for the same commit: its copy is on this node's
disk. Each tier's candidates are verified as one root's are
(:func:`~safeckpt._restore.choose.choose_checkpoint`); a local copy that fails
(its files, or later its bytes as they load) is skipped for that tier only, so
the durable copy of the same step is the next one tried.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Sequence

from .._format.layout import Layout
from .._format.record import Record
from .._store.loc import Loc
from ..errors import CheckpointError, CheckpointNotFoundError
from .choose import choose_checkpoint

logger = logging.getLogger("safeckpt.manager")


def choose_across(
    tiers: Sequence[Layout],
    step: int | None,
    path: str | os.PathLike[str] | None,
    *,
    excluded: Sequence[Collection[int]],
    on_damaged: Callable[[Loc, Record | None, Exception], None] | None = None,
) -> tuple[Loc, Record] | None:
    """Rank 0: the checkpoint to restore from ``tiers`` (the fast one first), or None to start fresh.

    ``excluded[i]``: steps of tier ``i`` already found unloadable (an explicit ``step`` among them
    is taken from the next tier). ``path`` is loaded as it is.
    The newest commit is the one saved last (the ``time`` of its record, which its upload keeps);
    an explicit ``step`` missing or broken in one tier is taken from the next.
    """
    if path is not None:
        return choose_checkpoint(tiers[0], None, path)
    found: list[tuple[int, tuple[Loc, Record]]] = []
    failures: list[CheckpointError] = []
    for i, layout in enumerate(tiers):
        if step is not None and step in excluded[i]:
            continue  # its copy here failed as it loaded: the next tier's is tried
        try:
            got = choose_checkpoint(
                layout,
                step,
                None,
                exclude=excluded[i],
                on_damaged=on_damaged if i == 0 else None,
                announce=i == len(tiers) - 1,
            )
        except CheckpointError as e:
            if step is None:
                raise  # a tier that cannot be read at all is the restore's error
            failures.append(e)
            if not isinstance(e, CheckpointNotFoundError):
                logger.warning("safeckpt: step %d in %s cannot be loaded (%s)", step, layout.root, e)
            continue
        if got is not None:
            found.append((i, got))
    if not found:
        if step is not None:  # asked for: no tier has a copy left to try
            raise (
                failures[-1]
                if failures
                else CheckpointNotFoundError(
                    f"no copy of step {step} loads (see the warnings above)", step=step
                )
            )
        if failures and len(failures) == len(tiers):
            raise failures[-1]  # the durable tier's reason
        return None
    return max(found, key=lambda f: (f[1][1].time, -f[0]))[1]
