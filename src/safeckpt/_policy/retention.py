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
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ..errors import ConfigError
from .schedule import Milestones, MilestonesLike, check_seconds

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
class KeepMilestones:
    """Milestones: every checkpoint whose step is one of ``milestones`` (a list, or powers of two).

    Pass the same value as to ``SaveSchedule(milestones=...)``: what the schedule
    saves as a milestone, retention keeps.
    """

    milestones: Milestones

    def keep(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        return frozenset(i.step for i in infos if i.step in self.milestones)

    def reason(self) -> str:
        return f"milestone ({self.milestones.describe()})"


@dataclass(frozen=True)
class KeepTimeInterval:
    """One checkpoint per ``seconds`` of wall time, like Orbax's ``keep_time_interval``.

    Walking the checkpoints by the time they were saved, the oldest is kept, and
    then each one saved at least ``seconds`` after the previous kept one. A
    newer checkpoint never changes what is kept among older ones, so the choice
    is stable as a run goes on. Uses the record's time; reads no clock.
    """

    seconds: float

    def keep(self, infos: Sequence[CheckpointInfo]) -> frozenset[int]:
        kept: set[int] = set()
        last: float | None = None
        for info in sorted(infos, key=lambda i: (i.time, i.step)):
            if last is None or info.time - last >= self.seconds:
                kept.add(info.step)
                last = info.time
        return frozenset(kept)

    def reason(self) -> str:
        return f"one per {_duration(self.seconds)}"


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)} {unit}"
    return f"{seconds:g} s"


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

    keep_milestones: Milestones | MilestonesLike | None = None
    """Keep milestone steps: a list, ``"pow2"`` (1, 2, 4, 8, ...) or :class:`Milestones` (a window);
    the same value as ``SaveSchedule(milestones=...)``."""

    keep_time_interval: float | None = None
    """Keep one checkpoint per this many seconds of wall time (by the records' times)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_milestones", Milestones.of(self.keep_milestones))
        check_seconds("Retention(keep_time_interval=...)", self.keep_time_interval)
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
        if isinstance(self.keep_milestones, Milestones):
            rules.append(KeepMilestones(self.keep_milestones))
        if self.keep_time_interval is not None:
            rules.append(KeepTimeInterval(float(self.keep_time_interval)))
        if not rules:
            rules.append(KeepAll())
        rules.append(KeepPinned())
        return tuple(rules)

    def policy(self) -> KeepAny:
        return KeepAny(self.policies())

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if isinstance(self.keep_milestones, Milestones):
            data["keep_milestones"] = self.keep_milestones.to_json()
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Retention:
        """The inverse of :meth:`to_json`; unknown fields (from a newer version) are ignored.

        Raises :class:`ConfigError` for what :func:`retention_json` wrote for a
        custom policy: it cannot be rebuilt, and an empty Retention would say
        "keep everything".
        """
        if CUSTOM_POLICY in data:
            raise ConfigError(
                f"the recorded retention is a custom policy ({data.get(CUSTOM_POLICY)}: "
                f"{data.get('reason')}); it cannot be rebuilt. Pass the retention rules explicitly."
            )
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


CUSTOM_POLICY = "custom_policy"


def is_policy(value: Any) -> bool:
    """Whether ``value`` has the :class:`Policy` methods (``keep`` and ``reason``)."""
    return callable(getattr(value, "keep", None)) and callable(getattr(value, "reason", None))


def policies_of(retention: Retention | Policy) -> tuple[Policy, ...]:
    """The small policies ``retention`` is made of: a Retention's rules, a KeepAny's parts, or itself."""
    if isinstance(retention, Retention):
        return retention.policies()
    if isinstance(retention, KeepAny):
        return retention.policies
    return (retention,)


def with_pinned(retention: Retention | Policy) -> KeepAny:
    """The policy the manager applies: ``retention`` or a pinned checkpoint (pins are never pruned)."""
    parts = policies_of(retention)
    if not any(isinstance(p, KeepPinned) for p in parts):
        parts = (*parts, KeepPinned())
    return KeepAny(parts)


def retention_json(retention: Retention | Policy) -> dict[str, Any]:
    """What a record stores about the retention that wrote it (for ``safeckpt ls``).

    A Retention's fields; a custom policy's own ``to_json()`` if it has one;
    else its class and ``reason()``.
    """
    if isinstance(retention, Retention):
        return retention.to_json()
    to_json = getattr(retention, "to_json", None)
    data = to_json() if callable(to_json) else None
    if isinstance(data, dict) and _is_json(data):  # what cannot go in a record falls back to reason()
        return {CUSTOM_POLICY: type(retention).__qualname__, **data}
    return {CUSTOM_POLICY: type(retention).__qualname__, "reason": retention.reason()}


def _is_json(data: Any) -> bool:
    try:
        json.dumps(data, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def plan_removals(
    infos: Sequence[CheckpointInfo], policy: Policy, protected: Iterable[int] = ()
) -> frozenset[int]:
    """Steps among ``infos`` that ``policy`` does not keep and that are not ``protected``."""
    kept = policy.keep(infos) | frozenset(protected)
    return frozenset(i.step for i in infos) - kept


def explain(
    infos: Sequence[CheckpointInfo],
    retention: Retention | Policy,
    protected: Mapping[int, str] | None = None,
) -> dict[int, list[str]]:
    """For each step, why it is kept (empty list: it would be removed).

    ``retention`` is a Retention or any policy (a KeepAny is explained part by
    part). ``protected`` maps protected steps to their reason ("latest", "writing").
    """
    reasons: dict[int, list[str]] = {i.step: [] for i in infos}
    for step, why in (protected or {}).items():
        if step in reasons:
            reasons[step].append(why)
    for policy in policies_of(retention):
        for step in policy.keep(infos):
            reasons[step].append(policy.reason())
    return reasons
