"""The state walk: every tensor to DCP, the rest to JSON, no pickle.

A state is a mapping the user hands to ``save()`` and ``restore()``. The walk
visits it depth first, in insertion order:

* an ``nn.Module`` or ``Optimizer`` is expanded as the
  ``torch.distributed.checkpoint.state_dict`` helpers expand it (FQN-keyed, so
  optimizer moments load into a fresh optimizer and FSDP2 models reshard;
  cached, see :mod:`safeckpt._state.state_dicts`);
* any other object with ``state_dict()`` and ``load_state_dict()`` (DCP's
  ``Stateful`` protocol: schedulers, data loaders, torchtitan-style wrappers)
  is expanded with ``state_dict()``;
* ``dict`` (``str`` or ``int`` keys), ``list`` and ``tuple`` are walked into;
* every tensor leaf (plain, DTensor, any dtype, 0-dim, empty, non-contiguous,
  shared) goes to DCP under the key DCP's own flattening gives it
  (``"model.layers.0.weight"``), so plain ``dcp.load`` reads it;
* every other leaf is a JSON value of the train-state file (see
  :mod:`safeckpt._state.train_state`), which also records the container structure,
  so int keys, tuples and keys containing ``.`` come back as they were;
* a :func:`per_rank` value (a data loader's position, a rank's own
  generator) goes whole, tensors included, into the rank's own train-state
  file. DCP keeps one copy of a plain tensor for all ranks (it takes them for
  replicas), so a per-rank tensor sent there would come back as another
  rank's.

Two leaves whose DCP keys would collide (``{"a.b": x, "a": {"b": y}}``, or
``{1: x, "1": y}``) cannot share one DCP key: the later one gets its key
escaped (``%`` -> ``%25``, ``.`` -> ``%2E`` in each key, ``%i`` before an int
key, and a leading ``%`` where that alone changes nothing). Restore never
parses DCP keys; it follows the recorded structure.

The walk's result for one structure (DCP keys, the encoded tree) is cached in
a :class:`StateCache` and reused while the next save has the same structure,
which keeps the per-tensor cost of a 10,000-tensor state to a list append.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._dcp.nesting import nest_for_dcp
from .._util.torch_private import dtensor_local
from ..errors import UnsupportedStateError
from .per_rank import PerRank, is_stateful, per_rank
from .state_dicts import StateDicts
from .train_state import capture_rng, encode_train_state, encode_values, train_state_filename, unsupported

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]

__all__ = [
    "Captured",
    "PerRank",
    "StateCache",
    "capture",
    "display",
    "is_stateful",
    "module_for",
    "nest_for_dcp",
    "per_rank",
    "train_state_filename",
]

# Markers of the structure signature (see _collect); their positions are fixed by the walk.
_DICT, _LIST, _TUPLE, _MODULE, _OPTIM, _STATEFUL, _VALUE = "\0D", "\0L", "\0U", "\0M", "\0O", "\0S", "\0V"
_PER_RANK = "\0R"


def display(keys: tuple[Any, ...]) -> str:
    """A path as the user writes it in messages and ``include=``: ``model.layers.3.w``."""
    return ".".join(map(str, keys))


def module_for(optimizer: torch.optim.Optimizer, where: str, state: Mapping[Any, Any]) -> nn.Module:
    """The module in ``state`` (top level) that owns ``optimizer``'s parameters (the helpers need it)."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for value in state.values():
        if isinstance(value, nn.Module) and wanted <= {id(p) for p in value.parameters()}:
            return value
    raise UnsupportedStateError(
        f"{where} is an optimizer, but no nn.Module at the top level of the same state holds all "
        "of its parameters. Put the model in the state too (e.g. {'model': model, 'optim': optim}), "
        "so the optimizer is saved by parameter name and loads into a fresh optimizer; or pass "
        "optim.state_dict() instead."
    )


@dataclass
class Captured:
    """A state at ``save()`` time: the DCP part (live tensors, by DCP key) and the train-state file."""

    dcp: dict[str, torch.Tensor]
    encode_train_state: Callable[[], bytes]
    """The train-state file's bytes. What it holds is taken at ``save()`` (the values encoded, the
    RNG states read); the bytes are made when first asked for, on the writer thread."""
    modules: list[nn.Module] = field(default_factory=list)
    """The modules and optimizers found in the state (what overlapped staging hooks)."""
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)


@dataclass
class _Plan:
    signature: list[Any]
    fqns: list[str]
    value_paths: list[str]
    tree_json: str
    per_rank: bool
    """The tree has a ``per_rank`` value (the train-state file's format 3)."""


@dataclass
class StateCache:
    """The last structure's walk result, reused while saves keep that structure. One per manager.

    Not thread-safe: ``save()`` runs on the training thread only.
    """

    plan: _Plan | None = None
    hits: int = 0
    misses: int = 0
    state_dicts: StateDicts = field(default_factory=StateDicts)
    """Models' and optimizers' FQN-keyed state dicts (see :mod:`safeckpt._state.state_dicts`)."""


@dataclass
class _Collected:
    tensors: list[torch.Tensor] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)
    signature: list[Any] = field(default_factory=list)
    expanded: list[Any] = field(default_factory=list)  # state_dict() results, in walk order
    state_dicts: StateDicts = field(default_factory=StateDicts)
    modules: list[nn.Module] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)


def capture(state: Mapping[Any, Any], *, rng: bool, cache: StateCache | None = None) -> Captured:
    """Walk ``state`` and encode its non-tensor part (and the RNG states) now.

    The DCP part still references live tensors; the train-state bytes are a
    snapshot. Raises :class:`UnsupportedStateError` naming the path of a value
    that cannot be saved without pickle; nothing has been written then.
    """
    if not isinstance(state, Mapping):
        raise UnsupportedStateError(
            "state must be a dict of name -> model/optimizer/tensor/stateful/container/JSON value, "
            f"got {type(state).__name__}. Nothing was written."
        )
    got = _Collected(state_dicts=cache.state_dicts) if cache is not None else _Collected()
    try:
        _collect_mapping(state, got, state)
    except UnsupportedStateError as e:
        subject = e.__dict__.pop("subject", None)
        if subject is None:
            raise
        module_for(subject, display(_path_of(subject, state)), state)
        raise
    plan = cache.plan if cache is not None else None
    if plan is None or plan.signature != got.signature:
        plan = _describe(state, got)
        if cache is not None:
            cache.plan = plan
            cache.misses += 1
    elif cache is not None:
        cache.hits += 1
    tensors: dict[str, torch.Tensor] = {}  # per_rank() values' tensors, copied now
    values_json = encode_values(got.values, plan.value_paths, tensors)
    encode = functools.partial(
        encode_train_state,
        plan.tree_json,
        values_json,
        capture_rng() if rng else None,  # fresh copies: read now, encoded later
        tensors,
        per_rank=plan.per_rank,
    )
    return Captured(dict(zip(plan.fqns, got.tensors, strict=True)), encode, got.modules, got.optimizers)


# --- the fast walk: tensors, values and the structure signature ------------------------------


def _collect(value: Any, got: _Collected, root: Mapping[Any, Any]) -> None:
    if isinstance(value, torch.Tensor):
        got.tensors.append(value)
        got.signature.append(value.layout)
        return
    kind = type(value)
    if kind is dict:
        _collect_mapping(value, got, root)
    elif kind is list or kind is tuple:
        _collect_sequence(value, got, root)
    elif isinstance(value, PerRank):
        got.signature.append(_PER_RANK)
        got.values.append(value.saved())  # one value: its tensors go into the train-state file
    elif isinstance(value, nn.Module):
        got.signature.append(_MODULE)
        got.modules.append(value)
        expanded = got.state_dicts.model(value)
        got.expanded.append(expanded)
        _collect_mapping(expanded, got, root)
    elif isinstance(value, torch.optim.Optimizer):
        got.signature.append(_OPTIM)
        got.optimizers.append(value)
        # Where, for the error: the describing walk names the path; here it is not known.
        expanded = got.state_dicts.optimizer(_module_or_raise(value, root), value)
        got.expanded.append(expanded)
        _collect_mapping(expanded, got, root)
    elif is_stateful(value):
        got.signature.append(_STATEFUL)
        expanded = value.state_dict()
        got.expanded.append(expanded)
        _collect(expanded, got, root)
    elif isinstance(value, Mapping):
        _collect_mapping(value, got, root)
    elif isinstance(value, (list, tuple)):
        _collect_sequence(value, got, root)
    else:
        got.values.append(value)
        got.signature.append(_VALUE)


def _module_or_raise(optimizer: torch.optim.Optimizer, root: Mapping[Any, Any]) -> nn.Module:
    try:
        return module_for(optimizer, "", root)
    except UnsupportedStateError as e:
        e.subject = optimizer  # capture() finds its path (only on this error path)
        raise


def _path_of(target: Any, value: Any, keys: tuple[Any, ...] = ()) -> tuple[Any, ...]:
    if value is target:
        return keys
    items: Any = ()
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    for k, v in items:
        found = _path_of(target, v, (*keys, k))
        if found:
            return found
    return ()


def _collect_mapping(value: Mapping[Any, Any], got: _Collected, root: Mapping[Any, Any]) -> None:
    signature, tensors = got.signature, got.tensors
    keys = tuple(value)  # the keys, and their types, each in one entry: built in C, not per key
    signature.append(_DICT)
    signature.append(keys)
    signature.append(tuple(map(type, keys)))  # 1, 1.0 and True are equal keys, but only 1 is a valid one
    for v in value.values():
        if isinstance(v, torch.Tensor):  # inlined: the common leaf of a large state
            tensors.append(v)
            signature.append(v.layout)
        else:
            _collect(v, got, root)


