"""Resuming on every rank: rank 0 chooses, every rank checks its own files, all load or fall back.

The restore half of :class:`~safeckpt.manager.CheckpointManager`: auto-resume
takes the newest commit that every rank can load, stepping over a damaged one
on every rank together; an explicit step raises the same error on every rank.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from . import dcp_io
from .arguments import validate_or_none
from .collector import collector_paused
from .distributed import Participants, agreed_error
from .distributed import portable as _portable
from .errors import IncompleteCheckpointError
from .layout import Layout
from .loading import load as load_state
from .record import Record
from .restore import SKIPPABLE, check_own_files, choose_checkpoint, load_checkpoint
from .restored import Restored

logger = logging.getLogger("safeckpt.manager")

_WRITE_ERRORS = (Exception, CheckpointException)


class ResumePath:
    """The restore half of a manager: which checkpoint every rank loads, and loading it."""

    root: Path
    save_rng: bool
    _parts: Participants
    _layout: Layout
    _check_open: Callable[[], None]
    _conclude: Callable[..., Any]

    @collector_paused()  # the record's and the plan's objects too, not only DCP's: see safeckpt.collector
    @dcp_io.parsed_kept()  # chosen, verified, checked per rank and read: .metadata parsed once
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
        """Load a checkpoint into ``state`` in place; return what was loaded, the same on every rank.

        The :class:`Restored` result carries the step, path, metrics, extra and
        record; it is falsy (``.step is None``) when there was nothing to restore,
        so ``start = (r := mgr.restore(state)).step or 0`` starts a loop.

        With neither ``step`` nor ``path``: the checkpoint ``latest`` names if it
        is committed and complete, else the newest complete one (with a warning);
        nothing, and ``state`` untouched, when there is none. An explicit ``step`` or
        ``path`` is loaded as is, or raises if it is missing or broken. Rank 0
        decides which checkpoint, and every rank loads that one. ``strict``: every
        key of ``state`` must be in the checkpoint and vice versa (else the result
        lists what did not match). ``include``/``exclude``: dotted paths
        (``"model"``, ``"optim.state"``) to load only, or to leave out (RNG states
        are then left alone); see ``docs/state.md``.
        """
        self._check_open()
        parts = self._parts
        auto = step is None and path is None
        excluded: set[int] = set()
        filled: list[int] = []  # steps that failed while being read, after filling part of the state
        try:
            while True:
                choice = self._choose(validate_or_none(step), path, excluded)
                if choice is None:
                    if filled:  # not a fresh start: the state holds part of a damaged checkpoint
                        break
                    logger.info("safeckpt: nothing to resume in %s; starting from step 0", self.root)
                    return Restored()
                directory, record = choice
                what = f"restore of step {record.step}"
                # Each rank checks its own files first, so one rank's damaged file is the same error on
                # every rank within seconds (not a timeout in DCP's collective), or a fallback for all.
                own = _attempt(check_own_files, directory, record, parts.rank)
                if self._skip_or_raise(own, what, record, auto):
                    excluded.add(record.step)
                    continue
                report: Any = None
                load_error: BaseException | None = None
                began: list[bool] = []  # the state started to change (load_checkpoint's filling)
                try:
                    report = load_checkpoint(
                        state,
                        directory,
                        record,
                        parts,
                        strict=strict,
                        with_rng=self.save_rng,
                        include=include,
                        exclude=exclude,
                        filling=functools.partial(began.append, True),
                    )
                except _WRITE_ERRORS as e:
                    load_error = e
                try:
                    skip = self._skip_or_raise(load_error, what, record, auto)
                except BaseException:
                    if began:  # an explicit step's error, too, says the state is no longer as it was
                        filled.append(record.step)
                    raise
                if skip:
                    excluded.add(record.step)
                    if began:
                        filled.append(record.step)
                    continue
                self._conclude(None, what=what, step=record.step)
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
                    record, directory, missing=missing, unexpected=tuple(getattr(report, "unexpected", ()))
                )
        except Exception as e:  # a later attempt's error, or a refusal to fall back
            if filled:
                e.add_note(
                    f"safeckpt: the state is not as it was: step {filled[0]} filled part of it in place "
                    "before its damage was found. Build it anew before training on it."
                )
            raise
        raise _partly_filled(self.root, filled)

    def load(self, step: int | None = None) -> dict[Any, Any]:
        """This root's checkpoint (the one ``restore`` would take, or ``step``) without a template.

        See :func:`safeckpt.load`. Not collective: each rank that calls it reads
        the whole checkpoint.
        """
        self._check_open()
        return load_state(self.root, step=validate_or_none(step))

    def _choose(
        self, step: int | None, path: str | os.PathLike[str] | None, excluded: set[int]
    ) -> tuple[Path, Record] | None:
        """Rank 0 chooses; every rank gets the same choice, or the same error."""
        parts = self._parts
        if not parts.distributed:  # nothing to send: the record as read (no round trip through JSON)
            return choose_checkpoint(self._layout, step, path, exclude=excluded)
        choice: tuple[str, dict[str, Any]] | None = None
        error: BaseException | None = None
        if parts.is_leader:
            try:
                found = choose_checkpoint(self._layout, step, path, exclude=excluded)
                choice = None if found is None else (str(found[0]), found[1].to_json())
            except Exception as e:
                error = e
        choice, error = parts.broadcast(
            (choice, _portable(error)), parts.control, what="choosing the checkpoint to restore"
        )
        if error is not None:
            raise error
        if choice is None:
            return None
        directory = Path(choice[0])
        return directory, Record.from_json(choice[1], path=str(directory))

    def _skip_or_raise(self, error: BaseException | None, what: str, record: Record, auto: bool) -> bool:
        """Agree on ``error``: False if every rank succeeded; True to fall back (auto-resume past
        damage); else raise the same error on every rank."""
        gathered = self._parts.gather(_portable(error), self._parts.control, what=what)
        failed = {rank: e for rank, e in enumerate(gathered) if e is not None}
        if not failed:
            return False
        if auto and all(isinstance(e, SKIPPABLE) for e in failed.values()):
            logger.warning(
                "safeckpt: step %d cannot be loaded (%s); falling back to the commit before it",
                record.step,
                "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items())),
            )
            return True
        if not self._parts.distributed:
            assert error is not None
            raise error
        raise agreed_error(failed, what=what, step=record.step)


def _partly_filled(root: Path, steps: list[int]) -> IncompleteCheckpointError:
    return IncompleteCheckpointError(
        f"no checkpoint in {root} can be loaded: step(s) {', '.join(map(str, steps))} failed while "
        "being read (the warnings above say why), after filling part of the state in place, and no "
        "older commit loads. The state is not fresh: it holds part of a damaged checkpoint. Build it "
        "anew; to start from step 0, move the damaged step directories out of the root "
        "(`safeckpt verify` lists them).",
        path=str(root),
        step=steps[0],
    )


def _attempt(fn: Any, *args: Any) -> BaseException | None:
    try:
        fn(*args)
    except _WRITE_ERRORS as e:
        return e
    return None
