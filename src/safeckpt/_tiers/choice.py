"""Which copy a run with two tiers (``local_dir=``) restores: the newest commit across both.

The local tier is tried first for the same commit: its copy is on this node's
disk. Each tier's candidates are verified as one root's are
(:func:`~safeckpt._restore.choose.choose_checkpoint`); a local copy that fails
(its files, or later its bytes as they load) is skipped for that tier only, so
the durable copy of the same step is the next one tried.

Which is newer is the durable root's sequence, never a host's clock
(:mod:`safeckpt._format.lineage`): a local commit of another root, or one the
root has moved on past, is never taken; one not uploaded yet is newer than all
the root holds; an uploaded one stands where its durable copy was committed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Sequence

from .._format import lineage
from .._format.catalog import scan
from .._format.layout import Layout
from .._format.record import Record
from .._restore.choose import choose_checkpoint
from .._store.loc import Loc
from ..errors import CheckpointError, CheckpointNotFoundError

logger = logging.getLogger("safeckpt.manager")


def choose_across(
    tiers: Sequence[Layout],
    step: int | None,
    path: Loc | str | os.PathLike[str] | None,
    *,
    excluded: Sequence[Collection[int]],
    on_damaged: Callable[[Loc, Record | None, Exception], None] | None = None,
) -> tuple[Loc, Record] | None:
    """Rank 0: the checkpoint to restore from ``tiers`` (the fast one first), or None to start fresh.

    ``excluded[i]``: steps of tier ``i`` already found unloadable (an explicit ``step`` among them
    is taken from the next tier). ``path`` is loaded as it is.
    The newest commit is by the durable root's sequence (see the module's docstring);
    an explicit ``step`` missing or broken in one tier is taken from the next.
    """
    if path is not None:
        return choose_checkpoint(tiers[0], None, path)
    out = [set(e) for e in excluded]
    if len(tiers) > 1:
        out[0] |= not_this_roots(tiers[0], tiers[1])
    found: list[tuple[int, tuple[Loc, Record]]] = []
    failures: list[CheckpointError] = []
    for i, layout in enumerate(tiers):
        if step is not None and step in out[i]:
            continue  # its copy here failed as it loaded (or is not this root's): the next tier's
        try:
            got = choose_checkpoint(
                layout,
                step,
                None,
                exclude=out[i],
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
    if len(found) == 1:
        return found[0][1]
    local, durable = found[0][1], found[1][1]
    return local if lineage.newer_local(local[1], durable[1]) else durable


def not_this_roots(local: Layout, durable: Layout) -> set[int]:
    """The steps of the local tier ``local`` that are not restored as ``durable``'s: saved for
    another root, or not uploaded and behind ``durable`` (it moved on past them)."""
    committed = [e.record for e in scan(local.root).entries if e.committed and e.record is not None]
    if not committed:
        return set()
    root, root_id = str(durable.root.where), lineage.read_root_id(durable.root)
    out = {r.step for r in committed if not lineage.belongs(r, root, root_id)}
    waiting = [r for r in committed if r.uploaded is None and r.step not in out]
    if waiting:
        there = [e.record for e in scan(durable.root).entries if e.committed and e.record is not None]
        out |= {r.step for r in waiting if lineage.moved_on(r, there) is not None}
    for step in sorted(out):
        logger.warning(
            "safeckpt: step %d in %s is not restored: it was saved for another root, or %s has moved "
            "on past it",
            step,
            local.root,
            durable.root,
        )
    return out
