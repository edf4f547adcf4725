"""Model and optimizer state dicts keyed by FQN, as DCP's helpers give them, without their setup per call.

``get_model_state_dict`` and ``get_optimizer_state_dict`` rebuild their view
of the model on every call (every module and parameter walked, FQN maps,
wrapper checks), a visible share of an async save's blocking time. For a
model they only rename (plain, DDP, ``torch.compile``, FSDP2: no FSDP1 state-dict
context), the answer depends on nothing but ``model.state_dict()``'s keys and
the optimizer's parameters. :class:`StateDicts` asks the helpers once, checks
that renaming ``model.state_dict()`` and ``optimizer.state_dict()`` gives the
same tensors under the same keys, and from then on renames, while the keys
and the parameters stay the same. Anything else (a changed structure, an
optimizer without state yet, FSDP1, a result that did not check out) goes to
the helpers, every time.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from .._util.torch_private import dtensor_local

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["StateDicts"]


@dataclass(frozen=True)
class _ModelRenames:
    keys: tuple[str, ...]
    """``model.state_dict()``'s keys when checked."""
    pairs: tuple[tuple[str, str], ...] | None
    """(key, FQN) in the helpers' order; None: every key is its own FQN, in the same order."""


@dataclass(frozen=True)
class _OptimizerRenames:
    model: weakref.ref[nn.Module]
    params: tuple[torch.Tensor, ...]
    """The optimizer's parameters, in param_groups order, when checked (the objects: an id can be
    reused by a new parameter once the old one is freed)."""
    fqns: tuple[str, ...]
    """The FQN of parameter index i of ``optimizer.state_dict()``."""


class StateDicts:
    """Cached ``get_model_state_dict`` / ``get_optimizer_state_dict`` for one manager's saves.

    Not thread-safe: ``save()`` calls it on the training thread. Holds the
    models and optimizers weakly (an optimizer's cached parameters strongly,
    as the optimizer itself does). A model or optimizer whose result did not
    check out once, or a model with FSDP1 modules (whose ``state_dict()``
    outside the helper's context gathers the full model), goes to the helpers
    from then on, without the check.
    """

    def __init__(self) -> None:
        self._models: weakref.WeakKeyDictionary[nn.Module, _ModelRenames] = weakref.WeakKeyDictionary()
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, _OptimizerRenames] = (
            weakref.WeakKeyDictionary()
        )
        self._helpers_only: weakref.WeakSet[Any] = weakref.WeakSet()
        self.hits = 0
        self.misses = 0

    def model(self, model: nn.Module) -> dict[str, Any]:
        """``get_model_state_dict(model)``."""
        known = self._models.get(model)
        if known is None and (model in self._helpers_only or _has_fsdp1(model)):
            self._helpers_only.add(model)
            self.misses += 1
            return get_model_state_dict(model)
        raw = model.state_dict()
        if known is not None and tuple(raw) == known.keys:
            self.hits += 1
            return raw if known.pairs is None else {fqn: raw[key] for key, fqn in known.pairs}
        self.misses += 1
        full = get_model_state_dict(model)
        renames = _model_renames(raw, full)
        if renames is not None:
            self._models[model] = renames
        else:
            self._models.pop(model, None)
            self._helpers_only.add(model)
        return full

    def optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``get_optimizer_state_dict(model, optimizer)``."""
        known = self._optimizers.get(optimizer)
        # An optimizer without state is given one by the helper (a zero step): left to it.
        if (
            known is not None
            and optimizer.state
            and known.model() is model
            and _same_objects(_params(optimizer), known.params)
        ):
            self.hits += 1
            return _renamed_optimizer(optimizer.state_dict(), known.fqns)
        self.misses += 1
        full = get_optimizer_state_dict(model, optimizer)
        if optimizer in self._helpers_only or model in self._helpers_only:
            return full
        renames = _optimizer_renames(model, optimizer, full)
        if renames is not None:
            self._optimizers[optimizer] = renames
        else:
            self._optimizers.pop(optimizer, None)
            self._helpers_only.add(optimizer)
        return full


def _params(optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, ...]:
    return tuple(p for group in optimizer.param_groups for p in group["params"])


def _same_objects(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _has_fsdp1(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _model_renames(raw: Mapping[str, Any], full: Mapping[str, Any]) -> _ModelRenames | None:
    """How ``full`` (the helper's result) follows from ``raw`` (``model.state_dict()``), if it does.

    The helper keeps a key that is its own FQN in place and moves a renamed one
    (a wrapper's ``module.`` or ``_orig_mod.`` dropped) to the end, in order.
    """
    if len(raw) != len(full):
        return None
    kept = [k for k in raw if k in full]
    moved = [k for k in raw if k not in full]
    targets = [k for k in full if k not in raw]
    if len(moved) != len(targets) or list(full) != kept + targets:
        return None
    pairs = tuple(zip(kept + moved, kept + targets, strict=True))
    if not all(_same(raw[key], full[fqn]) for key, fqn in pairs):
        return None
    return _ModelRenames(tuple(raw), None if not moved else pairs)


def _optimizer_renames(
    model: nn.Module, optimizer: torch.optim.Optimizer, full: Mapping[str, Any]
) -> _OptimizerRenames | None:
    """The index -> FQN map under which ``optimizer.state_dict()`` becomes ``full``, if there is one."""
    if not optimizer.state:
        return None
    raw = optimizer.state_dict()
    groups, named_groups = raw.get("param_groups"), full.get("param_groups")
    if not isinstance(groups, list) or not isinstance(named_groups, list) or len(groups) != len(named_groups):
        return None
    indices = list(itertools.chain.from_iterable(g.get("params", ()) for g in groups))
    names = list(itertools.chain.from_iterable(g.get("params", ()) for g in named_groups))
    if indices != list(range(len(indices))) or len(names) != len(indices):
        return None
    fqns = tuple(names)
    if not _same(_renamed_optimizer(raw, fqns), full):
        return None
    return _OptimizerRenames(weakref.ref(model), _params(optimizer), fqns)


def _renamed_optimizer(raw: Mapping[str, Any], fqns: Sequence[str]) -> dict[str, Any]:
    return {
        "state": {fqns[index]: value for index, value in raw["state"].items()},
        "param_groups": [
            {**group, "params": [fqns[i] for i in group["params"]]} for group in raw["param_groups"]
        ],
    }


def _same(a: Any, b: Any) -> bool:
    """The same structure, keys in the same order, tensors viewing the same memory, other values equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and _same_tensor(a, b)
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an odd value: not something to cache
        return False


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if DTensor is not None and isinstance(a, DTensor):
        assert isinstance(b, DTensor)
        if a.placements != b.placements or a.device_mesh != b.device_mesh or a.shape != b.shape:
            return False
        a, b = dtensor_local(a), dtensor_local(b)
    try:
        return (
            a.dtype == b.dtype
            and a.device == b.device
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr()
            and a.requires_grad == b.requires_grad
        )
    except Exception:  # no storage to compare (meta, a wrapper subclass): not something to cache
        return False
