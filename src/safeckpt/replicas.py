"""Plain tensors that DCP takes for replicas, checked to be the same on every rank.

DCP stores a plain (non-DTensor) tensor that several ranks hold under one key
once, and every rank gets that copy back: right for a DDP model's parameters,
wrong for what each rank holds for itself (a data loader's order, a
generator's state), which belongs in :func:`safeckpt.per_rank`, and for plain
tensors that hold different parts of one weight (tensor parallelism without
DTensor), which DCP would keep one of. Each rank fingerprints its plain tensors
after writing: a CRC32 of all the bytes of a small one, of evenly spaced
cache lines of a larger (contiguous) one, so the check stays cheap for a large
replicated model and still sees tensors that differ throughout.
The fingerprints travel with the checksums rank 0 gathers anyway, and rank 0
warns about every key whose fingerprints differ (which means its bytes do).
A warning, not an error: some runs keep per-rank replicas on purpose (DDP
with ``broadcast_buffers=False``), and DCP's one copy is what they get.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import torch

from .integrity import crc32

__all__ = ["BLOCKS", "SMALL_BYTES", "diverging", "fingerprints"]

SMALL_BYTES = 64 << 10  # plain tensors up to this size are fingerprinted whole
BLOCKS = 64  # evenly spaced cache lines of a larger one that its fingerprint covers
_LINE = 64
_MOST = 4096  # tensors fingerprinted per save, at most


def fingerprints(dcp_state: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """``fqn -> CRC32`` of the plain CPU tensors of one rank's DCP state (a sample of the large ones)."""
    out: dict[str, int] = {}
    for fqn, tensor in dcp_state.items():
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu":
            continue
        if tensor.is_conj() or tensor.is_neg() or tensor.is_quantized:
            continue
        try:
            found = _fingerprint(tensor.detach())
        except (RuntimeError, TypeError, ValueError):  # a layout numpy cannot view: never fail a save
            found = None
        if found is None:
            continue
        out[fqn] = found
        if len(out) >= _MOST:
            break
    return out


def _fingerprint(tensor: torch.Tensor) -> int | None:
    """CRC32 of all of a small tensor's bytes; of a larger one's shape and ``BLOCKS`` evenly spaced
    cache lines of its bytes, first and last included (a few microseconds, where a strided sample
    of elements costs a cache miss each). None for a large tensor that is not contiguous."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes <= SMALL_BYTES:
        return crc32(_bytes(tensor))
    if not tensor.is_contiguous():
        return None  # its bytes in order would be a copy of all of it
    raw = tensor.reshape(-1).view(torch.uint8)
    blocks = raw.as_strided((BLOCKS, _LINE), ((nbytes - _LINE) // (BLOCKS - 1), 1))
    return crc32(_bytes(blocks), crc32(struct.pack(f"<{tensor.dim()}q", *tensor.shape)))


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def diverging(per_rank: Sequence[Mapping[str, int]]) -> dict[str, list[int]]:
    """The keys whose fingerprints differ between ranks, each with the ranks that hold it."""
    holders: dict[str, list[int]] = {}
    for rank, prints in enumerate(per_rank):
        for fqn in prints:
            holders.setdefault(fqn, []).append(rank)
    return {
        fqn: ranks
        for fqn, ranks in holders.items()
        if len(ranks) > 1 and len({per_rank[r][fqn] for r in ranks}) > 1
    }
