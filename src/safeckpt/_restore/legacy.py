"""Restoring checkpoints written before the state walk (train-state format 1, safeckpt 0.1).

Those checkpoints kept only top-level modules, optimizers and tensors in DCP
(keyed ``<top-level key>.<fqn>``) and everything else, stateful objects
included, as JSON ``entries``. They load the way they were written, so a run
that upgrades safeckpt resumes instead of starting over. Template-free
:func:`safeckpt.load` does not read them (their optimizer structure lives in
DCP's flattened keys only).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .._dcp import io as dcp_io
from .._dcp import safe_metadata
from .._dist.participants import Participants
from .._format.record import Record
from .._state.walk import module_for
from .._store.loc import Loc
from ..errors import IncompleteCheckpointError, UnsupportedStateError
from .choose import cut_off

logger = logging.getLogger(__name__)


def load_legacy(
    caller_state: MutableMapping[Any, Any],
    directory: Loc,
    record: Record,
    ranks: Participants,
    entries: Mapping[str, Any],
    *,
    strict: bool,
    wanted: Callable[[tuple[Any, ...]], bool] = lambda keys: True,
) -> tuple[str, ...]:
    """Load a format-1 checkpoint into ``caller_state`` in place; the missing top-level keys.

    ``wanted``: which top-level keys to load (``include=``/``exclude=`` apply to
    top-level keys only here). Collective over ``ranks.control`` (agreement,
    then ``dcp.load``).
    """
    state = {k: v for k, v in caller_state.items() if wanted((k,))}  # the caller's objects
    error: BaseException | None = None
    dcp_part: dict[str, Any] = {}
    apply: list[Callable[[], object]] = []
    missing: list[str] = []
    try:
        metadata = safe_metadata.read_metadata(directory, record=record)
        saved = {fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata}
        for key, value in state.items():
            in_dcp = isinstance(value, (nn.Module, torch.optim.Optimizer, torch.Tensor))
            if (in_dcp and key not in saved) or (not in_dcp and key not in entries):
                missing.append(str(key))
        if missing and strict:
            raise UnsupportedStateError(
                f"step {record.step} in {directory} has no entry for {missing}, which the state "
                "passed to restore() has. Restore with strict=False to load what is there and "
                "leave these as they are.",
                step=record.step,
                path=str(directory),
            )
        for key, value in state.items():
            if key not in saved:
                continue
            if isinstance(value, nn.Module):
                dcp_part[key] = get_model_state_dict(value)
                apply.append(functools.partial(_load_module, value, dcp_part, key))
            elif isinstance(value, torch.optim.Optimizer):
                module = module_for(value, str(key), caller_state)
                dcp_part[key] = get_optimizer_state_dict(module, value)
                apply.append(functools.partial(_load_optimizer, module, value, dcp_part, key))
            elif isinstance(value, torch.Tensor):
                dcp_part[key] = value
    except Exception as e:
        error = e
    ranks.agree(error, ranks.control, what=f"matching step {record.step} against the state", step=record.step)
    logger.info("safeckpt: step %d was written by safeckpt 0.1 (train-state format 1)", record.step)
    if dcp_part or ranks.distributed:
        try:
            dcp_io.load(dcp_part, directory, ranks.control)
        except CheckpointException as e:
            storage = cut_off(e, directory, record)  # the storage's failure: never damage
            if storage is not None:
                raise storage from e
            raise IncompleteCheckpointError(
                f"loading step {record.step} from {directory} failed: {e}. Restore another step.",
                step=record.step,
                path=str(directory),
            ) from e
    for action in apply:
        action()
    for key, entry in entries.items():
        if key in state:
            if entry["kind"] == "stateful":
                state[key].load_state_dict(entry["state"])
            else:
                caller_state[key] = entry["value"]
    return tuple(missing)


# Each reads its value from ``loaded`` when called: after DCP has filled it in.
def _load_module(module: nn.Module, loaded: dict[str, Any], key: str) -> None:
    set_model_state_dict(module, loaded[key])


def _load_optimizer(
    module: nn.Module, optimizer: torch.optim.Optimizer, loaded: dict[str, Any], key: str
) -> None:
    set_optimizer_state_dict(module, optimizer, loaded[key])
