"""When to save: every N steps, at milestone steps, every T seconds. Pure: no clock, no rank.

:class:`SaveSchedule` answers from the step (and, for ``every_seconds``, from
the seconds since the last save that the caller measured). The manager's
``should_save(step)`` adds what needs agreement between ranks: rank 0's clock
decides the time-based answer, and a preemption signal on any rank makes every
rank save.

:class:`Milestones` is shared with retention: ``Retention(keep_milestones=...)``
keeps the checkpoints a ``SaveSchedule(milestones=...)`` saves.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConfigError

POW2 = "pow2"


@dataclass(frozen=True)
class Milestones:
    """Milestone steps: explicit ones, or the powers of two (1, 2, 4, 8, ...), within a window.

    ``start`` and ``stop`` (both inclusive) bound the window; ``stop=None`` has
    no upper bound. ``Milestones("pow2", start=1024)`` is 1024, 2048, 4096, ...
    """

    steps: tuple[int, ...] | Literal["pow2"] = ()
    start: int = 0
    stop: int | None = None

    def __post_init__(self) -> None:
        steps = self.steps
        if isinstance(steps, str):
            if steps != POW2:
                raise ConfigError(f"Milestones({steps!r}): use 'pow2' or a list of steps.")
        else:
            try:
                clean = tuple(sorted({_non_negative("a milestone step", s) for s in steps}))
            except TypeError:
                raise ConfigError(
                    f"Milestones({steps!r}): use 'pow2' or a list of non-negative integer steps."
                ) from None
            object.__setattr__(self, "steps", clean)
        _non_negative("Milestones(start=...)", self.start)
        if self.stop is not None:
            _non_negative("Milestones(stop=...)", self.stop)
            if self.stop < self.start:
                raise ConfigError(
                    f"Milestones(start={self.start}, stop={self.stop}): stop must not be below start."
                )

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int) or isinstance(step, bool):
            return False
        if step < self.start or (self.stop is not None and step > self.stop):
            return False
        if self.steps == POW2:
            return step > 0 and step & (step - 1) == 0
        return step in self.steps

    def describe(self) -> str:
        """A few words for ``safeckpt ls`` and logs."""
        if self.steps == POW2:
            what = "power-of-two steps"
        else:
            shown = ", ".join(map(str, self.steps[:5])) + (", ..." if len(self.steps) > 5 else "")
            what = f"steps {shown}"
        if self.start or self.stop is not None:
            what += f" in [{self.start}, {'...' if self.stop is None else self.stop}]"
        return what

    def to_json(self) -> dict[str, Any]:
        steps = self.steps if self.steps == POW2 else list(self.steps)
        return {"steps": steps, "start": self.start, "stop": self.stop}

    @classmethod
    def of(cls, value: MilestonesLike | None) -> Milestones | None:
        """``value`` as Milestones: ``"pow2"``, a list of steps, a ``to_json()`` dict, or Milestones."""
        if value is None or isinstance(value, Milestones):
            return value
        try:
            if isinstance(value, dict):
                return cls(**value)
            if isinstance(value, str):
                return cls(value)
            return cls(tuple(value))
        except TypeError:
            raise ConfigError(
                f"milestones={value!r}: use 'pow2', a list of steps, or Milestones(...)."
            ) from None


MilestonesLike = Milestones | Literal["pow2"] | Iterable[int] | dict


@dataclass(frozen=True, kw_only=True)
class SaveSchedule:
    """Which steps to save. A step is due if any rule says so.

    ``mgr.should_save(step)`` asks it (pass the number of steps completed, as
    to ``save()``); the manager also answers True after a preemption signal.
    """

    every: int | None = None
    """Save at every multiple of this step count (N, 2N, 3N, ...; never at step 0)."""

    milestones: Milestones | Literal["pow2"] | Iterable[int] | None = None
    """Save at these steps: a list, ``"pow2"`` (1, 2, 4, 8, ...), or :class:`Milestones` with a window.
    Keep them with ``Retention(keep_milestones=...)`` and the same value."""

    every_seconds: float | None = None
    """Save when this many seconds passed since the last save (or since the manager opened).
    Rank 0's clock decides, so every rank answers the same."""

    def __post_init__(self) -> None:
        if self.every is not None:
            _positive_int("SaveSchedule(every=...)", self.every)
        object.__setattr__(self, "milestones", Milestones.of(self.milestones))
        check_seconds("SaveSchedule(every_seconds=...)", self.every_seconds)

    @property
    def timed(self) -> bool:
        """Whether answers depend on a clock (and so need agreement between ranks)."""
        return self.every_seconds is not None

    def due_at_step(self, step: int) -> bool:
        """Whether ``step`` is due by the step rules (``every``, ``milestones``)."""
        if self.every is not None and step > 0 and step % self.every == 0:
            return True
        milestones = self.milestones
        return isinstance(milestones, Milestones) and step in milestones

    def due_by_time(self, seconds_since_save: float) -> bool:
        """Whether ``every_seconds`` have passed, given the seconds since the last save."""
        return self.every_seconds is not None and seconds_since_save >= self.every_seconds


def check_seconds(what: str, value: Any) -> None:
    """Raise ConfigError unless ``value`` is None or a positive, finite number of seconds."""
    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{what}: must be a positive number of seconds or None, got {value!r}.")


def _non_negative(what: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{what}: must be a non-negative integer, got {value!r}.")
    try:
        number = operator.index(value)
    except TypeError:
        raise ConfigError(f"{what}: must be a non-negative integer, got {value!r}.") from None
    if number < 0:
        raise ConfigError(f"{what}: must be a non-negative integer, got {number}.")
    return number


def _positive_int(what: str, value: Any) -> None:
    if _non_negative(what, value) == 0:
        raise ConfigError(f"{what}: must be a positive integer, got 0.")
