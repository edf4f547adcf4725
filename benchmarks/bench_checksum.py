"""Checksum throughput on this CPU, the number behind safeckpt's choice of CRC32 (not a test).

    .venv/bin/python benchmarks/bench_checksum.py [--mib 256] [--reps 5]

Prints a Markdown table: GB/s of each implementation over the same random
buffer (median of ``--reps``), next to a memcpy of it. safeckpt uses zlib-ng's
CRC32 (the zip polynomial, the one a ``.distcp`` archive carries anyway), and
falls back to isal, then to zlib, where zlib-ng is missing.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch


def _candidates() -> list[tuple[str, Callable[[Any], Any]]]:
    found: list[tuple[str, Callable[[Any], Any]]] = [("zlib.crc32 (CRC32, system zlib)", zlib.crc32)]
    optional = [
        ("zlib_ng.zlib_ng", "crc32", "zlib-ng crc32 (CRC32; safeckpt's)"),
        ("isal.isal_zlib", "crc32", "isal crc32 (CRC32)"),
        ("crc32c", "crc32c", "crc32c (CRC32C, SSE4.2)"),
        ("google_crc32c", "value", "google-crc32c (CRC32C)"),
        ("xxhash", "xxh3_64_intdigest", "xxhash xxh3_64"),
    ]
    for module, name, label in optional:
        try:
            found.append((label, getattr(importlib.import_module(module), name)))
        except (ImportError, AttributeError):
            print(f"{label}: not installed", file=sys.stderr)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    data = os.urandom(args.mib << 20)
    rows = []
    for label, fn in _candidates():
        try:
            fn(data[:4096])
        except TypeError as e:  # an implementation that refuses this buffer type
            print(f"{label}: {e}", file=sys.stderr)
            continue
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            fn(data)
            times.append(time.perf_counter() - start)
        rows.append((label, len(data) / statistics.median(times) / 1e9))
    source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)  # fault the pages in first
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    rows.append(("memcpy (torch copy_, for scale)", len(data) / statistics.median(times) / 1e9))
    command = "`.venv/bin/python benchmarks/bench_checksum.py`"
    print(f"Produced by {command} over {args.mib} MiB, median of {args.reps}.")
    print()
    print("| implementation | GB/s |")
    print("|---|---|")
    for label, rate in rows:
        print(f"| {label} | {rate:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
