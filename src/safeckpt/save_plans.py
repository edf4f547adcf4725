"""DCP's save plans, cached between saves of one manager, compared strictly.

Planning a save costs every time: each rank's local plan, a gather of all of
them, the coordinator's global plan and its validation, a scatter back (about
50 ms per save for 150 DTensors on 2 gloo ranks). DCP can cache those plans
(``DefaultSavePlanner(enable_plan_caching=True)``): a rank whose local plan did
not change sends an empty one, and the coordinator reuses its global plan and
metadata. Two things keep that from being safe as it is:

* its comparison of plans ignores the tensors' properties (a model cast to
  bf16 keeps every shape, so the cached ``.metadata`` would still say fp32) and
  the flattening's mappings (``{0: t}`` and ``{"0": t}`` flatten to one name);
* its caches live on the planner class under the class's name, shared by every
  planner in the process: two managers (pipeline stages, a test suite) would
  merge each other's plans.

So each :class:`SavePlans` has its own key, a local plan counts as unchanged
only when it is equal in every field, and a rank that sent its plan always
gets its whole final plan back (DCP's comparison of final plans is as loose).
"""

from __future__ import annotations

import inspect
import uuid

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

# DCP's class-level caches (torch.distributed.checkpoint.default_planner), by key.
_CACHES = (
    "_cached_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
    "_cached_final_save_plan",
)


# DCP's plan caching as this module was written against (torch 2.13); a torch without it plans
# every save in full.
CACHING = all(hasattr(SavePlanner, name) for name in _CACHES) and (
    "enable_plan_caching" in inspect.signature(DefaultSavePlanner.__init__).parameters
)


class SavePlans:
    """The DCP plans of one manager's saves. :meth:`forget` drops them (at close)."""

    def __init__(self) -> None:
        self.key = f"safeckpt-{uuid.uuid4().hex}"

    def planner(self) -> SavePlanner | None:
        """The planner for the next save (None: DCP's default, which caches nothing)."""
        return _StrictCachingPlanner(self.key) if CACHING else None

    def forget(self) -> None:
        for name in _CACHES:
            getattr(SavePlanner, name, {}).pop(self.key, None)


class _StrictCachingPlanner(DefaultSavePlanner):
    def __init__(self, key: str) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = key

    def create_local_plan(self) -> SavePlan:
        cache = SavePlanner._cached_save_plan
        # Without a cached plan DCP plans in full (and keeps the plan, promoted once the save's
        # global plan succeeded); the strict comparison is ours.
        previous = cache.pop(self._cached_plans_key, None)
        plan = super().create_local_plan()
        if previous is not None and _same(plan, previous):
            cache[self._cached_plans_key] = previous
            return SavePlan([], usable=False)
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        delta, metadata = super().create_global_plan(all_plans)
        whole = getattr(self, "global_plan", None)
        if whole is not None and len(whole) == len(delta) == len(all_plans):
            # A rank that sent a plan takes its whole final plan, never its cached one.
            delta = [
                full if sent.usable else part
                for part, full, sent in zip(delta, whole, all_plans, strict=True)
            ]
        return delta, metadata


def _same(plan: SavePlan, other: SavePlan) -> bool:
    return (
        plan.items == other.items
        and plan.planner_data == other.planner_data
        and plan.storage_data == other.storage_data
    )
