"""Retention: which checkpoints to keep. Pure policy, no I/O.

A policy takes read-only :class:`CheckpointInfo` objects and returns the steps it
keeps; it reads no clock, touches no file and knows no rank. :class:`Retention`
is the user-facing configuration; it becomes one :class:`KeepAny` of small
policies, so there is one code path. What must never go (the checkpoint
``latest`` names, saves in flight) is passed as ``protected`` by the mechanism:
protection is not a policy the user can turn off.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .errors import ConfigError

Mode = Literal["min", "max"]
MissingMetric = Literal["rank_last", "keep"]


@dataclass(frozen=True)
class CheckpointInfo:
    """What retention knows of a checkpoint (committed, or still in flight)."""

    step: int
    metrics: Mapping[str, float | None] = field(default_factory=dict)
    time: float = 0.0
    pinned: bool = False


class Policy(Protocol):
    """Keeps some checkpoints. ``keep`` is pure: same infos in, same steps out."""

    def keep(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]: ...

    def reason(self) -> str:
        """A few words for ``safeckpt ls``: why a step this policy keeps is kept."""
        ...


@dataclass(frozen=True)
class KeepLast:
    """The ``n`` checkpoints with the highest steps."""

    n: int

    def keep(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        steps = sorted({i.step for i in infos}, reverse=True)
        return frozenset(steps[: self.n])

    def reason(self) -> str:
        return f"last {self.n}"


@dataclass(frozen=True)
class KeepBest:
    """The ``k`` best checkpoints by ``metric``; ties go to the newer step.

    A checkpoint whose record lacks the metric (or holds NaN) is ranked after
    every one that has it (``missing="rank_last"``) or always kept (``"keep"``).
    """

    k: int
    metric: str
    mode: Mode = "min"
    missing: MissingMetric = "rank_last"

    def keep(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        scored: list[tuple[float, int]] = []
        unscored: list[int] = []
        for info in infos:
            value = info.metrics.get(self.metric)
            if value is None or math.isnan(value):
                unscored.append(info.step)
            else:
                scored.append((value if self.mode == "min" else -value, -info.step))
        ranked = [-neg_step for _, neg_step in sorted(scored)]
        if self.missing == "keep":
            return frozenset(ranked[: self.k]) | frozenset(unscored)
        ranked += sorted(unscored, reverse=True)
        return frozenset(ranked[: self.k])

    def reason(self) -> str:
        return f"best {self.k} by {self.metric} ({self.mode})"


@dataclass(frozen=True)
class KeepEvery:
    """Milestones: every checkpoint whose step is a multiple of ``every``."""

    every: int

    def keep(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        return frozenset(i.step for i in infos if i.step % self.every == 0)

    def reason(self) -> str:
        return f"every {self.every}"


@dataclass(frozen=True)
class KeepPinned:
    """Checkpoints the user pinned (``mgr.pin(step)``)."""

    def keep(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        return frozenset(i.step for i in infos if i.pinned)

    def reason(self) -> str:
        return "pinned"


@dataclass(frozen=True)
class KeepAll:
    """Every checkpoint: the default when no retention is configured."""

    def keep(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        return frozenset(i.step for i in infos)

    def reason(self) -> str:
        return "no retention limit"


@dataclass(frozen=True)
class KeepAny:
    """The union of what each policy keeps."""

    policies: tuple[Policy, ...]

    def keep(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        kept: frozenset[int] = frozenset()
        for policy in self.policies:
            kept |= policy.keep(infos)
        return kept

    def reason(self) -> str:
        return " or ".join(p.reason() for p in self.policies)


def _positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"Retention({name}={value!r}): must be a positive integer or None.")


@dataclass(frozen=True, kw_only=True)
class Retention:
    """Which checkpoints to keep. A checkpoint is kept if any rule keeps it.

    With nothing set, every checkpoint is kept. Whatever is set, the checkpoint
    ``latest`` names, saves in flight and pinned checkpoints are never removed.
    """

    keep_last: int | None = None
    """Keep the N newest checkpoints (by step)."""

    keep_best: int | None = None
    """Keep the K best checkpoints by ``metric``; needs ``metric``."""

    metric: str | None = None
    """Name of the metric (as passed in ``save(metrics=...)``) that ranks ``keep_best``."""

    mode: Mode = "min"
    """``"min"`` when lower ``metric`` is better (a loss), ``"max"`` when higher is."""

    keep_every: int | None = None
    """Keep every checkpoint whose step is a multiple of this (milestones)."""

    missing_metric: MissingMetric = "rank_last"
    """For ``keep_best``: a checkpoint without the metric ranks last, or is always kept."""

    def __post_init__(self) -> None:
        _positive("keep_last", self.keep_last)
        _positive("keep_best", self.keep_best)
        _positive("keep_every", self.keep_every)
        if self.keep_best is not None and not self.metric:
            raise ConfigError(
                "Retention(keep_best=...) needs metric=...: name the metric that ranks checkpoints."
            )
        if self.metric is not None and self.keep_best is None:
            raise ConfigError(
                f"Retention(metric={self.metric!r}) has no effect without keep_best=K: set "
                "keep_best, or drop metric."
            )
        if self.mode not in ("min", "max"):
            raise ConfigError(f"Retention(mode={self.mode!r}): use 'min' or 'max'.")
        if self.missing_metric not in ("rank_last", "keep"):
            raise ConfigError(
                f"Retention(missing_metric={self.missing_metric!r}): use 'rank_last' or 'keep'."
            )

    def policies(self) -> tuple[Policy, ...]:
        """The small policies this configuration stands for (pinned always included)."""
        rules: list[Policy] = []
        if self.keep_last is not None:
            rules.append(KeepLast(self.keep_last))
        if self.keep_best is not None:
            assert self.metric is not None
            rules.append(KeepBest(self.keep_best, self.metric, self.mode, self.missing_metric))
        if self.keep_every is not None:
            rules.append(KeepEvery(self.keep_every))
        if not rules:
            rules.append(KeepAll())
        rules.append(KeepPinned())
        return tuple(rules)

    def policy(self) -> KeepAny:
        return KeepAny(self.policies())

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Retention:
        """The inverse of :meth:`to_json`; unknown fields (from a newer version) are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def plan_removals(
    infos: Sequence[CheckpointInfo], policy: Policy, protected: Iterable[int] = ()
) -> frozenset[int]:
    """Steps among ``infos`` that ``policy`` does not keep and that are not ``protected``."""
    kept = policy.keep(infos) | frozenset(protected)
    return frozenset(i.step for i in infos) - kept


def explain(
    infos: Sequence[CheckpointInfo],
    retention: Retention,
    protected: Mapping[int, str] | None = None,
) -> dict[int, list[str]]:
    """For each step, why it is kept (empty list: it would be removed).

    ``protected`` maps protected steps to their reason ("latest", "writing").
    """
    reasons: dict[int, list[str]] = {i.step: [] for i in infos}
    for step, why in (protected or {}).items():
        if step in reasons:
            reasons[step].append(why)
    for policy in retention.policies():
        for step in policy.keep(infos):
            reasons[step].append(policy.reason())
    return reasons
