"""Two ranks (gloo, CPU): sharded saves against two parallel raw write streams (not a test).

    .venv/bin/python benchmarks/bench_ranks.py                     # 1 GiB state over 2 ranks, 5 reps
    .venv/bin/python benchmarks/bench_ranks.py --size-gib 0.25 --reps 3

It starts two processes that form a gloo group. The state is bench_common's
transformer and its AdamW moments, FSDP2-sharded over both ranks: each rank
holds half of every tensor and writes its own shards. Every value is a ratio
against a limit measured in the same repetition by the same two processes:

* aggregate save: the time until both ranks' save is durable (the slower
  rank) / the time for both ranks to write their shards' bytes to a new file
  each, at the same moment, with fsync (two parallel raw write streams; the
  fastest of ``bench_limits.WriteLimit``'s strategies, each run on both ranks);
* blocking time per rank: how long each rank's async ``save()`` holds training
  / that rank's memcpy of its shards into preallocated host buffers.

Repetitions are interleaved (the order of the variants rotates); a barrier
starts every variant on both ranks at once. Every write goes to a new path and
nothing is deleted inside a timing: a save's previous checkpoint is pinned
during it and pruned after it (``bench_common.held``), and what a repetition
wrote is deleted after it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (
    BEATEN,
    GIB,
    Report,
    Table,
    build_state,
    filesystem_of,
    held,
    host_buffers,
    interleaved,
    machine,
    memcpy,
    settle,
)
from bench_limits import Scratch, WriteLimit
from safeckpt import CheckpointManager, Retention

WORLD = 2


def shard(state: Any) -> None:
    """FSDP2 over the CPU mesh: every block, then the whole model (optimizer built after)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for block in state.model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(state.model, mesh=mesh)