def _collect_sequence(value: list[Any] | tuple[Any, ...], got: _Collected, root: Mapping[Any, Any]) -> None:
    got.signature.append(_TUPLE if isinstance(value, tuple) else _LIST)
    got.signature.append(len(value))
    for v in value:
        _collect(v, got, root)


# --- the describing walk (once per structure): keys, checks, the tree ---------------------------


class _Describer:
    def __init__(self, expanded: list[Any], root: Mapping[Any, Any]) -> None:
        self.expanded: Iterator[Any] = iter(expanded)
        self.root = root
        self.fqns: list[str] = []
        self.owners: dict[str, tuple[Any, ...]] = {}
        self.value_paths: list[str] = []
        self.per_rank = False

    def node(self, value: Any, keys: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            _check_tensor(value, display(keys))
            return {"T": self._fqn(keys)}
        kind = type(value)
        if kind is dict:
            return self.mapping(value, keys)
        if kind is list or kind is tuple:
            return self.sequence(value, keys)
        if isinstance(value, PerRank):
            self.per_rank = True
            self.value_paths.append(display(keys) or "state")
            return {"R": len(self.value_paths) - 1}
        if isinstance(value, nn.Module):
            return {"M": self.mapping(next(self.expanded), keys)}
        if isinstance(value, torch.optim.Optimizer):
            module_for(value, display(keys), self.root)  # the error, now with its path
            return {"O": self.mapping(next(self.expanded), keys)}
        if is_stateful(value):
            return {"S": self.node(next(self.expanded), keys)}
        if isinstance(value, Mapping):
            return self.mapping(value, keys)
        if isinstance(value, (list, tuple)):
            return self.sequence(value, keys)
        self.value_paths.append(display(keys) or "state")
        return {"V": len(self.value_paths) - 1}

    def mapping(self, value: Mapping[Any, Any], keys: tuple[Any, ...]) -> Any:
        items = []
        for k, v in value.items():
            if not (isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool))):
                where = f"{display(keys)} has" if keys else "the state has"
                raise UnsupportedStateError(
                    f"{where} a key {k!r} of type {type(k).__name__}; keys must be str or int, so "
                    "that the checkpoint stays readable without pickle. Convert the key (e.g. "
                    "str(key)) in your state_dict(). Nothing was written."
                )
            items.append([int(k) if not isinstance(k, str) else k, self.node(v, (*keys, k))])
        return {"D": items}

    def sequence(self, value: list[Any] | tuple[Any, ...], keys: tuple[Any, ...]) -> Any:
        nodes = [self.node(v, (*keys, i)) for i, v in enumerate(value)]
        return {"U": nodes} if isinstance(value, tuple) else {"L": nodes}

    def _fqn(self, keys: tuple[Any, ...]) -> str:
        fqn = display(keys)
        if fqn in self.owners:
            # DCP's flattening collides here: escape each key, and mark the key escaped with a
            # leading '%' where escaping alone changes nothing (no '.', '%' or int key in the path).
            escaped = ".".join(map(escape_key, keys))
            fqn = escaped if escaped not in self.owners else "%" + escaped
            if fqn in self.owners:
                raise UnsupportedStateError(
                    f"{display(keys)} and {display(self.owners[fqn])} would be stored under the "
                    f"same DCP key {fqn!r}. Rename one of them. Nothing was written."
                )
        self.owners[fqn] = keys
        self.fqns.append(fqn)
        return fqn


def escape_key(key: Any) -> str:
    """One key as an escaped segment of a DCP key (used where DCP's own flattening collides)."""
    if not isinstance(key, str):
        return f"%i{key}"
    return key.replace("%", "%25").replace(".", "%2E")


def _check_tensor(tensor: torch.Tensor, where: str) -> None:
    local = dtensor_local(tensor) if DTensor is not None and isinstance(tensor, DTensor) else tensor
    if local.layout != torch.strided:
        raise unsupported(tensor, where, f" with layout {local.layout}")
    if local.is_quantized or local.is_nested or local.device.type == "meta":
        kind = "quantized" if local.is_quantized else "nested" if local.is_nested else "meta"
        raise unsupported(tensor, where, f" ({kind})")


def _describe(state: Mapping[Any, Any], got: _Collected) -> _Plan:
    describer = _Describer(got.expanded, state)
    tree = describer.mapping(state, ())
    # The top level is a dict by contract; the file keeps it as an object of its items.
    return _Plan(
        signature=got.signature,
        fqns=describer.fqns,
        value_paths=describer.value_paths,
        tree_json=json.dumps(tree),
        per_rank=describer.per_rank,
    )
