"""Resuming on every rank: rank 0 chooses, every rank checks its own files, all load or fall back.

The restore half of :class:`~safeckpt.CheckpointManager`: auto-resume
takes the newest commit that every rank can load, stepping over a damaged one
on every rank together; an explicit step raises the same error on every rank.

With tiers beside the root (``local_dir=``), a restore chooses among the roots
their :class:`~.tiering.Copies` names, in order: a copy that fails in one root
is excluded there only, so the next root's copy of the same commit is tried.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

from .._dcp import safe_metadata
from .._dcp.io import DCP_ERRORS
from .._dcp.options import IOOptions
from .._dcp.options import using as using_io
from .._dist.failures import storage_error
from .._dist.participants import Participants, agreed_error
from .._dist.participants import portable as _portable
from .._format.identity import Fate, fate_of
from .._format.layout import Layout
from .._format.record import Record
from .._restore.choose import (
    REREADS,
    as_read_error,
    check_own_files,
    choose_checkpoint,
    is_damage,
    kept_changing,
    removed_while_read,
)
from .._restore.load import load as load_state
from .._restore.load_into import load_checkpoint
from .._restore.restored import Restored
from .._store.loc import Loc
from .._util.gc_pause import collector_paused
from .._util.validate import validate_or_none
from ..errors import CheckpointError, IncompleteCheckpointError
from .damaged import DamagedCommits
from .outcomes import Outcomes
from .session import RootSession
from .tiering import Copies

logger = logging.getLogger("safeckpt.manager")

# What a failed attempt at one checkpoint leads to, the same on every rank.
_LOADED = "loaded"
_SKIP = "skip"  # damaged: auto-resume falls back past it
_AGAIN = "again"  # replaced or removed under this reader: choose again


class Resumer:
    """Which checkpoint every rank loads, and loading it (``restore``), or one without a template.

    Call rules: ``restore`` is collective over the control group (every rank,
    same order as the manager's other collective calls).
    """

    def __init__(
        self,
        root: Path | str,  # as messages name it
        *,
        ranks: Participants,
        layout: Layout,
        session: RootSession,
        damaged: DamagedCommits,
        outcomes: Outcomes,
        save_rng: bool,
        io: IOOptions,
        copies: Copies | None = None,
    ) -> None:
        """``copies``: the roots a restore chooses from beyond ``layout`` (with ``local_dir=``)."""
        self.root = root
        self.save_rng = save_rng
        self._ranks = ranks
        self._layout = layout
        self._copies = copies
        self._roots = [layout] if copies is None else list(copies.roots)
        # root 0 is this manager's own: what fails to load there is moved aside
        self._own_first = self._roots[0].store.url == layout.store.url
        self._session = session
        self._damaged = damaged
        self._outcomes = outcomes
        self._io = io

    @collector_paused()  # the record's and the plan's objects too, not only DCP's (see _util.gc_pause)
    @safe_metadata.parsed_kept()  # chosen, verified, checked per rank and read: .metadata parsed once
    def restore(
        self,
        state: MutableMapping[str, Any],
        *,
        step: int | None = None,
        path: str | os.PathLike[str] | None = None,
        strict: bool = True,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
    ) -> Restored:
        """Load a checkpoint into ``state`` (see :meth:`CheckpointManager.restore`)."""
        with using_io(self._io):
            try:
                return self._restore(state, step, path, strict=strict, include=include, exclude=exclude)
            except OSError as e:  # the storage's own failure (a checkpoint's is a CheckpointError)
                if isinstance(e, CheckpointError):
                    raise
                raise storage_error(self._layout.root, e, doing="restore()") from e

    def _restore(
        self,
        state: MutableMapping[str, Any],
        step: int | None,
        path: str | os.PathLike[str] | None,
        *,
        strict: bool,
        include: Sequence[str] | None,
        exclude: Sequence[str] | None,
    ) -> Restored:
        step = validate_or_none(step)
        auto = step is None and path is None
        excluded: list[set[int]] = [set() for _ in self._roots]  # per root: steps found unloadable
        filled: list[int] = []  # steps that failed while being read, after filling part of the state
        rereads = 0
        try:
            while True:
                choice = self._choose(step, path, excluded)
                if choice is None:
                    if filled:  # not a fresh start: the state holds part of a damaged checkpoint
                        break
                    self._move_aside_unloadable()
                    logger.info("safeckpt: nothing to resume in %s; starting from step 0", self.root)
                    return Restored()
                directory, record = choice
                began: list[bool] = []  # the state started to change (load_checkpoint's filling)
                outcome = None
                try:
                    outcome, report = self._try_load(
                        state,
                        directory,
                        record,
                        (auto, step is not None),
                        began,
                        strict=strict,
                        include=include,
                        exclude=exclude,
                    )
                finally:
                    if began and outcome != _LOADED:
                        filled.append(record.step)
                if outcome == _LOADED:
                    break
                if outcome == _SKIP:
                    root = self._root_of(directory)
                    excluded[root].add(record.step)
                    if root == 0 and self._own_first:  # the manager moves aside only what is in its own root
                        self._note_unloadable(directory, record, report)
                    continue
                rereads += 1
                if rereads > REREADS:
                    raise kept_changing(directory, record)
        except Exception as e:  # a later attempt's error, or a refusal to fall back
            if filled and hasattr(e, "add_note"):  # Python 3.11 and later
                e.add_note(
                    f"safeckpt: the state is not as it was: step {filled[0]} filled part of it in place "
                    "before its damage was found. Build it anew before training on it."
                )
            raise  # what failed stays where it is: the error tells the user what to move
        if outcome != _LOADED:
            raise _partly_filled(self.root, filled)
        self._outcomes.conclude(None, what=f"restore of step {record.step}", step=record.step)
        if auto:
            self._move_aside_unloadable()
        logger.info("safeckpt: restored step %d from %s", record.step, directory)
        missing = tuple(getattr(report, "missing", ()))
        if filled and missing:
            logger.warning(
                "safeckpt: restored step %d, which lacks %s; these were filled in place from the "
                "damaged step %d before its damage was found, and may hold its damaged bytes. Set "
                "them anew before training on them.",
                record.step,
                ", ".join(repr(k) for k in missing[:10]) + (" ..." if len(missing) > 10 else ""),
                filled[0],
            )
        return Restored.from_record(
            record, directory.where, missing=missing, unexpected=tuple(getattr(report, "unexpected", ()))
        )

    def _try_load(
        self,
        state: MutableMapping[str, Any],
        directory: Loc,
        record: Record,
        asked: tuple[bool, bool],
        began: list[bool],
        **options: Any,
    ) -> tuple[str, Any]:
        """One attempt at one checkpoint on every rank: loaded (and the load's report), or what to do
        next (and, to skip it, why), the same on every rank."""
        ranks = self._ranks
        what = f"restore of step {record.step}"
        # Each rank checks its own files first, so one rank's damaged file is the same error on
        # every rank within seconds (not a timeout in DCP's collective), or a fallback for all.
        overlay = self._copies.read_with(directory, record) if self._copies is not None else None
        local = overlay is not None
        directory = overlay or directory
        own = _attempt(check_own_files, directory, record, ranks.rank)
        outcome, why = self._next_move(own, what, directory, record, asked, local=local)
        if outcome != _LOADED:
            return outcome, why
        report: Any = None
        load_error: BaseException | None = None
        try:
            report = load_checkpoint(
                state,
                directory,
                record,
                ranks,
                with_rng=self.save_rng,
                filling=functools.partial(began.append, True),
                **options,
            )
        except DCP_ERRORS as e:
            load_error = as_read_error(e, directory, record)
        outcome, why = self._next_move(load_error, what, directory, record, asked, local=local)
        return outcome, report if outcome == _LOADED else why

    def load(self, step: int | None = None) -> dict[Any, Any]:
        """This root's checkpoint (the one ``restore`` would take, or ``step``) without a template.

        See :func:`safeckpt.load`. Not collective: each rank that calls it reads
        the whole checkpoint.
        """
        with using_io(self._io):
            return load_state(self._layout.root, step=validate_or_none(step))

    def _root_of(self, directory: Loc) -> int:
        # By URL: on the other ranks the chosen directory's store is one opened anew from it.
        return next((i for i, t in enumerate(self._roots) if t.store.url == directory.store.url), 0)

    def _choose_here(
        self, step: int | None, path: Loc | str | os.PathLike[str] | None, excluded: list[set[int]]
    ) -> tuple[Loc, Record] | None:
        if self._copies is not None:
            return self._copies.choose(step, path, excluded=excluded, on_damaged=self._damaged_at_choice)
        return choose_checkpoint(
            self._layout, step, path, exclude=excluded[0], on_damaged=self._damaged_at_choice
        )

    def _choose(
        self, step: int | None, path: str | os.PathLike[str] | None, excluded: list[set[int]]
    ) -> tuple[Loc, Record] | None:
        """Rank 0 chooses; every rank gets the same choice, or the same error."""
        ranks = self._ranks
        if not ranks.distributed:  # nothing to send: the record as read (no round trip through JSON)
            return self._choose_here(step, path, excluded)
        choice: tuple[Loc, dict[str, Any]] | None = None
        error: BaseException | None = None
        if ranks.is_leader:
            try:
                found = self._choose_here(step, path, excluded)
                choice = None if found is None else (found[0], found[1].to_json())
            except Exception as e:
                error = e
        choice, error = ranks.broadcast(
            (choice, _portable(error)), ranks.control, what="choosing the checkpoint to restore"
        )
        if error is not None:
            raise error
        if choice is None:
            return None
        directory = choice[0]
        return directory, Record.from_json(choice[1], path=str(directory))

    def _next_move(
        self,
        error: BaseException | None,
        what: str,
        directory: Loc,
        record: Record,
        asked: tuple[bool, bool],
        *,
        local: bool = False,
    ) -> tuple[str, str]:
        """Agree on ``error``: ``_LOADED`` if every rank succeeded; ``_AGAIN`` when the checkpoint
        was replaced or removed under this reader, or damage was found where a rank read files of
        its own disk into it (:meth:`~.tiering.Copies.read_with`: it is read as it is next);
        ``_SKIP`` to fall back past damage (auto-resume, or a step's copy in another root); else
        raise the same error on every rank.

        ``asked``: (auto-resume, a step was asked for); ``local``: this rank read files of its own."""
        auto, step_asked = asked
        gathered = self._ranks.gather((_portable(error), local), self._ranks.control, what=what)
        failed = {rank: e for rank, (e, _) in enumerate(gathered) if e is not None}
        if not failed:
            return _LOADED, ""
        if any(own for _, own in gathered) and all(is_damage(e) for e in failed.values()):
            assert self._copies is not None  # only its read_with reads a rank's own files
            self._copies.unreadable_with(
                record.step, "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
            )
            return _AGAIN, ""
        fate = self._fate(directory, record, what)
        if fate is Fate.REPLACED or (fate is Fate.GONE and auto):
            logger.info(
                "safeckpt: step %d was %s while it was read; choosing again",
                record.step,
                "replaced by a new save of it" if fate is Fate.REPLACED else "removed (pruned)",
            )
            return _AGAIN, ""
        if fate is Fate.GONE:
            raise removed_while_read(directory, record)
        # A damaged copy in the first of several roots (a local one) falls back to the next root's
        # copy of the same step also when the step was asked for (a path is loaded as it is).
        another = len(self._roots) > 1 and self._root_of(directory) == 0
        fallback = auto or (step_asked and another)
        if fallback and all(is_damage(e) for e in failed.values()):
            why = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
            logger.warning(
                "safeckpt: step %d cannot be loaded (%s); falling back to %s",
                record.step,
                why,
                "the next copy (in the next root, or an older commit)" if another else "the commit before it",
            )
            return _SKIP, why
        if not self._ranks.distributed:
            assert error is not None
            raise error
        raise agreed_error(failed, what=what, step=record.step)

    def _fate(self, directory: Loc, record: Record, what: str) -> Fate:
        """Rank 0 looks whether ``directory`` still holds ``record``'s commit; every rank learns it."""
        mine = fate_of(directory, record) if self._ranks.is_leader else None
        if not self._ranks.distributed:
            assert mine is not None
            return mine
        return Fate(self._ranks.broadcast(mine and mine.value, self._ranks.control, what=what))

    # --- damaged checkpoints, moved aside ---------------------------------------------------

    def _damaged_at_choice(self, directory: Loc, record: Record | None, error: Exception) -> None:
        if record is not None:
            self._note_unloadable(directory, record, str(error))

    def _note_unloadable(self, directory: Loc, record: Record, reason: str) -> None:
        """Rank 0: auto-resume stepped over this commit; it no longer counts as the newest step."""
        if self._ranks.is_leader:
            self._damaged.note(directory, record, reason)

    def _move_aside_unloadable(self) -> None:
        """Collective, after an auto-resume that loaded a checkpoint or started fresh: rank 0, if
        it owns the root, moves what it stepped over to ``.damaged/``; every rank then takes rank
        0's view. Failure to move only warns: the steps stay out of the order check
        (:class:`DamagedCommits`) and are moved when this manager takes the root."""
        if self._ranks.is_leader:
            self._session.move_damaged_aside()
        self._outcomes.share_view(self._ranks.control, what="the checkpoints after a restore")


def _partly_filled(root: Path | str, steps: list[int]) -> IncompleteCheckpointError:
    return IncompleteCheckpointError(
        f"no checkpoint in {root} can be loaded: step(s) {', '.join(map(str, steps))} failed while "
        "being read (the warnings above say why), after filling part of the state in place, and no "
        "older commit loads. The state is not fresh: it holds part of a damaged checkpoint. Build it "
        "anew; to start from step 0, move the damaged step directories out of the root "
        "(`safeckpt verify` lists them).",
        path=str(root),
        step=steps[0],
    )


def _attempt(fn: Any, directory: Loc, record: Record, *args: Any) -> BaseException | None:
    try:
        fn(directory, record, *args)
    except DCP_ERRORS as e:
        return as_read_error(e, directory, record)
    return None
