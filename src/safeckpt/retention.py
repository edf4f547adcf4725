"""Retention policies (public): which committed checkpoints to keep.

The implementation lives in :mod:`safeckpt._policy.retention`; this module is
the public path the docs name (``safeckpt.retention.plan_removals``).
"""

from ._policy.retention import (
    CheckpointInfo,
    KeepAll,
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepMilestones,
    KeepPinned,
    KeepTimeInterval,
    Policy,
    Retention,
    explain,
    plan_removals,
)

__all__ = [
    "CheckpointInfo",
    "KeepAll",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepMilestones",
    "KeepPinned",
    "KeepTimeInterval",
    "Policy",
    "Retention",
    "explain",
    "plan_removals",
]
