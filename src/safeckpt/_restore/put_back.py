"""Putting loaded values in place: into the caller's containers where they fill in place, as new
values where they do not, once per shared list or dict (see :class:`Shared`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._state.per_rank import PerRank


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


ABSENT: Any = _Absent()


class Map(dict[Any, Any]):
    """Loaded items of a mapping (only those to put in place)."""


@dataclass
class Seq:
    """Loaded items of a list or tuple, by index; ``length`` of the result."""

    items: dict[int, Any]
    length: int
    is_tuple: bool


def copy_into(target: torch.Tensor, saved: torch.Tensor) -> None:
    with torch.no_grad():  # a parameter's copy must not record autograd history
        target.copy_(saved)


def unwrapped(value: Any) -> Any:
    """``value`` with every ``per_rank`` wrapper replaced by what it holds, for a ``Stateful``'s
    ``load_state_dict`` (which gets what its ``state_dict`` held, as ``safeckpt.load`` returns it).
    Containers are copied where something changed: the object may hand out its own dicts."""
    if isinstance(value, PerRank):
        return unwrapped(value.value)
    if isinstance(value, dict):
        items = {k: unwrapped(v) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    if isinstance(value, (list, tuple)):
        values = [unwrapped(v) for v in value]
        if all(a is b for a, b in zip(values, value, strict=True)):
            return value
        return tuple(values) if isinstance(value, tuple) else values
    return value


def put_per_rank(wrapper: PerRank, loaded: Any, shared: Shared) -> None:
    value = fill_in(wrapper.value, loaded, shared)
    if value is not wrapper.value:  # a value replaced whole (a tensor of another shape, a number)
        wrapper.value = value


class Shared:
    """The lists and dicts a state holds at more than one path, and how each is filled.

    The plan :meth:`reach`-es every container of the state it matches; :meth:`fill` fills
    a shared one in place through its first path and, for each later path, a copy of what
    it held before (so what that path's checkpoint lacks keeps the state's value there).
    """

    def __init__(self) -> None:
        self._reached: dict[int, Any] = {}  # by id, holding the objects so that no id is reused
        self.shared: dict[int, Any] = {}
        self._before: dict[int, Any] = {}  # a shared container's contents before its first fill

    def reach(self, target: Any) -> None:
        if not _fills_in_place(target):
            return
        if id(target) in self._reached:
            self.shared[id(target)] = target
        else:
            self._reached[id(target)] = target

    def fill(self, target: Any, loaded: Any) -> Any:
        before = self._before.get(id(target))
        if before is None:
            self._before[id(target)] = copy.copy(target)
            return _fill(target, loaded, self)
        mine = _fill(copy.copy(before), loaded, self)
        # What the first path put is what this path saved: one object, as the state had it.
        return target if _alike(mine, target) else mine


def _fills_in_place(value: Any) -> bool:
    return isinstance(value, (dict, list)) or (isinstance(value, Mapping) and hasattr(value, "__setitem__"))


def _alike(a: Any, b: Any) -> bool:
    """The same structure and values, tensors the same objects (their values are not compared)."""
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False
    if isinstance(a, Mapping):
        return list(a) == list(b) and all(_alike(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_alike(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:  # a value without a plain ==: not known to be alike
        return False


def fill_in(target: Any, loaded: Any, shared: Shared) -> Any:
    """Put ``loaded`` into ``target`` where it is a container; the value for its position."""
    if loaded is target:
        return target
    if shared.shared and id(target) in shared.shared and isinstance(loaded, (Map, Seq)):
        return shared.fill(target, loaded)
    return _fill(target, loaded, shared)


def _fill(target: Any, loaded: Any, shared: Shared) -> Any:
    if isinstance(loaded, Map):
        if isinstance(target, dict) or (isinstance(target, Mapping) and hasattr(target, "__setitem__")):
            for k, v in loaded.items():
                current = target.get(k, ABSENT)
                new = fill_in(current, v, shared)
                if new is not current:
                    target[k] = new
            return target
        return {k: fill_in(ABSENT, v, shared) for k, v in loaded.items()}
    if isinstance(loaded, Seq):
        if isinstance(target, (list, tuple)):
            values = list(target)
            for i in sorted(loaded.items):
                current = values[i] if i < len(values) else ABSENT
                new = fill_in(current, loaded.items[i], shared)
                if i < len(values):
                    values[i] = new
                else:
                    values.append(new)
            if isinstance(target, list):
                for i, v in enumerate(values):
                    if i >= len(target):
                        target.append(v)
                    elif v is not target[i]:
                        target[i] = v
                return target
            changed = len(values) != len(target) or any(
                a is not b for a, b in zip(values, target, strict=False)
            )
            return tuple(values) if changed else target
        values = [fill_in(ABSENT, loaded.items[i], shared) for i in range(loaded.length)]
        return tuple(values) if loaded.is_tuple else values
    return loaded
