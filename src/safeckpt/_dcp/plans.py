"""DCP's save plans, cached between saves of one manager, compared strictly.

Planning a save costs every time: each rank's local plan, a gather of all of
them, the coordinator's global plan and its validation, a scatter back
(``benchmarks/trace_ranks.py`` times it). DCP can cache those plans
(``DefaultSavePlanner(enable_plan_caching=True)``): a rank whose local plan did
not change sends an empty one, and the coordinator reuses its global plan and
metadata. Two things keep that from being safe as it is:

* its comparison of plans ignores the tensors' properties (a model cast to
  bf16 keeps every shape, so the cached ``.metadata`` would still say fp32) and
  the flattening's mappings (the nesting ``.metadata`` records);
* its caches live on the planner class under the class's name, shared by every
  planner in the process: two managers (pipeline stages, a test suite) would
  merge each other's plans.

So each :class:`SavePlans` has its own key, a local plan counts as unchanged
only when it is equal in every field, and a rank that sent its plan always
gets its whole final plan back (DCP's comparison of final plans is as loose).
The planner also flattens the state itself (:func:`safeckpt._dcp.nesting.flatten_nested`).

A state of plain tensors (what the manager's staging hands over) is planned
here rather than by DCP's helpers, to the same items, with far less Python per
tensor: one :class:`TensorProperties` object per kind of tensor and one size
object per tensor, shared. ``.metadata`` then pickles them once, so it is
smaller and quicker to pickle and unpickle. And while the inputs of that plan
(names, shapes, dtypes, layouts, ``requires_grad``, pinning, the flattening's
mappings) are what the cached plan was made from, the plan is neither made
again nor compared: for many small tensors that was much of a save's Python,
on the writer's thread, holding the GIL beside training.
"""

from __future__ import annotations

import dataclasses
import operator
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from .._util import torch_private
from ..errors import CheckpointError
from .nesting import flatten_nested

# DCP's plan caching (class-level caches, by key) as this module was written against (torch 2.13),
# through the one door to torch's privates; with a torch without it every save plans in full.
CACHING = torch_private.plan_caching is not None


class SavePlans:
    """The DCP plans of one manager's saves. :meth:`forget` drops them (at close)."""

    def __init__(self) -> None:
        self.key = f"safeckpt-{uuid.uuid4().hex}"
        self.inputs: _Inputs | None = None  # what the cached local plan was made from (plain tensors)

    def planner(self) -> SavePlanner:
        """The planner for the next save."""
        return _SafeSavePlanner(self, caching=CACHING)

    def forget(self) -> None:
        self.inputs = None
        if torch_private.plan_caching is not None:
            torch_private.plan_caching.forget(self.key)


