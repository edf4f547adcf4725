"""What an async save of a `bench_state` state costs after `save()` returns (a trace, not a benchmark).

    .venv/bin/python benchmarks/trace_save.py                   # 10,000 small tensors, 30 saves
    .venv/bin/python benchmarks/trace_save.py --phases          # and where the writer's time went
    .venv/bin/python benchmarks/trace_save.py --state nested    # {"model": sd, "optim": osd}
    PYTHONPATH=/path/to/other/checkout/src .venv/bin/python benchmarks/trace_save.py

Saves the state again and again with an async manager that keeps two
checkpoints, waiting for each save, and prints the medians (the first 5 saves
are a warm-up) of: the blocking time, the time until ``wait()`` returns, and
the process's CPU time per save (``getrusage``: the training thread's copy and
the writer's work together). Most of a background save's CPU beyond the copy
is Python on the writer's thread, which holds the GIL while training runs
beside it. Run it alternately against two checkouts (``PYTHONPATH``) to
compare them on the same machine state. ``--phases`` also times the writer's
steps (by wrapping the functions that run them; nested steps are inside their
callers' times).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import safeckpt
from bench_common import wrap
from safeckpt import CheckpointManager, Retention
from trace_restore import STATES, state_maker

WARM_UP = 5

# (module, owner, function, label): outer steps first.
PHASES = [
    ("safeckpt._dcp.io", None, "save", "dcp.save, in all"),
    ("safeckpt._dcp.plans", "_SafeSavePlanner", "set_up_planner", "  flattening the state"),
    ("safeckpt._dcp.plans", "_SafeSavePlanner", "create_local_plan", "  the local plan"),
    ("safeckpt._storage.writer", "RawFileSystemWriter", "_write_file", "  writing the data file, fsync"),
    ("safeckpt._storage.writer", None, "_write_item", "    the archives (Python per tensor)"),
    ("torch.distributed.checkpoint.filesystem", "_FileSystemWriter", "finish", "  .metadata (pickle, fsync)"),
    ("safeckpt._manager.committer", "Committer", "_commit", "the commit (record, rename, fsyncs)"),
]


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_phases() -> dict[str, float]:
    spent: dict[str, float] = collections.defaultdict(float)
    for module_name, owner_name, name, label in PHASES:
        module = importlib.import_module(module_name)
        owner = module if owner_name is None else getattr(module, owner_name)
        if getattr(owner, name, None) is None:
            continue  # a checkout from before this step existed
        wrap(owner, name, label, spent)  # every caller looks these up on their module or class
    return spent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--saves", type=int, default=30)
    parser.add_argument("--phases", action="store_true", help="also time the writer's steps")
    parser.add_argument("--state", choices=list(STATES), default="small")
    parser.add_argument("--size-gib", type=float, default=0.5, help="model + AdamW (nested, stateful)")
    args = parser.parse_args(argv)
    make_saved, _ = state_maker(args.state, args.size_gib)
    state = make_saved()
    spent = time_phases() if args.phases else {}
    root = Path(tempfile.mkdtemp(prefix="safeckpt-save-")) / "ckpt"
    rows: dict[str, list[float]] = collections.defaultdict(list)
    try:
        with CheckpointManager(root, retention=Retention(keep_last=2)) as mgr:
            for step in range(args.saves + WARM_UP):
                spent.clear()
                cpu, start = _cpu(), time.perf_counter()
                mgr.save(step, state)
                returned = time.perf_counter()
                mgr.wait()
                if step < WARM_UP:
                    continue
                rows["blocking"].append(returned - start)
                rows["until wait() returns"].append(time.perf_counter() - start)
                rows["CPU time of the process"].append(_cpu() - cpu)
                for label, seconds in spent.items():
                    rows[label].append(seconds)
        print(f"{Path(safeckpt.__file__).parent}: {args.saves} saves of {args.state!r}, medians:")
        for label in ["blocking", "until wait() returns", "CPU time of the process"] + [p[3] for p in PHASES]:
            if label in rows:
                print(f"  {label:42s} {statistics.median(rows[label]) * 1e3:8.1f} ms")
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
