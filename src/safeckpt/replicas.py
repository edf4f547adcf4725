"""Plain tensors that DCP takes for replicas, checked to be the same on every rank.

DCP stores a plain (non-DTensor) tensor that several ranks hold under one key
once, and every rank gets that copy back: right for a DDP model's parameters,
wrong for what each rank holds for itself (a data loader's order, a
generator's state), which belongs in :func:`safeckpt.per_rank`. Each rank
fingerprints its small plain tensors after writing (a CRC32 of the bytes; the
per-rank state one forgets to wrap is small, and large replicas are left
alone to keep the check cheap), the fingerprints travel with the checksums
rank 0 gathers anyway, and rank 0 warns about every key whose bytes differ.
A warning, not an error: some runs keep per-rank replicas on purpose (DDP
with ``broadcast_buffers=False``), and DCP's one copy is what they get.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .integrity import crc32

__all__ = ["SMALL_BYTES", "diverging", "fingerprints"]

SMALL_BYTES = 64 << 10  # plain tensors up to this size are fingerprinted
_MOST = 4096  # and at most this many of them per save


def fingerprints(dcp_state: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """``fqn -> CRC32`` of the small plain CPU tensors of one rank's DCP state."""
    out: dict[str, int] = {}
    for fqn, tensor in dcp_state.items():
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu":
            continue
        if tensor.numel() * tensor.element_size() > SMALL_BYTES or tensor.is_conj() or tensor.is_neg():
            continue
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        out[fqn] = crc32(memoryview(data))
        if len(out) >= _MOST:
            break
    return out


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
