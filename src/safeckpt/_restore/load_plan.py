"""A checkpoint's state back: into the caller's objects in place, or without a template.

Both follow the structure recorded in the train-state file (never the DCP
keys), so int keys, tuples and keys containing ``.`` come back as saved.

Loading into a state is two phases. :class:`LoadPlan` matches the state
against the checkpoint and touches nothing of the caller's: it collects the
tensors DCP fills (the caller's own, in place; DTensors reshard to their
current mesh), what is missing or unexpected, and what cannot be loaded.
Only after every rank agreed that the plan is sound does DCP read, and
:meth:`LoadPlan.apply` put the values, modules, optimizers and ``Stateful``
objects in place.

A list or dict the state holds at several paths (a ``SequentialLR``'s
``_last_lr`` is its first scheduler's) is filled in place through the first
path only; each later path gets a copy holding what was saved there, unless
that is what the first path put (then the one object stays). Filled once per
path, it would leave every path with the last path's values. Tensors are
filled in place wherever they sit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .._state.per_rank import PerRank, is_stateful
from .._state.walk import display, module_for
from ..errors import UnsupportedStateError
from .put_back import ABSENT, Map, Seq, Shared, copy_into, fill_in, put_per_rank, unwrapped

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


@dataclass(frozen=True)
class LoadReport:
    """What a restore left alone: paths (``model.layers.3.w``) the state has and the checkpoint
    lacks (``missing``), and paths the checkpoint has and the state lacks (``unexpected``)."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()


class Selection:
    """Which paths to load: under one of ``include`` (all when None) and under none of ``exclude``.

    A path is its keys joined by ``.`` (``"model"``, ``"optim.state"``,
    ``"model.layers.0.weight"``); an entry selects that path and everything under it.
    """

    def __init__(self, include: Iterable[str] | None, exclude: Iterable[str] | None) -> None:
        self.include = None if include is None else tuple(_dotted(p, "include") for p in include)
        self.exclude = tuple(_dotted(p, "exclude") for p in exclude or ())
        self.everything = self.include is None and not self.exclude

    def wanted(self, keys: tuple[Any, ...]) -> bool:
        if self.everything:
            return True
        path = display(keys)
        if any(path == e or path.startswith(e + ".") for e in self.exclude):
            return False
        if self.include is None:
            return True
        return any(path == i or path.startswith(i + ".") or i.startswith(path + ".") for i in self.include)


def _dotted(path: Any, name: str) -> str:
    if not isinstance(path, str) or not path:
        from ..errors import ConfigError

        raise ConfigError(f"{name}= takes dotted paths such as 'model' or 'optim.state', got {path!r}.")
    return path


