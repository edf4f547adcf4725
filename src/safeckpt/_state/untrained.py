"""Which tensors of a captured state nothing trains: the ones a save groups into files of their own.

A parameter with ``requires_grad=False`` that no optimizer of the state steps
(a frozen base under LoRA adapters, frozen embeddings or towers) is expected to
keep its bytes from one save to the next. That is only a guess about where to
look: whether a tensor is unchanged is decided by its content (its digest at
``save()``, :func:`digests_at_save`, or of its staged copy on the writer
thread: ``safeckpt._storage.reuse``), never by this flag. Buffers are left out:
a module updates them in ``forward`` (batch-norm statistics) whatever
``requires_grad`` says.
"""

from __future__ import annotations

from typing import Any

import torch

from .._util.torch_private import dtensor_local
from .walk import Captured

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


def untrained_keys(captured: Captured) -> frozenset[str]:
    """The DCP keys of the parameters that are frozen and stepped by no optimizer of the state.

    Matched by storage (data pointer, dtype, shape): the state dict's tensors are views of the
    parameters. Empty, at the cost of one look at each parameter, when nothing is frozen.
    """
    stepped = {id(p) for o in captured.optimizers for g in o.param_groups for p in g["params"]}
    frozen = set()
    for module in captured.modules:
        for p in module.parameters():
            if not p.requires_grad and id(p) not in stepped:
                frozen.add(_identity(p))
    if not frozen:
        return frozenset()
    return frozenset(key for key, tensor in captured.dcp.items() if _identity(tensor) in frozen)


def _identity(tensor: torch.Tensor) -> tuple[Any, ...]:
    local = dtensor_local(tensor) if DTensor is not None and isinstance(tensor, DTensor) else tensor
    return (local.data_ptr(), local.dtype, tuple(local.shape), local.numel() > 0)


def digests_at_save(dcp: dict[str, Any], keys: frozenset[str]) -> dict[str, str]:
    """The content digest of each untrained tensor among ``dcp[keys]`` that can be digested where it
    is (a plain tensor in host memory), taken now: at ``save()``, on the training thread.

    XXH3-128 reads several times faster than a copy writes (``docs/performance.md``), so a save
    whose untrained tensors have the digests of the previous ``save()`` takes no copy of them:
    their bytes are those of that save, which the writer shares or, where it cannot, writes after
    checking the live bytes still have this digest (``safeckpt._storage.writer``). A tensor on a
    device, or a DTensor, is copied as before (its bytes are not in host memory to digest)."""
    from .._format.content_digest import digest  # xxhash, loaded with the first frozen save

    out = {}
    for key in keys:
        tensor = dcp.get(key)
        if not isinstance(tensor, torch.Tensor) or (DTensor is not None and isinstance(tensor, DTensor)):
            continue
        # As its staged copy would be (contiguous, a storage of its own): the same digest.
        on_host = tensor.device.type == "cpu" and tensor.layout == torch.strided
        if on_host and tensor.is_contiguous() and _owns_its_storage(tensor):
            out[key] = digest(tensor)
    return out


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes
