"""State a rank keeps for itself: ``safeckpt.per_rank(value)``, saved in the rank's own file."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedStateError


class PerRank:
    """State that differs between ranks, kept by each rank for itself (see :func:`per_rank`)."""

    __slots__ = ("value",)
    value: Any

    def __init__(self, value: Any) -> None:
        if isinstance(value, PerRank):
            value = value.value
        if isinstance(value, (nn.Module, torch.optim.Optimizer)):
            raise UnsupportedStateError(
                f"per_rank() takes a Stateful, a tensor or a dict/list/tuple, not a "
                f"{type(value).__name__}: a model's and an optimizer's tensors are replicas or "
                "DTensor shards, which DCP saves once. Pass the model or optimizer itself."
            )
        self.value = value

    def saved(self) -> Any:
        """What is saved: the ``state_dict()`` of a ``Stateful``, else the value itself."""
        return self.value.state_dict() if is_stateful(self.value) else self.value

    def __repr__(self) -> str:
        return f"per_rank({self.value!r})"


def per_rank(value: Any) -> PerRank:
    """Mark ``value`` as this rank's own: saved in the rank's own file and restored to the same rank.

    For state that differs between ranks, such as a data loader's position or a
    rank's own ``torch.Generator`` state: ``{"model": model, "data":
    safeckpt.per_rank(loader)}``, in ``save()`` and in ``restore()``.
    ``value`` is a ``Stateful`` (``state_dict()`` at save, ``load_state_dict()``
    at restore) or a tensor, dict, list or tuple of tensors and plain values
    (restored in place: a tensor of the same shape and dtype is copied into).
    Without it, a plain tensor that every rank holds under one key is saved
    once, as DCP saves replicas, and every rank gets that one copy back.
    ``safeckpt.load`` returns the first rank's.
    """
    return PerRank(value)


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
