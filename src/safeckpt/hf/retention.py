"""The Trainer's retention arguments as a safeckpt policy that never drops the best checkpoint.

``save_total_limit=K`` keeps the ``K`` newest checkpoints; with ``metric_for_best_model`` the best
one by that metric is kept too, ranked from the metrics in the records (so it stays right across
restarts) and, on top, the very step the Trainer's own ``TrainerState.best_global_step`` names
(ties: the Trainer keeps the first, safeckpt's ``KeepBest`` the newest; both are kept). The
checkpoint ``latest`` names is never removed whatever the policy says (the manager's rule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._policy.retention import CheckpointInfo, KeepAny, Policy, Retention


def eval_metric(args: Any) -> str | None:
    """The record metric ``metric_for_best_model`` names (the Trainer prefixes ``eval_``)."""
    name = args.metric_for_best_model
    if not name:
        return None
    return name if name.startswith("eval_") else f"eval_{name}"


@dataclass(frozen=True)
class KeepTrainerBest:
    """The step the Trainer's state names best (``best_global_step``), read when retention runs."""

    best_step: Callable[[], int | None]

    def keep(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        step = self.best_step()
        return frozenset(i.step for i in infos if i.step == step)

    def reason(self) -> str:
        return "the Trainer's best_global_step"


def trainer_retention(
    args: Any, chosen: Retention | Policy | None, best_step: Callable[[], int | None]
) -> Policy:
    """``chosen`` (attach's ``retention=``), else the Trainer's arguments; either way with the best kept."""
    keep_trainer_best = KeepTrainerBest(best_step)
    if chosen is not None:
        policy = chosen.policy() if isinstance(chosen, Retention) else chosen
        return KeepAny((policy, keep_trainer_best))
    metric = eval_metric(args)
    retention = Retention(
        keep_last=args.save_total_limit or None,
        keep_best=1 if metric and args.save_total_limit else None,
        metric=metric if args.save_total_limit else None,
        mode="max" if args.greater_is_better else "min",
    )
    if not args.save_total_limit:
        return retention.policy()  # keeps every checkpoint, as the Trainer does without a limit
    policies: tuple[Policy, ...] = (retention.policy(),)
    if metric:
        policies = (*policies, keep_trainer_best)
    return KeepAny(policies)


__all__ = ["KeepTrainerBest", "eval_metric", "trainer_retention"]
