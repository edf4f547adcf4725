"""DCP's save plans, cached between saves of one manager, compared strictly.

Planning a save costs every time: each rank's local plan, a gather of all of
them, the coordinator's global plan and its validation, a scatter back (a
median 36 ms per save for 150 DTensors on 2 gloo ranks; 23 ms with the plans
cached, ``benchmarks/trace_ranks.py``). DCP can cache those plans
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
The planner also flattens the state itself (``dcp_nesting.flatten_nested``).
"""

from __future__ import annotations

import inspect
import uuid
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from .dcp_nesting import flatten_nested
from .errors import CheckpointError

# DCP's class-level caches (torch.distributed.checkpoint.default_planner), by key.
_CACHES = (
    "_cached_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
    "_cached_final_save_plan",
)


# DCP's plan caching as this module was written against (torch 2.13); with a torch without it
# every save plans in full.
CACHING = all(hasattr(SavePlanner, name) for name in _CACHES) and (
    "enable_plan_caching" in inspect.signature(DefaultSavePlanner.__init__).parameters
)


class SavePlans:
    """The DCP plans of one manager's saves. :meth:`forget` drops them (at close)."""

    def __init__(self) -> None:
        self.key = f"safeckpt-{uuid.uuid4().hex}"

    def planner(self) -> SavePlanner:
        """The planner for the next save."""
        return _SafeSavePlanner(self.key, caching=CACHING)

    def forget(self) -> None:
        for name in _CACHES:
            getattr(SavePlanner, name, {}).pop(self.key, None)


class _SafeSavePlanner(DefaultSavePlanner):
    def __init__(self, key: str, *, caching: bool) -> None:
        super().__init__(**({"enable_plan_caching": True} if caching else {}))
        self._caching = caching
        self._cached_plans_key = key
        self._unpromoted: SavePlan | None = None  # this save's new local plan, until it is planned

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
        if not self._caching:
            return super().create_local_plan()
        cache, key = SavePlanner._cached_save_plan, self._cached_plans_key
        # Without a cached plan DCP plans in full; the strict comparison is ours.
        previous = cache.pop(key, None)
        plan = super().create_local_plan()
        # Some torch releases cache it right here; it is cached only once the global plan
        # succeeded (finish_plan), else a failed save would leave it for the next one to reuse.
        cache.pop(key, None)
        if previous is not None and _same(plan, previous):
            cache[key] = previous
            return SavePlan([], usable=False)
        self._unpromoted = plan
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if not self._caching:
            return super().create_global_plan(all_plans)
        if self._cached_plans_key not in SavePlanner._cached_all_plans and not all(
            plan.usable for plan in all_plans
        ):
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
            SavePlanner._cached_save_plan[self._cached_plans_key] = self._unpromoted
        return finished


def _same(plan: SavePlan, other: SavePlan) -> bool:
    return (
        plan.items == other.items
        and plan.planner_data == other.planner_data
        and plan.storage_data == other.storage_data
    )
