"""The checks of the public API's arguments that several methods share, one clear error each."""

from __future__ import annotations

import operator
from typing import Any

from ..errors import CheckpointError, ConfigError, InvalidSaveError

__all__ = ["int_or_none", "positive_int", "positive_seconds", "seconds", "validate_or_none", "validate_step"]


def positive_seconds(name: str, value: Any) -> float:
    """``value`` as seconds, if it is a positive finite number (else a ``ConfigError`` naming ``name``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{name}={value!r}: must be a positive number of seconds.")
    return float(value)


def seconds(name: str, value: Any) -> float:
    """``value`` as seconds, if it is a finite number >= 0 (else a ``ConfigError`` naming ``name``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ConfigError(f"{name}={value!r}: must be a number of seconds >= 0.")
    return float(value)


def positive_int(name: str, value: Any) -> int:
    """``value``, if it is an int >= 1 (else a ``ConfigError`` naming ``name``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}: must be a positive integer.")
    return value


def validate_step(step: Any) -> int:
    """``step`` as an int, if it is a non-negative integer (numpy ints too; never a bool)."""
    if isinstance(step, bool):
        raise InvalidSaveError(f"step must be a non-negative integer, got {step!r}.")
    try:
        value = operator.index(step)
    except TypeError:
        raise InvalidSaveError(
            f"step must be a non-negative integer, got {type(step).__name__} {step!r}."
        ) from None
    if value < 0:
        raise InvalidSaveError(f"step must be non-negative, got {value}.", step=value)
    return value


def validate_or_none(step: Any) -> int | None:
    """:func:`validate_step`, or None for None."""
    return None if step is None else validate_step(step)


def int_or_none(step: Any) -> int | None:
    """``step`` as an int where it is a valid step, else None (for messages about a bad call)."""
    try:
        return validate_step(step)
    except CheckpointError:
        return None
