"""safeckpt against AWS's PyTorch connector and DCP's fsspec path, on one S3 server, in one run.

    .venv/bin/python benchmarks/bench_s3_connectors.py [--size-mib 306] [--reps 5] [--threads 1,4,8]
    .venv/bin/python benchmarks/run_all.py --only bench_s3_connectors

Starts its own moto server on 127.0.0.1 and times, for two states (a transformer with its AdamW
moments, about 306 MiB; 10,000 tensors of 4 KiB in a nested dict):

* **save until durable**: safeckpt's ``save()`` then ``wait()`` (the checkpoint committed);
  ``dcp.save`` with ``s3torchconnector``'s ``S3StorageWriter`` at each ``--threads`` count (it
  writes that many objects per rank) and with DCP's fsspec writer (s3fs);
* **cold restore**: a new read-only manager's ``restore()``; ``dcp.load`` with
  ``S3StorageReader`` (its default, DCP-optimised reader) and with DCP's fsspec reader.

Each round runs every subject once, in an order rotated every round, saves first and then
restores, so moto's drift falls on all of them. The best peer is the one with the lowest median
(for s3torchconnector: its best thread count); safeckpt's ratio to it is the median of the
rounds' ratios, with their range. Each subject keeps one checkpoint (safeckpt ``keep_last=1``,
the peers overwrite theirs), so moto holds a few copies, not one per round.
Prints Markdown; exits 77 without moto or s3torchconnector.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import safeckpt
from bench_common import build_state, rotated_rounds
from bench_moto import SKIPPED, with_bucket
from bench_state import SMALL_NUMEL, SMALL_TENSORS
from s3_server import REGION, moto_version

MIB = 1 << 20
SAFECKPT = "safeckpt"


def small_state() -> dict[str, Any]:
    """10,000 tensors of 4 KiB in a nested dict (100 groups of 100)."""
    gen = torch.Generator().manual_seed(0)
    return {
        f"group{g}": {f"t{i}": torch.randn(SMALL_NUMEL, generator=gen) for i in range(SMALL_TENSORS // 100)}
        for g in range(100)
    }


class Subject:
    """One way to save and restore a state on ``bucket``: ``save()`` until durable, ``restore()`` cold."""

    def __init__(self, name: str, save: Callable[[], None], restore: Callable[[], None]) -> None:
        self.name, self.save, self.restore = name, save, restore


def subjects(bucket: str, state: dict[str, Any], label: str, threads: list[int]) -> list[Subject]:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    config = S3ClientConfig(force_path_style=True)  # moto serves buckets by path
    root = f"s3://{bucket}/{label}/safeckpt"
    steps = iter(range(1, 1 << 30))
    manager = safeckpt.CheckpointManager(root, async_save=True, retention=safeckpt.Retention(keep_last=1))

    def ours_save() -> None:
        manager.save(next(steps), state)
        manager.wait()

    def ours_restore() -> None:
        with safeckpt.CheckpointManager(root, read_only=True) as reader:
            reader.restore(state)

    out = [Subject(SAFECKPT, ours_save, ours_restore)]
    for n in threads:
        path = f"s3://{bucket}/{label}/s3tc-{n}"

        def s3tc_save(path: str = path, n: int = n) -> None:
            writer = S3StorageWriter(REGION, path, s3client_config=config, thread_count=n)
            dcp.save(state, storage_writer=writer, no_dist=True)

        def s3tc_restore(path: str = path) -> None:
            dcp.load(
                state, storage_reader=S3StorageReader(REGION, path, s3client_config=config), no_dist=True
            )

        out.append(Subject(f"s3torchconnector, {n} thread{'s' if n > 1 else ''}", s3tc_save, s3tc_restore))
    fsspec_path = f"s3://{bucket}/{label}/fsspec"
    out.append(
        Subject(
            "DCP fsspec (s3fs)",
            lambda: dcp.save(state, storage_writer=FsspecWriter(fsspec_path, sync_files=False), no_dist=True),
            lambda: dcp.load(state, storage_reader=FsspecReader(fsspec_path), no_dist=True),
        )
    )
    out[0].close = manager.close  # type: ignore[attr-defined]
    return out


def table(title: str, times: dict[str, list[float]], nbytes: int) -> str:
    peers = {name: t for name, t in times.items() if name != SAFECKPT}
    best = min(peers, key=lambda name: statistics.median(peers[name]))
    ratios = [ours / theirs for ours, theirs in zip(times[SAFECKPT], times[best], strict=True)]
    lines = [
        f"**{title}** (best peer: {best})",
        "",
        "| subject | median s | MB/s | / best peer |",
        "|---|---:|---:|---:|",
    ]
    for name, t in times.items():
        median = statistics.median(t)
        if name == SAFECKPT:
            ratio = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        else:
            ratio = f"{median / statistics.median(times[best]):.2f}x"
        lines.append(f"| {name} | {median:.2f} | {nbytes / median / 1e6:.0f} | {ratio} |")
    return "\n".join(lines)


def nbytes_of(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(nbytes_of(v) for v in state.values())
    return 0


def run(bucket: str, args: argparse.Namespace) -> int:
    large = build_state(args.size_mib * MIB, optimizer=True).flat()
    states = {"large": large, "small": small_state()}
    out = [f"moto {moto_version()}, {args.reps} rounds, s3torchconnector threads {args.threads}", ""]
    for label, state in states.items():
        if args.only and label != args.only:
            continue
        nbytes = nbytes_of(state)
        subs = subjects(bucket, state, label, args.threads)
        try:
            for s in subs:  # warm-up: allocations, connections, and a checkpoint to restore
                s.save()
                s.restore()
            saved = rotated_rounds({s.name: s.save for s in subs}, args.reps)
            restored = rotated_rounds({s.name: s.restore for s in subs}, args.reps)
        finally:
            subs[0].close()  # type: ignore[attr-defined]
        what = f"{label}: {nbytes / MIB:.0f} MiB" + (f", {SMALL_TENSORS} tensors" if label == "small" else "")
        out += [table(f"{what}, save until durable", saved, nbytes), ""]
        out += [table(f"{what}, cold restore", restored, nbytes), ""]
    print("\n".join(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=306)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=lambda s: [int(n) for n in s.split(",")], default=[1, 4, 8])
    parser.add_argument("--only", choices=["large", "small"])
    args = parser.parse_args(argv)
    try:
        import s3torchconnector.dcp  # noqa: F401
    except ImportError as e:
        print(f"bench_s3_connectors: s3torchconnector[dcp] is not installed ({e})", file=sys.stderr)
        return SKIPPED
    os.environ.setdefault("AWS_REGION", REGION)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")  # no_dist
    return with_bucket("bench_s3_connectors", lambda endpoint, bucket: run(bucket, args))


if __name__ == "__main__":
    sys.exit(main())
