"""Two tiers: how soon a save is committed with ``local_dir=``, against saving to the root directly.

    .venv/bin/python benchmarks/bench_tiers.py [--size-mib 192] [--reps 5]
    .venv/bin/python benchmarks/run_all.py --only bench_tiers     # into benchmarks/results.md

The durable tier is an ``s3://`` prefix on a moto server this script starts on 127.0.0.1
(``tests/support/s3_server.py``); the local tier a directory on this machine's disk. Both managers save
the same state to the same server in the same run, in rounds (each round saves once with each,
in a rotated order). Rows, each a median over the rounds: how long ``save()`` blocks (async),
then how long until the save is committed locally (``wait()``) and until it is committed in the
root (``wait(durable=True)``; without ``local_dir`` that is ``wait()``). Prints Markdown; exits 77
without moto.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

import safeckpt
from bench_common import build_state
from bench_moto import with_bucket
from s3_server import moto_version

MIB = 1 << 20
OPTIONS = {"part_size": 16 * MIB, "max_concurrency": 8}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=192)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    return with_bucket("bench_tiers", lambda _, bucket: _run(bucket, args.size_mib * MIB, args.reps))


def _run(bucket: str, size: int, reps: int) -> int:
    bench = build_state(size, optimizer=True)
    times: dict[str, dict[str, list[float]]] = {"direct": {}, "tiers": {}}
    steps = iter(range(1, 1 << 30))
    keep = safeckpt.Retention(keep_last=2)  # the deletes of pruning run too, as in a real job

    def save(mgr: safeckpt.CheckpointManager, kind: str) -> None:
        rows = times[kind]
        start = time.perf_counter()
        mgr.save(next(steps), bench.state)
        rows.setdefault("save() returns", []).append(time.perf_counter() - start)
        mgr.wait()
        rows.setdefault("committed locally", []).append(time.perf_counter() - start)
        mgr.wait(durable=True)
        rows.setdefault("committed in the root", []).append(time.perf_counter() - start)

    with (
        tempfile.TemporaryDirectory() as local,
        safeckpt.CheckpointManager(
            f"s3://{bucket}/direct", retention=keep, storage_options=OPTIONS
        ) as direct,
        safeckpt.CheckpointManager(
            f"s3://{bucket}/tiers", local_dir=local, retention=keep, storage_options=OPTIONS
        ) as tiers,
    ):
        managers = [(direct, "direct"), (tiers, "tiers")]
        for mgr, kind in managers:  # the first save allocates the staging buffers
            save(mgr, kind)
            times[kind].clear()
        for r in range(reps):
            for mgr, kind in managers[r % 2 :] + managers[: r % 2]:
                save(mgr, kind)
    print(_markdown(times, bench.nbytes, reps))
    return 0


def _markdown(times: dict[str, dict[str, list[float]]], nbytes: int, reps: int) -> str:
    def ms(kind: str, row: str) -> str:
        return f"{statistics.median(times[kind][row]) * 1000:.0f} ms"

    direct, tiers = times["direct"], times["tiers"]
    out = [
        f"State: {nbytes / MIB:.0f} MiB (a transformer and its AdamW moments, fp32); durable tier: "
        f"moto {moto_version()} on 127.0.0.1 (16 MiB parts, 8 at once); local tier: a directory on "
        f"this machine's disk; async saves, keep_last=2 in each tier; median of {reps} rounds, each "
        "saving once with each manager.",
        "",
        "| until | root only | with `local_dir` | with / without |",
        "|---|---:|---:|---:|",
    ]
    for row in ("save() returns", "committed locally", "committed in the root"):
        without = "committed in the root" if row == "committed locally" else row
        ratio = statistics.median(tiers[row]) / statistics.median(direct[without])
        shown = "(no local tier)" if row == "committed locally" else ms("direct", row)
        out.append(f"| {row} | {shown} | {ms('tiers', row)} | {ratio:.2f}x |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
