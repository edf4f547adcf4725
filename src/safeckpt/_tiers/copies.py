"""The copies of a run with two tiers, as a restore and a pin see them: the
:class:`~safeckpt._manager.tiering.Copies` of a manager with ``local_dir=``.

With one node, a restore chooses across both tiers (:mod:`.choice`: the newest commit by the
durable root's sequence, the local copy of it tried first). With a local directory on each node's
disk, a checkpoint is whole only in the durable root: a restore chooses there, and each rank reads
the files its node's part holds from its own disk (:mod:`.part_overlay`), every byte checked as it
loads; a damaged local file makes every rank read the step again from the root alone.

A pin reaches the durable copy too (rank 0, which holds the durable root).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Sequence

from .._format.layout import Layout
from .._format.record import Record
from .._restore.choose import choose_checkpoint
from .._store.loc import Loc
from ..errors import CheckpointError
from .choice import choose_across
from .durable import DurableTier
from .part_overlay import PartOverlay, this_nodes_part

logger = logging.getLogger("safeckpt.manager")


class TierCopies:
    """Where a restore of a two-tier run reads, and what a pin reaches (see the module's docstring).

    Call rules: :class:`~safeckpt._manager.tiering.Copies`'.
    """

    def __init__(self, local: Layout, durable: DurableTier, *, several_nodes: bool) -> None:
        self._local = local
        self._durable = durable
        self._parts = several_nodes  # each node's local copy is its part of a checkpoint
        self.roots: Sequence[Layout] = [durable.layout] if several_nodes else [local, durable.layout]
        self._parts_failed: set[int] = set()  # steps whose local parts failed: read from the root

    def choose(
        self,
        step: int | None,
        path: Loc | str | os.PathLike[str] | None,
        *,
        excluded: Sequence[Collection[int]],
        on_damaged: Callable[[Loc, Record | None, Exception], None],
    ) -> tuple[Loc, Record] | None:
        if self._parts:  # only the root holds whole checkpoints; nothing of it is moved aside
            return choose_checkpoint(self.roots[0], step, path, exclude=excluded[0])
        return choose_across(self.roots, step, path, excluded=excluded, on_damaged=on_damaged)

    def read_with(self, directory: Loc, record: Record) -> Loc | None:
        """``directory`` (the durable root's) with the files this node's part holds read from its
        own disk, where it holds any that match."""
        if not self._parts or record.step in self._parts_failed:
            return None
        found = this_nodes_part(self._local, record)
        if found is None:
            return None
        part, files = found
        logger.info("safeckpt: reading %d file(s) of step %d from %s", len(files), record.step, part)
        return Loc(PartOverlay(directory.store, directory.key, part, files), directory.key)

    def unreadable_with(self, step: int, why: str) -> None:
        self._parts_failed.add(step)
        logger.warning(
            "safeckpt: step %d cannot be loaded with the nodes' local parts (%s); reading it from %s alone",
            step,
            why,
            self._durable.root,
        )

    def pin(self, step: int, pinned: bool, *, here: bool) -> bool:
        """The durable copy's pin; whether the durable root has one. ``here``: the local copy took
        the pin already (the error then says so)."""
        try:
            return self._durable.set_pinned(step, pinned)
        except (CheckpointError, OSError) as e:
            verb, done = ("pin", "pinned") if pinned else ("unpin", "unpinned")
            local = f"step {step} is {done} in {self._local.root.where}, but " if here else ""
            raise CheckpointError(
                f"{verb}({step}): {local}its durable copy in {self._durable.root} could not be "
                f"{done} ({type(e).__name__}: {e}). Call {verb}({step}) again once "
                f"{self._durable.root} can be written.",
                step=step,
                path=str(self._durable.root),
            ) from e
