"""Loading the chosen checkpoint into a state, in place, on every rank (one collective load).

Rank 0 chooses (:mod:`safeckpt._restore.choose`); every rank then calls
:func:`load_checkpoint` on that directory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from .._dcp import io as dcp_io
from .._dcp import options as io_options
from .._dcp import safe_metadata
from .._dist.participants import Participants
from .._format.record import Record
from .._state.train_state import Legacy, read_tree, restore_rng
from .._store.loc import Loc
from .._util.gc_pause import collector_paused
from ..errors import IncompleteCheckpointError, UnsupportedStateError
from .choose import cut_off
from .legacy import load_legacy
from .load_plan import LoadPlan, LoadReport, Selection

logger = logging.getLogger(__name__)


@collector_paused()  # thousands of small objects: see safeckpt._util.gc_pause
def load_checkpoint(
    state: MutableMapping[Any, Any],
    directory: Loc,
    record: Record,
    ranks: Participants,
    *,
    strict: bool,
    with_rng: bool,
    include: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    filling: Callable[[], None],
) -> LoadReport:
    """Load ``directory`` into ``state`` in place; what was left alone. Collective over ``ranks.control``.

    All or nothing: the whole state is matched against the checkpoint first
    (missing and unexpected paths, shapes, dtypes), and every rank agrees on
    the outcome before DCP reads a byte or anything of ``state`` changes.
    ``strict``: a missing or unexpected path raises, naming it; else it is
    reported and logged. ``include``/``exclude``: dotted paths to load only
    (``["model"]``) or to leave out (``["optim"]``); RNG states are restored
    only when neither is given. Raises :class:`UnsupportedStateError` for a
    value that cannot be loaded into what ``state`` holds. ``filling`` is
    called once the state starts to change: an error after it (damaged bytes
    found while reading) leaves part of the state filled.
    """
    # the disk works while this plans
    done_reading = directory.store.dcp_prefetch(
        directory.key, ranks.rank, direct_io=io_options.current().direct_io
    )
    try:
        return _load_checkpoint(
            state,
            directory,
            record,
            ranks,
            strict=strict,
            with_rng=with_rng,
            include=include,
            exclude=exclude,
            filling=filling,
        )
    finally:
        done_reading()


def _load_checkpoint(
    state: MutableMapping[Any, Any],
    directory: Loc,
    record: Record,
    ranks: Participants,
    *,
    strict: bool,
    with_rng: bool,
    include: Iterable[str] | None,
    exclude: Iterable[str] | None,
    filling: Callable[[], None],
) -> LoadReport:
    selection = Selection(include, exclude)
    error: BaseException | None = None
    plan: LoadPlan | None = None
    loaded: Any = None
    tree: Any = None
    rng: Any = None
    metadata: Any = None
    try:
        metadata = safe_metadata.read_metadata(directory, record=record)
        tree, rng = read_tree(directory, record, ranks.rank)
        if rng is None and record.world_size > 1:
            logger.warning(
                "safeckpt: step %d was saved by %d rank(s); rank %d loads the merged training state "
                "of those ranks and keeps its own RNG state",
                record.step,
                record.world_size,
                ranks.rank,
            )
        if not isinstance(tree, Legacy):
            plan = LoadPlan(metadata.state_dict_metadata, selection, state)
            loaded = plan.mapping(state, tree)
            _check_plan(plan, record, directory, strict=strict)
            if plan.per_rank and ranks.is_leader and record.world_size > ranks.world_size:
                gone = ranks.world_size, record.world_size - 1
                logger.warning(
                    "safeckpt: step %d was saved by %d ranks and is restored by %d: what %s held "
                    "per_rank (%s) is restored to no rank; each rank here continues from its own",
                    record.step,
                    record.world_size,
                    ranks.world_size,
                    f"rank {gone[0]}" if gone[0] == gone[1] else f"ranks {gone[0]}-{gone[1]}",
                    _listing(plan.per_rank),
                )
    except Exception as e:
        error = e
    if error is None and isinstance(tree, Legacy):
        filling()
        missing = load_legacy(
            state, directory, record, ranks, tree.entries, strict=strict, wanted=selection.wanted
        )
        if with_rng and selection.everything and rng is not None:
            restore_rng(rng)
        return LoadReport(missing=missing)
    ranks.agree(error, ranks.control, what=f"matching step {record.step} against the state", step=record.step)
    assert plan is not None
    filling()
    if plan.dcp or ranks.distributed:  # collective: every rank takes part, even with nothing to read
        try:
            dcp_io.load_flat(plan.dcp, directory, ranks.control, record=record, metadata=metadata)
        except CheckpointException as e:
            storage = cut_off(e, directory, record)  # the storage's failure: never damage
            if storage is not None:
                raise storage from e
            raise IncompleteCheckpointError(
                f"loading step {record.step} from {directory} failed: {e}. Restore another step.",
                step=record.step,
                path=str(directory),
            ) from e
    plan.apply(state, loaded, step=record.step, path=str(directory))
    if with_rng and selection.everything and rng is not None:
        restore_rng(rng)
    return plan.report()


def _check_plan(plan: LoadPlan, record: Record, directory: Loc, *, strict: bool) -> None:
    where = f"step {record.step} in {directory}"
    if plan.damage:
        raise IncompleteCheckpointError(
            f"{where} is damaged: {'; '.join(plan.damage[:5])}. Restore another step.",
            step=record.step,
            path=str(directory),
        )
    if plan.problems:
        raise UnsupportedStateError(
            f"{where} cannot be loaded into this state: {'; '.join(plan.problems[:10])}"
            f"{' (and more)' if len(plan.problems) > 10 else ''}. Restore into a state of the "
            "saved shapes and dtypes (convert after loading), or leave these out with exclude=. "
            "Nothing was changed.",
            step=record.step,
            path=str(directory),
        )
    if plan.no_per_rank:
        logger.warning(
            "safeckpt: step %d was saved by %d rank(s), and this rank was not one of them: %s "
            "(per_rank) keep their current values",
            record.step,
            record.world_size,
            _listing(plan.no_per_rank),
        )
    if not (plan.missing or plan.unexpected):
        return
    differences = []
    if plan.missing:
        differences.append(f"the checkpoint lacks {_listing(plan.missing)}, which the state has")
    if plan.unexpected:
        differences.append(f"the checkpoint has {_listing(plan.unexpected)}, which the state lacks")
    if strict:
        raise UnsupportedStateError(
            f"{where} does not match the state: {'; '.join(differences)}. Restore with strict=False to "
            "load what matches (the result lists the rest), or choose parts with include=/exclude=. "
            "Nothing was changed.",
            step=record.step,
            path=str(directory),
        )
    logger.warning("safeckpt: restoring %s with strict=False: %s", where, "; ".join(differences))


def _listing(paths: list[str], limit: int = 10) -> str:
    shown = ", ".join(repr(p) for p in paths[:limit])
    return f"[{shown}{', ...' if len(paths) > limit else ''}] ({len(paths)})"