def build_sharded(size_bytes: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The manager's state, and this rank's local shards of every tensor in it."""
    bench = build_state(size_bytes // 3, optimizer=False)  # the AdamW moments add twice the model
    shard(bench)
    optim = torch.optim.AdamW(bench.model.parameters(), lr=1e-4)
    for p in bench.model.parameters():
        p.grad = torch.randn_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    local = [p.to_local() for p in bench.model.parameters()]
    local += [v.to_local() for s in optim.state.values() for v in s.values() if v.dim() > 0]
    return {"model": bench.model, "optim": optim}, [t.detach() for t in local]


def per_rank(seconds: float) -> list[float]:
    """Every rank's ``seconds``, in rank order (collective)."""
    out: list[float] = [0.0] * WORLD
    dist.all_gather_object(out, seconds)
    return out


def each_rank(fn: Callable[[], Any]) -> list[float]:
    """Seconds ``fn`` takes on each rank, started at the same moment on all."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return per_rank(time.perf_counter() - start)


def timed_together(fn: Callable[[], Any]) -> float:
    """Seconds until ``fn`` is done on every rank (the slower rank's time)."""
    return max(each_rank(fn))


def rank_main(rank: int, port: int, args: argparse.Namespace, report_path: str, command: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=10))
    torch.set_num_threads(1)  # two ranks share the two cores
    started = time.perf_counter()
    work = Path(args.work)
    state, local = build_sharded(int(args.size_gib * GIB))
    buffers = host_buffers(local)
    local_bytes = sum(t.numel() * t.element_size() for t in local)

    aggregate = Table(
        "aggregate",
        "Aggregate save throughput, 2 ranks",
        "time until both ranks' save is durable / two parallel raw write streams",
        limit="each rank writes its shards' bytes to a new file of its own with fsync, both at once "
        "(the fastest strategy)",
        bound=True,
    )
    blocking = Table(
        "blocking-per-rank",
        "Async save: blocking time per rank, 2 ranks",
        "time a rank's async `save()` holds training / that rank's memcpy",
        limit="`copy_` of the rank's shards into preallocated host buffers",
    )
    aggregate.row("safeckpt sync save", target=1.10)
    aggregate.row("safeckpt async save, until wait() returns", target=1.50)
    aggregate.row("dcp.save")
    for r in range(WORLD):
        blocking.row(f"safeckpt, rank {r}", target=1.30)

    # keep_last=1, but held(): the previous checkpoint is pruned after each timing, never inside it
    sync_mgr = CheckpointManager(work / "sync", async_save=False, retention=Retention(keep_last=1))
    async_mgr = CheckpointManager(work / "async", retention=Retention(keep_last=1))
    step = 0
    (work / f"rank{rank}").mkdir(exist_ok=True)
    scratch = Scratch(work / f"rank{rank}")
    limit = WriteLimit([t.contiguous() for t in local], scratch)

    def raw(rep: int) -> dict[str, float]:
        times = {}
        for name in interleaved(list(limit.strategies), rep):
            path = limit.prepare(name)
            settle()
            times[name] = timed_together(lambda name=name, path=path: limit.write(name, path))
        return times

    def dcp_save(rep: int) -> None:
        target = work / f"dcp.{rep}"  # a new directory each time; deleted after the repetition
        dcp.save(state, storage_writer=FileSystemWriter(target, sync_files=True))

    for rep in range(args.reps + 1):  # rep 0 warms up (staging buffers, page cache, groups)
        raw_times = raw(rep)
        copy_s = each_rank(lambda: memcpy(local, buffers))
        results: dict[str, Any] = {}
        for name in interleaved(["sync", "async", "dcp"], rep):
            settle()
            dist.barrier()
            if name == "sync":
                step += 1
                with held(sync_mgr):
                    results[name] = timed_together(lambda s=step: sync_mgr.save(s, state))
            elif name == "async":
                step += 1
                returned: list[float] = []

                def save_async(s: int = step, returned: list[float] = returned) -> None:
                    begin = time.perf_counter()
                    async_mgr.save(s, state)
                    returned.append(time.perf_counter() - begin)
                    async_mgr.wait()

                with held(async_mgr):
                    results[name] = timed_together(save_async)
                results["blocking"] = per_rank(returned[0])
            else:
                results[name] = timed_together(lambda rep=rep: dcp_save(rep))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work / f"dcp.{rep}", ignore_errors=True)
        scratch.purge()  # this repetition's raw files, outside every timing
        dist.barrier()
        if rep == 0:
            continue
        aggregate.add_limit(raw_times)
        aggregate.add_ratio("safeckpt sync save", results["sync"])
        aggregate.add_ratio("safeckpt async save, until wait() returns", results["async"])
        aggregate.add_ratio("dcp.save", results["dcp"])
        blocking.limit_seconds.append(max(copy_s))
        for r in range(WORLD):
            blocking.add_ratio(f"safeckpt, rank {r}", results["blocking"][r], copy_s[r])
        if rank == 0:
            print(
                f"rep {rep}: raw {min(raw_times.values()):.2f} s, sync {results['sync']:.2f} s",
                file=sys.stderr,
            )
    sync_mgr.close()
    async_mgr.close()
    aggregate.notes.append(
        f"Each rank holds {local_bytes / GIB:.2f} GiB of shards; 'median time' is the slower rank's."
    )
    aggregate.notes.append(
        "The raw streams write one file per rank; the saves also write DCP metadata, a train-state "
        "file per rank and the record, fsync the directories and agree over gloo before committing."
    )
    aggregate.notes += limit.notes
    blocking.notes.append("Each rank copies its own shards; the two ranks share the machine's two cores.")
    if rank == 0:
        report = Report(
            section="bench_ranks",
            command=command,
            machine={**machine(), "filesystem (benchmark files)": filesystem_of(work)},
            parameters={
                "state": f"{args.size_gib:.2f} GiB fp32 (model + AdamW) over {WORLD} ranks",
                "reps": args.reps,
            },
            tables=[aggregate, blocking],
            wall_seconds=time.perf_counter() - started,
        )
        report.save(Path(report_path))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-gib", type=float, default=1.0, help="the whole state, over both ranks")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the tables as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = shlex.join([".venv/bin/python", "benchmarks/bench_ranks.py", *argv])
    with tempfile.TemporaryDirectory(prefix="safeckpt-bench-ranks-", dir=os.environ.get("BENCH_DIR")) as tmp:
        args.work = tmp
        report_path = str(Path(tmp) / "report.json")
        mp.start_processes(
            rank_main,
            args=(free_port(), args, report_path, command),
            nprocs=WORLD,
            start_method="spawn",
        )
        report = Report.load(Path(report_path))
    print(report.to_markdown())
    if args.json is not None:
        report.save(args.json)
    if beaten := report.beaten():
        print(f"[bench_ranks] FAILED: {'; '.join(beaten)}: the limit is not a limit", file=sys.stderr)
        return BEATEN
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
