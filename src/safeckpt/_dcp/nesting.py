"""The two levels safeckpt hands DCP, and their flattening.

DCP flattens whatever it is given into dot-joined keys, walking it in Python,
tensor by tensor. safeckpt hands it its flat keys nested by their first
segment (:func:`nest_for_dcp`), and undoes that itself (:func:`flatten_nested`)
into exactly what DCP's walk gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def nest_for_dcp(flat: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``flat`` as two levels (first key segment -> the rest) that DCP flattens back to the same keys.

    DCP does per-key work (a ``Stateful`` protocol check, a logging context) for
    every top-level key it is given; nested, that is once per group instead of
    once per tensor (a state of many small tensors loads faster).
    """
    leaves = {fqn for fqn in flat if "." not in fqn}
    out: dict[str, Any] = {}
    for fqn, tensor in flat.items():
        head, dot, tail = fqn.partition(".")
        if not dot or head in leaves:  # a group cannot share its name with a tensor
            out[fqn] = tensor
        else:
            out.setdefault(head, {})[tail] = tensor
    return out


def flatten_nested(
    nested: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, tuple[str | int, ...]]] | None:
    """What DCP's ``flatten_state_dict`` gives for :func:`nest_for_dcp`'s output, without its walk.

    DCP's walk costs Python time per tensor on every save and restore. None for anything else
    (another shape, a ShardedTensor, a meta tensor DCP would materialize, two keys flattening
    alike): DCP then flattens.
    """
    flat: dict[str, Any] = {}
    paths: dict[str, tuple[str | int, ...]] = {}  # DCP's FLATTEN_MAPPING
    for head, value in nested.items():
        if not isinstance(head, str):
            return None
        leaves = value.items() if isinstance(value, dict) and value else [(None, value)]
        for tail, leaf in leaves:
            if not _plain_leaf(leaf) or (tail is not None and not isinstance(tail, str)):
                return None
            fqn, path = (head, (head,)) if tail is None else (f"{head}.{tail}", (head, tail))
            if fqn in flat:
                return None
            flat[fqn] = leaf
            paths[fqn] = path
    return flat, paths


def _plain_leaf(value: Any) -> bool:
    """A tensor DCP's flattening passes through as it is (not a ShardedTensor, not on meta)."""
    return type(value) in (torch.Tensor, nn.Parameter, DTensor) and value.device.type != "meta"
