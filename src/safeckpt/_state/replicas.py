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
A rank with more than ``MOST`` plain tensors fingerprints a share of them in
each save, chosen by a hash of the key and of the step, so every key is
checked within a few saves and ranks that hold a key agree on whether it is
in this save's share (the share of a rank with fewer tensors holds the share
of one with more: each is a power-of-two fraction of the same hashes).
A warning, not an error: some runs keep per-rank replicas on purpose (DDP
with ``broadcast_buffers=False``), and DCP's one copy is what they get.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import torch

from .._format.checksums import crc32

__all__ = ["BLOCKS", "MOST", "SMALL_BYTES", "diverging", "fingerprints"]

SMALL_BYTES = 64 << 10  # plain tensors up to this size are fingerprinted whole
BLOCKS = 64  # evenly spaced cache lines of a larger one that its fingerprint covers
_LINE = 64
MOST = 4096  # about as many tensors fingerprinted per save, at most: what rank 0 gathers stays small
# A sync save hands over the live (maybe CUDA) tensors; only the sampled bytes come to the host.
_DEVICES = ("cpu", "cuda")


def fingerprints(dcp_state: Mapping[str, torch.Tensor], step: int = 0) -> dict[str, int]:
    """``fqn -> CRC32`` of the plain CPU and CUDA tensors of one rank's DCP state (a sample of the
    large ones); of this ``step``'s share of them where there are more than :data:`MOST`."""
    plain = [
        (fqn, tensor)
        for fqn, tensor in dcp_state.items()
        if type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type in _DEVICES
    ]
    share = 1
    while len(plain) > MOST * share:
        share *= 2
    phase = crc32(struct.pack("<q", step)) if share > 1 else 0
    out: dict[str, int] = {}
    for fqn, tensor in plain:
        if share > 1 and (crc32(fqn.encode()) ^ phase) & (share - 1):
            continue  # another save's share
        if tensor.is_conj() or tensor.is_neg() or tensor.is_quantized:
            continue
        try:
            found = _fingerprint(tensor.detach())
        except (RuntimeError, TypeError, ValueError):  # a layout numpy cannot view: never fail a save
            found = None
        if found is not None:
            out[fqn] = found
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
    # numpy declares ndarray.__buffer__ only for Python >= 3.12 (it has the buffer protocol)
    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).cpu().numpy())  # type: ignore[arg-type]


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
