"""The content digest of a tensor as a data file stores it (see :mod:`safeckpt._format.contents`).

XXH3-128 over a header (dtype, shape, strides, storage offset) and the bytes the
tensor's archive holds: two tensors with one digest have the same archive, so a
file of untrained tensors whose every digest matches the earlier file's can be
shared instead of written. Computed at ``save()`` for untrained tensors in host
memory, else on the staged copy on the writer thread.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import xxhash

from .contents import DIGEST

__all__ = ["DIGEST", "as_archived", "digest"]


def as_archived(data: torch.Tensor) -> torch.Tensor:
    """The tensor a data file's archive is written from: on the CPU, and a storage of its own size
    (as DCP does: never the rest of a larger storage)."""
    tensor = data.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


def digest(data: torch.Tensor) -> str:
    """The hex XXH3-128 digest of ``data`` as its archive stores it."""
    tensor = as_archived(data)
    hasher = xxhash.xxh3_128()
    header = f"{tensor.dtype}|{tuple(tensor.shape)}|{tensor.stride()}|{tensor.storage_offset()}|"
    hasher.update(header.encode())
    raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    if raw.numel():
        hasher.update(cast(Any, raw.numpy()))  # the bytes in place: no copy
    return hasher.hexdigest()
