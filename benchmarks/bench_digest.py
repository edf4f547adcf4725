"""Content-digest throughput on this CPU, the number behind safeckpt's choice of XXH3-128 (not a test).

    .venv/bin/python benchmarks/bench_digest.py [--mib 256] [--reps 5]

Prints a Markdown table: GB/s of safeckpt's digest of an untrained tensor
(``safeckpt._format.content_digest.digest``: XXH3-128 over a header and the
tensor's bytes, in place) and of the strong hashes it was weighed against, over
the same random tensor (median of ``--reps``), next to a memcpy of it. blake3
is measured where the ``blake3`` package is installed (it is no dependency).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from safeckpt._format.content_digest import digest


def _bytes_of(tensor: torch.Tensor) -> Any:
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).numpy()


def _candidates(tensor: torch.Tensor) -> list[tuple[str, Callable[[], Any]]]:
    raw = _bytes_of(tensor)
    found: list[tuple[str, Callable[[], Any]]] = [
        ("safeckpt digest (XXH3-128 of header + bytes)", lambda: digest(tensor)),
        ("hashlib blake2b-256", lambda: hashlib.blake2b(raw, digest_size=32).digest()),
        ("hashlib sha256", lambda: hashlib.sha256(raw).digest()),
    ]
    try:
        import blake3  # type: ignore[import-not-found]

        found.append(("blake3 (one thread)", lambda: blake3.blake3(raw).digest()))
    except ImportError:
        print("blake3: not installed", file=sys.stderr)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    tensor = torch.randn((args.mib << 20) // 4)
    rows = []
    for label, fn in _candidates(tensor):
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        rows.append((label, tensor.nbytes / statistics.median(times) / 1e9))
    target = torch.empty_like(tensor)
    target.copy_(tensor)  # fault the pages in first
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        target.copy_(tensor)
        times.append(time.perf_counter() - start)
    rows.append(("memcpy (torch copy_, for scale)", tensor.nbytes / statistics.median(times) / 1e9))
    command = "`.venv/bin/python benchmarks/bench_digest.py`"
    print(f"Produced by {command} over {args.mib} MiB, median of {args.reps}.")
    print()
    print("| implementation | GB/s |")
    print("|---|---|")
    for label, rate in rows:
        print(f"| {label} | {rate:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