class _SafeSavePlanner(DefaultSavePlanner):
    def __init__(self, plans: SavePlans, *, caching: bool) -> None:
        super().__init__(**({"enable_plan_caching": True} if caching else {}))
        self._caching = caching
        self._plans = plans
        self._key = plans.key
        if caching:
            _caches().use_key(self, plans.key)
        self._unpromoted: SavePlan | None = None  # this save's new local plan, until it is planned
        self._inputs: _Inputs | None = None  # what it was made from

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        # As SafeLoadPlanner's, with the save planner's signature: DCP looks for storage_meta in it.
        flat = flatten_nested(state_dict) if self.flatten_state_dict else None
        if flat is None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        super().set_up_planner({}, storage_meta, is_coordinator)  # every other field, as DCP sets it
        self.state_dict, self.mappings = flat

    def create_local_plan(self) -> SavePlan:
        inputs = _inputs(self.state_dict, self.is_coordinator, self.mappings)
        if not self._caching:
            return self._new_local_plan(inputs)
        cache, key = _caches().cache("save_plan"), self._key
        # Without a cached plan DCP plans in full; the strict comparison is ours.
        previous = cache.pop(key, None)
        if previous is not None and inputs is not None and inputs == self._plans.inputs:
            cache[key] = previous  # made from these very inputs: the same plan
            return SavePlan([], usable=False)
        plan = self._new_local_plan(inputs)
        # Some torch releases cache it right here; it is cached only once the global plan
        # succeeded (finish_plan), else a failed save would leave it for the next one to reuse.
        cache.pop(key, None)
        if previous is not None and _same(plan, previous):
            cache[key] = previous
            self._plans.inputs = inputs
            return SavePlan([], usable=False)
        self._unpromoted, self._inputs = plan, inputs
        return plan

    def _new_local_plan(self, inputs: _Inputs | None) -> SavePlan:
        """DCP's local plan: made here for a state of plain tensors (:func:`_plain_items`), else by DCP."""
        if inputs is None:
            return super().create_local_plan()
        plan = SavePlan(_plain_items(self.state_dict, inputs))
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        # DCP's lookup builds a torch.Size per item to check a plain tensor's zero offsets.
        obj: Any = self.state_dict.get(write_item.index.fqn)
        offset = write_item.index.offset
        if (
            type(obj) in _PLAIN
            and write_item.type is WriteItemType.TENSOR
            and offset is not None
            and len(offset) == obj.dim()
            and not any(offset)
        ):
            return obj
        return super().resolve_data(write_item)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if not self._caching:
            return super().create_global_plan(all_plans)
        if self._key not in _caches().cache("all_plans") and not all(plan.usable for plan in all_plans):
            # DCP would plan without that rank's tensors. Raised on every rank, which forgets.
            raise CheckpointError(
                "a rank reused a save plan that the coordinator no longer holds; every rank drops "
                "its cached plans and the next save plans in full."
            )
        delta, metadata = super().create_global_plan(all_plans)
        whole = getattr(self, "global_plan", None)
        if whole is not None and len(whole) == len(delta) == len(all_plans):
            # A rank that sent a plan takes its whole final plan, never its cached one.
            delta = [
                full if sent.usable else part
                for part, full, sent in zip(delta, whole, all_plans, strict=True)
            ]
        return delta, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        finished = super().finish_plan(new_plan)
        if self._caching and self._unpromoted is not None:
            _caches().cache("save_plan")[self._key] = self._unpromoted
            self._plans.inputs = self._inputs
        return finished


def _caches() -> torch_private.PlanCaching:
    caching = torch_private.plan_caching
    assert caching is not None  # a planner caches only where the door found DCP's caches
    return caching


def _same(plan: SavePlan, other: SavePlan) -> bool:
    return (
        plan.items == other.items
        and plan.planner_data == other.planner_data
        and plan.storage_data == other.storage_data
    )


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exactly these types: no DTensor, no subclass
_Inputs = tuple[Any, ...]
_KIND = operator.attrgetter("dtype", "layout", "requires_grad")


def _inputs(state_dict: dict[str, Any], is_coordinator: bool, mappings: Any) -> _Inputs | None:
    """All that DCP's local plan of ``state_dict`` depends on, if every value is a plain tensor
    (None otherwise: DCP plans it). Compared by value: a tensor cast in place is a new plan."""
    values = list(state_dict.values())
    if not all(type(v) in _PLAIN for v in values):
        return None
    sizes = [v.size() for v in values]
    pinned = list(map(torch.Tensor.is_pinned, values))
    return (is_coordinator, tuple(state_dict), sizes, list(map(_KIND, values)), pinned, mappings)


def _plain_items(state_dict: dict[str, Any], inputs: _Inputs) -> list[WriteItem]:
    """The write items of DCP's ``_create_write_item_for_tensor`` for each tensor, equal to its,
    with each kind's ``TensorProperties`` and the chunks' zero offsets of each rank one shared
    object (a ``MetadataIndex`` makes its own copy of the offsets)."""
    _, _, sizes, kinds, pinned, _ = inputs
    properties: dict[tuple[Any, ...], TensorProperties] = {}
    zeros: dict[int, torch.Size] = {}
    items = []
    for (fqn, tensor), size, kind, pin in zip(state_dict.items(), sizes, kinds, pinned, strict=True):
        key = (*kind, pin)
        props = properties.get(key)
        if props is None:
            props = properties[key] = TensorProperties.create_from_tensor(tensor)
        zero = zeros.get(len(size))
        if zero is None:
            zero = zeros[len(size)] = torch.Size([0] * len(size))
        chunk = ChunkStorageMetadata(offsets=zero, sizes=size)
        data = TensorWriteData(chunk=chunk, properties=props, size=size)
        items.append(WriteItem(index=MetadataIndex(fqn, zero), type=WriteItemType.TENSOR, tensor_data=data))
    return items
