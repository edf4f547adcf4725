"""A checkpoint's state back without a template: ``safeckpt.load``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .._dcp import io as dcp_io
from .._dcp import safe_metadata
from .._dist.failures import storage_error
from .._format.layout import RECORD_NAME, Layout
from .._state.train_state import Legacy, read_tree
from .._store.loc import Loc, as_loc, as_root
from .._store.registry import check_root, open_store
from .._util.gc_pause import collector_paused
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    UnsupportedStateError,
)
from .choose import read_chosen
from .load_plan import LoadPlan, Selection
from .put_back import ABSENT


@collector_paused()  # thousands of small objects: see safeckpt._util.gc_pause
@safe_metadata.parsed_kept()  # chosen, verified and read: .metadata parsed once
def load(
    root_or_checkpoint_dir: Loc | str | os.PathLike[str],
    *,
    step: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[Any, Any]:
    """A checkpoint's state as nested dicts, lists and tuples of CPU tensors and plain values.

    On a run root: the checkpoint auto-resume would take (or ``step``); on a
    ``step_<N>`` directory: that one. Keys keep their types (int keys, tuples),
    tensors their dtypes, and sharded tensors come back whole. Modules come
    back as their ``state_dict()``, optimizers as the FQN-keyed dict of
    ``get_optimizer_state_dict`` (load it with ``set_optimizer_state_dict``),
    ``Stateful`` objects as their ``state_dict()``. Verified like ``restore``
    (committed, files as recorded, checksums) and pickle-free, and chosen as
    auto-resume chooses: damage found while reading the newest checkpoint falls
    back to the one before (an explicit ``step`` or directory raises it), and a
    checkpoint replaced or pruned while it is read is chosen anew. Not
    collective: each caller reads the whole checkpoint. Raises
    :class:`~safeckpt.CheckpointNotFoundError` when there is nothing to load.
    ``storage_options`` are the settings of a URL root (see ``CheckpointManager``).
    """
    if storage_options is not None and not isinstance(root_or_checkpoint_dir, Loc):
        root_or_checkpoint_dir = Loc(open_store(root_or_checkpoint_dir, options=storage_options))
    top = as_root(root_or_checkpoint_dir)
    try:
        check_root(top.store, writing=False)  # a file, or under one: said so, not "nothing to load"
        return _load(top, step)
    except OSError as e:  # the storage's own failure (the checkpoint's are CheckpointErrors)
        if isinstance(e, CheckpointError):
            raise
        raise storage_error(top, e, doing=f"load({top})") from e


def _load(top: Loc, step: int | None) -> dict[Any, Any]:
    given: Loc | None = None
    if (top / RECORD_NAME).entry() is not None:
        if step is not None:
            raise ConfigError(f"load({top}): a checkpoint directory takes no step=; pass the run root.")
        given = top if top.key else as_loc(top.where)  # the checkpoint, as a name in its root
        top = given.parent
    path = top

    def nothing() -> CheckpointNotFoundError:
        return CheckpointNotFoundError(
            f"there is no complete checkpoint in {path} to load. Pass a run root or a step_<N> "
            "directory that `safeckpt ls` lists.",
            path=str(path),
        )

    return read_chosen(Layout(top), step, given, _load_template_free, nothing=nothing)


class _TemplateNeededError(IncompleteCheckpointError, UnsupportedStateError):
    """A whole checkpoint that only a restore into a template can read: not damage, so no
    fallback past it (an ``UnsupportedStateError`` is never stepped over)."""


def _load_template_free(directory: Loc, record: Any) -> dict[Any, Any]:
    metadata = safe_metadata.read_metadata(directory, record=record)
    tree, _ = read_tree(directory, record, None)
    if isinstance(tree, Legacy):
        raise _TemplateNeededError(
            f"{directory} was written by safeckpt 0.1, whose files safeckpt.load cannot rebuild "
            "without a template; restore it into your model and optimizer with "
            "CheckpointManager.restore.",
            path=str(directory),
        )
    plan = LoadPlan(metadata.state_dict_metadata, Selection(None, None), {})
    loaded = plan.plan(ABSENT, tree, ())
    if plan.damage:
        raise IncompleteCheckpointError(
            f"{directory} is damaged: {'; '.join(plan.damage[:5])}. Load another checkpoint.",
            path=str(directory),
        )
    if plan.dcp:
        dcp_io.load_flat(plan.dcp, directory, None, record=record, metadata=metadata)
    return plan.apply(ABSENT, loaded, step=record.step, path=str(directory))
