"""Cold restores of one of ``bench_state``'s states, timed one by one (a trace, not a benchmark).

    .venv/bin/python benchmarks/trace_restore.py                    # 10,000 small tensors, 6 restores
    .venv/bin/python benchmarks/trace_restore.py --phases           # and where each one's time went
    .venv/bin/python benchmarks/trace_restore.py --state nested --phases   # {"model": sd, "optim": osd}
    .venv/bin/python benchmarks/trace_restore.py --load-file --restores 15  # paired with load_file
    PYTHONPATH=/path/to/other/checkout/src .venv/bin/python benchmarks/trace_restore.py

Saves the state with an async manager (``small``: 10,000 tensors of 4 KiB,
int keys, in a nested dict; ``nested``: a 0.5 GiB model's and AdamW's state
dicts; ``stateful``: the same behind a ``Stateful`` wrapper), then restores it
in place with the page cache evicted before each restore, and prints every
time and the median. ``small`` restores into fresh tensors; the others into
the live model and optimizer, as ``bench_state`` does. Run it alternately
against two checkouts (``PYTHONPATH``) to compare them on the same machine
state. ``--load-file`` (``small`` only) also times, before or after each restore in turns,
``safetensors.load_file`` of the same tensors in one file, evicted the same way, and prints each
restore's ratio to the load beside it. ``--phases`` also times the restore's steps (by wrapping the functions
that run them; nested steps are inside their callers' times) and prints each
one's median over the restores.
"""

from __future__ import annotations

import argparse
import collections
import gc
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import safeckpt
from bench_common import evict, evict_all, wrap
from bench_state import GIB, variants
from safeckpt import CheckpointManager, Retention

# (module, owner or None for a module function, function, label): outer steps first. The reader
# is named through safeckpt._storage.writer, which re-exports it: checkouts from before raw_reader.py work.
PHASES = [
    ("safeckpt._manager.resumer", "Resumer", "_choose", "choosing the checkpoint (records)"),
    ("safeckpt._restore.load_into", None, "read_tree", "reading the training state (tree)"),
    ("safeckpt._restore.load_plan", "LoadPlan", "mapping", "matching the tree and the state"),
    ("safeckpt._dcp.io", None, "load_flat", "loading the tensors, in all"),
    ("safeckpt._dcp.io", None, "_whole_tensor_plan", "  the whole-tensor plan (read items)"),
    ("safeckpt._dcp.io", None, "load", "  dcp.load, in all (a plan DCP makes)"),
    ("safeckpt._dcp.io", "SafeLoadPlanner", "set_up_planner", "    DCP: flattening the state"),
    ("safeckpt._dcp.io", "SafeLoadPlanner", "create_local_plan", "    DCP: the local plan (read items)"),
    ("safeckpt._storage.writer", "RawFileSystemReader", "read_data", "  read_data, in all"),
    ("safeckpt._storage.writer", "RawFileSystemReader", "_plan_run", "    planning runs"),
    ("safeckpt._storage.writer", "RawFileSystemReader", "_plan_batch", "    planning batches"),
    ("safeckpt._storage.batching", "ReadAhead", "next", "    waiting for the disk"),
    ("safeckpt._storage.writer", "RawFileSystemReader", "_finish_run", "    checking and copying runs"),
    ("safeckpt._storage.writer", "RawFileSystemReader", "_finish_batch", "    checking, committing batches"),
    ("safeckpt._restore.load_plan", "LoadPlan", "apply", "putting values in place"),
]


def time_phases() -> dict[str, float]:
    """Wrap each of ``PHASES``; returns label -> seconds spent in it (summed, until cleared)."""
    import importlib

    spent: dict[str, float] = collections.defaultdict(float)
    for module_name, owner_name, name, label in PHASES:
        module = importlib.import_module(module_name)
        owner = module if owner_name is None else getattr(module, owner_name)
        original = getattr(owner, name, None)
        if original is None:
            continue  # a checkout from before this step existed
        timed = wrap(owner, name, label, spent)
        if owner_name is None:  # imported by name elsewhere: wrap it there too
            users = ("safeckpt._restore.load_into", "safeckpt._restore.load", "safeckpt._manager.resumer")
            for other in users:
                user = importlib.import_module(other)
                if getattr(user, name, None) is original:
                    setattr(user, name, timed)
    return spent


STATES = {"small": 2, "nested": 0, "stateful": 1}  # name -> position in bench_state.variants


def state_maker(name: str, size_gib: float) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(the state to save, a target to restore into) for ``--state name``."""
    make = list(variants(int(size_gib * GIB)).values())[STATES[name]]
    if name != "small":
        return make, make
    return make, lambda: {
        "small": {"layers": {i: torch.empty_like(t) for i, t in make()["small"]["layers"].items()}, "step": 0}
    }


def _load_file_peer(state: Any, work: Path) -> Callable[[], float]:
    """A cold ``safetensors.load_file`` of ``state``'s tensors, saved once into one file: its time."""
    from safetensors.torch import load_file, save_file

    path = work / "peer.safetensors"
    save_file({f"small.layers.{k}": v for k, v in state["small"]["layers"].items()}, str(path))

    def load() -> float:
        evict(path)
        gc.collect()
        start = time.perf_counter()
        loaded = load_file(str(path))
        seconds = time.perf_counter() - start
        del loaded
        return seconds

    return load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--restores", type=int, default=6)
    parser.add_argument("--phases", action="store_true", help="also time the restore's steps")
    parser.add_argument("--state", choices=list(STATES), default="small")
    parser.add_argument("--size-gib", type=float, default=0.5, help="model + AdamW (nested, stateful)")
    parser.add_argument("--load-file", action="store_true", help="pair each restore with load_file")
    args = parser.parse_args(argv)
    if args.load_file and args.state != "small":
        parser.error("--load-file pairs the small state's restores only")
    make_saved, make_target = state_maker(args.state, args.size_gib)
    spent = time_phases() if args.phases else {}
    root = Path(tempfile.mkdtemp(prefix="safeckpt-restore-")) / "ckpt"
    try:
        with CheckpointManager(root, retention=Retention()) as mgr:
            for step in range(4):  # warm: the walk's cache, the staging buffers, the plans
                mgr.save(step, make_saved())
                mgr.wait()
            peer = _load_file_peer(make_saved(), root.parent) if args.load_file else None
            times, peers = [], []
            phases: dict[str, list[float]] = collections.defaultdict(list)
            for i in range(args.restores):
                if peer is not None and i % 2:
                    peers.append(peer())
                spent.clear()
                target = make_target()
                evict_all(root)
                gc.collect()
                start = time.perf_counter()
                mgr.restore(target)
                times.append(time.perf_counter() - start)
                for label, seconds in spent.items():
                    phases[label].append(seconds)
                del target
                if peer is not None and not i % 2:
                    peers.append(peer())
        print(
            f"{Path(safeckpt.__file__).parent}: restores (ms) {[round(t * 1e3) for t in times]}, "
            f"median {statistics.median(times) * 1e3:.0f} ms"
        )
        if peers:
            ratios = sorted(t / p for t, p in zip(times, peers, strict=True))
            print(
                f"  load_file (ms) {[round(t * 1e3) for t in peers]}, median "
                f"{statistics.median(peers) * 1e3:.0f} ms; each restore over the load beside it: median "
                f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}x)"
            )
        for _, _, _, label in PHASES:
            if label in phases:  # the median over restores of each one's time in it
                print(f"  {label:40s} {statistics.median(phases[label]) * 1e3:7.1f} ms")
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
