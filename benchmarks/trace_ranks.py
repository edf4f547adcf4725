"""Where a 2-rank sync save spends its time, phase by phase (a trace, not a benchmark).

    .venv/bin/python benchmarks/trace_ranks.py                  # 1 GiB over 2 ranks, 5 saves
    .venv/bin/python benchmarks/trace_ranks.py --size-gib 0.25 --saves 3

Two gloo processes hold ``bench_ranks``' FSDP2-sharded state and save it with
one sync manager, again and again. Each of DCP's phases is timed on rank 0 by
wrapping the functions that run it: the planner's steps, the collectives of
DCP's ``_DistWrapper`` (``reduce_scatter`` is the whole planning: local plan,
gather, global plan, scatter; ``all_reduce`` is the data write, the gather of
its results and ``.metadata``) and safeckpt's writer. The first save plans in
full; later ones reuse the cached plans (``safeckpt._dcp.plans``). The planner
steps timed are ``DefaultSavePlanner``'s: safeckpt's subclass flattens the
state before calling its ``set_up_planner``, which then shows almost nothing.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import wrap

PHASES = {
    "default_planner.DefaultSavePlanner": ("set_up_planner", "create_local_plan", "create_global_plan"),
    "utils._DistWrapper": ("reduce_scatter", "all_reduce", "gather_object", "scatter_object"),
}


def rank_main(rank: int, port: int, args: argparse.Namespace, work: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)
    from torch.distributed import checkpoint

    from bench_ranks import build_sharded
    from safeckpt import CheckpointManager, Retention

    spent: dict[str, float] = collections.defaultdict(float)
    for path, names in PHASES.items():
        module, cls = path.split(".")
        owner = getattr(getattr(checkpoint, module), cls)
        for name in names:
            wrap(owner, name, name, spent)
    state, _ = build_sharded(int(args.size_gib * (1 << 30)))
    with CheckpointManager(Path(work), async_save=False, retention=Retention(keep_last=1)) as mgr:
        for step in range(1, args.saves + 1):
            spent.clear()
            dist.barrier()
            start = time.perf_counter()
            mgr.save(step, state)
            total = time.perf_counter() - start
            if rank == 0:
                phases = ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in spent.items())
                print(f"save {step}: {total * 1e3:.0f} ms | {phases} (ms)", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="model + AdamW states, over both ranks")
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args(argv)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    work = tempfile.mkdtemp(prefix="safeckpt-trace-")
    try:
        mp.spawn(rank_main, args=(port, args, work), nprocs=2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