class LoadPlan:
    """How one checkpoint's state lands in a target state (see the module docstring).

    ``meta``: DCP's ``state_dict_metadata``; ``root``: the top-level state
    (optimizers find their module there).
    """

    def __init__(self, meta: Mapping[str, Any], selection: Selection, root: Mapping[Any, Any]) -> None:
        self.meta = meta
        self.selection = selection
        self.root = root
        self.dcp: dict[str, torch.Tensor] = {}
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.problems: list[str] = []
        self.damage: list[str] = []
        self.no_per_rank: list[str] = []  # per_rank() values this rank has none saved for (left as is)
        self.per_rank: list[str] = []  # per_rank() values this rank loads its own saved values into
        self._actions: list[tuple[str, Callable[[], object]]] = []  # (the value's path, what loads it)
        self._shared = Shared()

    def report(self) -> LoadReport:
        return LoadReport(tuple(self.missing), tuple(self.unexpected))

    def plan(self, target: Any, node: Any, keys: tuple[Any, ...], full: bool = False) -> Any:
        """The value to put at ``keys`` (the target itself where it is filled in place)."""
        if type(node) is dict and len(node) == 1 and "T" in node and isinstance(target, torch.Tensor):
            return self._tensor(target, node["T"], keys, full)  # most of a state: first, and short
        if isinstance(target, PerRank):
            return self._per_rank(target, node, keys, full)
        if target is not ABSENT and not isinstance(target, (torch.Tensor, Mapping, list, tuple)):
            if isinstance(target, nn.Module):
                return self._module(target, node, keys)
            if isinstance(target, torch.optim.Optimizer):
                return self._optimizer(target, node, keys)
            if is_stateful(target):
                return self._stateful(target, node, keys)
        if not isinstance(node, dict) or len(node) != 1:
            self.damage.append(f"{display(keys) or 'the state'} has a malformed entry {node!r}")
            return target
        ((tag, body),) = node.items()
        if tag == "R" and body is None:
            self.no_per_rank.append(display(keys) or "the state")
            return target
        if tag in ("M", "O", "S", "R"):  # saved from an object: its state dict loads into a dict too
            return self.plan(target, body, keys, full)
        if tag in _KINDS and _kind(target) not in ("absent", "value", _KINDS[tag]):
            # A tensor where the state has a dict (or the other way round) is not a value to
            # overwrite: the state expects something else there.
            self.problems.append(
                f"{display(keys) or 'the state'} is a {_KINDS[tag]} in the checkpoint but a "
                f"{_kind(target)} in the state"
            )
            return target
        if tag == "T":
            return self._tensor(target, body, keys, full)
        if tag == "t":
            return self._saved_tensor(target, body, keys, full)
        if tag == "v":
            if isinstance(target, torch.Tensor):
                self.problems.append(
                    f"{display(keys)} is a tensor in the state but a {type(body).__name__} in the checkpoint"
                )
            return body
        if tag == "D":
            return self._mapping(target, body, keys, full)
        if tag in ("L", "U"):
            return self._sequence(target, body, keys, full, tag == "U")
        self.damage.append(f"{display(keys) or 'the state'} has an unknown entry kind {tag!r}")
        return target

    def mapping(self, target: Mapping[Any, Any], tree: Any) -> Any:
        """Plan the whole state (the top-level tree node)."""
        return self.plan(target, tree, ())

    def apply(self, state: Any, loaded: Any, *, step: int, path: str) -> Any:
        """Put everything in place (after DCP filled :attr:`dcp`). Returns the new top-level value.

        A value that refuses what it saved (its own ``load_state_dict`` raises) is an
        :class:`UnsupportedStateError` naming it, which says the state is partly loaded: DCP
        has filled the state's tensors in place by then, and nothing can take that back.
        """
        result = fill_in(state, loaded, self._shared)
        for where, action in self._actions:
            try:
                action()
            except Exception as e:
                raise UnsupportedStateError(
                    f"step {step} in {path}: loading {where} raised {type(e).__name__}: {e}. The state's "
                    "tensors were filled in place already, so the state now holds part of this checkpoint: "
                    f"build it anew before training on it, or make {where} take what it saved and restore "
                    "again.",
                    step=step,
                    path=path,
                ) from e
        return result

    def _later(self, keys: tuple[Any, ...], action: Callable[[], object]) -> None:
        """``action`` loads the value at ``keys`` once DCP has read (in :meth:`apply`, in order)."""
        self._actions.append((display(keys) or "the state", action))

    # --- by kind of target ----------------------------------------------------------

    def _saved_dict(self, node: Any, keys: tuple[Any, ...], what: str) -> bool:
        """Whether ``node`` is a state dict (what a module or optimizer loads); a problem if not."""
        while isinstance(node, dict) and len(node) == 1 and next(iter(node)) in ("M", "O", "S"):
            node = next(iter(node.values()))
        if isinstance(node, dict) and "D" in node:
            return True
        self.problems.append(f"{display(keys)} is {what} in the state but not a state dict in the checkpoint")
        return False

    def _module(self, module: nn.Module, node: Any, keys: tuple[Any, ...]) -> Any:
        if not self._saved_dict(node, keys, "a module"):
            return module
        template = get_model_state_dict(module)
        loaded = self.plan(template, node, keys)
        self._later(keys, lambda: set_model_state_dict(module, fill_in(template, loaded, self._shared)))
        return module

    def _optimizer(self, optimizer: torch.optim.Optimizer, node: Any, keys: tuple[Any, ...]) -> Any:
        module = module_for(optimizer, display(keys), self.root)
        if not self._saved_dict(node, keys, "an optimizer"):
            return optimizer
        template = get_optimizer_state_dict(module, optimizer)
        loaded = self.plan(template, node, keys)
        self._later(
            keys, lambda: set_optimizer_state_dict(module, optimizer, fill_in(template, loaded, self._shared))
        )
        return optimizer

    def _stateful(self, obj: Any, node: Any, keys: tuple[Any, ...]) -> Any:
        # full: what the object's current state_dict() lacks comes from the checkpoint whole
        # (a fresh optimizer has no moments yet, and gets the saved ones).
        template = obj.state_dict()
        loaded = self.plan(template, node, keys, full=True)
        self._later(keys, lambda: obj.load_state_dict(unwrapped(fill_in(template, loaded, self._shared))))
        return obj

    def _per_rank(self, target: PerRank, node: Any, keys: tuple[Any, ...], full: bool) -> Any:
        # The wrapper stays in the caller's state; what it wraps is loaded as any value there.
        if node == {"R": None}:  # this rank did not exist when it was saved: nothing of its own
            self.no_per_rank.append(display(keys) or "the state")
            return target
        self.per_rank.append(display(keys) or "the state")
        inner = self.plan(target.value, node, keys, full)
        self._later(keys, lambda: put_per_rank(target, inner, self._shared))
        return target

    def _saved_tensor(self, target: Any, saved: torch.Tensor, keys: tuple[Any, ...], full: bool) -> Any:
        """A tensor of the train-state file (a ``per_rank`` value's): copied into ``target`` where it
        has the same shape and dtype, else it takes the target's place."""
        if isinstance(target, torch.Tensor):
            if target.shape == saved.shape and target.dtype == saved.dtype:
                self._later(keys, lambda: copy_into(target, saved))
                return target
            if not full:
                self.problems.append(
                    f"{display(keys)} is {_describe(saved.dtype, tuple(saved.shape))} in the checkpoint "
                    f"but {_describe(target.dtype, tuple(target.shape))} in the state"
                )
                return target
        return saved

    def _tensor(self, target: Any, fqn: Any, keys: tuple[Any, ...], full: bool) -> Any:
        meta = self.meta.get(fqn) if isinstance(fqn, str) else None
        if not isinstance(meta, TensorStorageMetadata):
            self.damage.append(f"{display(keys)} names the DCP key {fqn!r}, which .metadata lacks")
            return target
        shape, dtype = meta.size, meta.properties.dtype
        if isinstance(target, torch.Tensor):
            if target.shape == shape and target.dtype == dtype:
                self.dcp[fqn] = target
                return target
            if not full or (DTensor is not None and isinstance(target, DTensor)):
                self.problems.append(
                    f"{display(keys)} is {_describe(dtype, shape)} in the checkpoint but "
                    f"{_describe(target.dtype, tuple(target.shape))} in the state"
                )
                return target
        fresh = torch.empty(shape, dtype=dtype)
        self.dcp[fqn] = fresh
        return fresh

    def _mapping(self, target: Any, items: Any, keys: tuple[Any, ...], full: bool) -> Any:
        out = Map()
        if not isinstance(target, Mapping):
            for k, child in items:
                out[k] = self.plan(ABSENT, child, (*keys, k), full)
            return out
        self._shared.reach(target)
        # An empty dict is a placeholder (a fresh optimizer's state_dict()["state"]): it gets
        # what the checkpoint has there, not a list of unexpected keys.
        full = full or not target
        saved = set()
        for k, child in items:
            saved.add(k)
            child_keys = (*keys, k)
            if not self.selection.wanted(child_keys):
                continue
            if k in target:
                out[k] = self.plan(target[k], child, child_keys, full)
            elif full:
                out[k] = self.plan(ABSENT, child, child_keys, full)
            else:
                self.unexpected.append(display(child_keys))
        for k in target:
            if k not in saved and self.selection.wanted((*keys, k)):
                self.missing.append(display((*keys, k)))
        return out

    def _sequence(self, target: Any, nodes: Any, keys: tuple[Any, ...], full: bool, is_tuple: bool) -> Any:
        if not isinstance(target, (list, tuple)):
            items = {i: self.plan(ABSENT, child, (*keys, i), full) for i, child in enumerate(nodes)}
            return Seq(items, len(nodes), is_tuple)
        self._shared.reach(target)
        # An empty list is a placeholder too, and a list of plain values is one value: it is
        # replaced whole (a list of hyper-parameters has no "missing" entries).
        full = full or not target or not _has_tensor({"L": nodes})
        out = Seq({}, len(nodes) if full else len(target), is_tuple)
        for i, child in enumerate(nodes):
            child_keys = (*keys, i)
            if not self.selection.wanted(child_keys):
                continue
            if i < len(target):
                out.items[i] = self.plan(target[i], child, child_keys, full)
            elif full:
                out.items[i] = self.plan(ABSENT, child, child_keys, full)
            else:
                self.unexpected.append(display(child_keys))
        for i in range(len(nodes), len(target)):
            if self.selection.wanted((*keys, i)):
                self.missing.append(display((*keys, i)))
        return out


_KINDS = {"T": "tensor", "t": "tensor", "D": "dict", "L": "list", "U": "list"}


def _kind(value: Any) -> str:
    if value is ABSENT:
        return "absent"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, Mapping):
        return "dict"
    if isinstance(value, (list, tuple)):
        return "list"
    return "value"


def _has_tensor(node: Any) -> bool:
    ((tag, body),) = node.items()
    if tag in ("T", "t"):
        return True
    if tag == "D":
        return any(_has_tensor(child) for _, child in body)
    if tag in ("L", "U"):
        return any(_has_tensor(child) for child in body)
    if tag in ("M", "O", "S") or (tag == "R" and body is not None):
        return _has_tensor(body)
    return False


def _describe(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    return f"{str(dtype).removeprefix('torch.')} {list(shape)}"


# --- without a template --------------------------------------------------------------------
