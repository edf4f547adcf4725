"""Where a stored tensor's bytes go: whether a target can be filled in place, read straight into,
or filled by a run's ``_foreach_copy_``, and the narrowing that picks an item's part of a tensor."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch.distributed.checkpoint.planner import ReadItem

from .torchsave.reader import _Layout


def fillable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or where filling it in place would be refused its view outside autograd (a
    parameter, a tensor that requires grad, an inference tensor: ``copy_`` into it is refused outside
    inference mode, into its view it is not). The view costs a Python object per tensor."""
    plain = type(tensor) is torch.Tensor and not tensor.requires_grad and not tensor.is_inference()
    return tensor if plain else tensor.detach()


def reads_straight_into(target: torch.Tensor, saved: torch.Tensor, layout: _Layout) -> bool:
    """The stored bytes are exactly the target's bytes: same dtype, both dense, nothing narrowed."""
    return (
        target.is_cpu
        and target.dtype == layout.dtype
        and target.is_contiguous()
        and layout.dense
        and saved.size() == layout.tensor.size()
        and target.layout == torch.strided
        and not target.is_conj()
        and not target.is_neg()
    )


def runs_into(target: torch.Tensor, size: torch.Size) -> bool:
    """``target`` can be filled by a run's ``_foreach_copy_`` exactly as ``copy_`` fills it: a plain
    CPU tensor of the saved size (not a conjugate or negative view, which it refuses, nor an
    inference tensor, which ``copy_`` refuses outside inference mode)."""
    return (
        type(target) is torch.Tensor
        and target.is_cpu
        and target.size() == size
        and not target.is_conj()
        and not target.is_neg()
        and not target.is_inference()
    )


def fits(layout: _Layout, item: ReadItem) -> bool:
    """The part ``item`` asks for lies inside a tensor of ``layout``."""
    size = layout.tensor.size()
    if len(item.storage_offsets) != len(size) or len(item.lengths) != len(size):
        return False
    parts = zip(item.storage_offsets, item.lengths, size, strict=True)
    return all(o >= 0 and o + n <= d for o, n, d in parts)


def saved(layout: _Layout, item: ReadItem) -> torch.Tensor:
    """The part of the stored tensor that ``item`` asks for (a view of the meta tensor)."""
    return narrow(layout.tensor, item.storage_offsets, item.lengths)


def place(storage: torch.Tensor, layout: _Layout, item: ReadItem, target: torch.Tensor) -> None:
    """Copy the item's part of the stored bytes (read into ``storage``) into ``target``."""
    meta = layout.tensor
    full = torch.empty(0, dtype=layout.dtype).set_(
        storage.untyped_storage(), meta.storage_offset(), meta.size(), meta.stride()
    )
    target.copy_(narrow(full, item.storage_offsets, item.lengths))


def pread_exact(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise EOFError("the checkpoint file is shorter than its metadata says")
    return data


def narrow(tensor: torch.Tensor, offsets: Iterable[int], lengths: Iterable[int]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start != 0 or length != tensor.size(dim):
            tensor = torch.narrow(tensor, dim, start, length)
    return tensor
