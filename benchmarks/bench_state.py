"""State in the shapes PyTorch code writes, through safeckpt's fast path (not a test).

    .venv/bin/python benchmarks/bench_state.py                   # 0.5 GiB states, 5 reps
    .venv/bin/python benchmarks/bench_state.py --size-gib 0.1 --reps 3 --json out.json

Rows: ``{"model": model.state_dict(), "optim": optimizer.state_dict()}`` (fetched
anew for every save, as training code does), a ``Stateful`` wrapper returning
that dict, and 10,000 small tensors (4 KiB each, in a nested dict). Values are
ratios against limits measured in the same repetition (``bench_limits.py``:
the fastest of several strategies): the async save's blocking time against a
host copy of the same tensors, and a cold restore against a cold raw read of
the same bytes.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (
    GIB,
    Report,
    Table,
    build_state,
    evict,
    filesystem_of,
    host_buffers,
    interleaved,
    machine,
    settle,
    timed,
)
from bench_limits import MemcpyLimit, ReadLimit, Scratch, slots, strategy_of
from safeckpt import CheckpointManager, Retention

SMALL_TENSORS = 10_000
SMALL_NUMEL = 1024  # 4 KiB of fp32


class Wrapper:
    """A torchtitan-style ``Stateful``: model and optimizer behind one state_dict()."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor leaf of a nested state (the bytes the memcpy limit copies)."""
    if isinstance(value, torch.Tensor):
        return [value.detach()]
    if hasattr(value, "state_dict") and not isinstance(value, dict):
        return tensors_of(value.state_dict())
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


def variants(size: int) -> dict[str, Callable[[], dict[str, Any]]]:
    """Row name -> a function giving the state to save (called before every save)."""
    bench = build_state(size, optimizer=True)
    model, optim = bench.model, bench.optimizer
    assert optim is not None
    wrapper = Wrapper(model, optim)
    small = {"layers": {i: torch.randn(SMALL_NUMEL) for i in range(SMALL_TENSORS)}, "step": 0}
    return {
        '{"model": sd, "optim": osd}': lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
        "Stateful wrapper": lambda: {"train": wrapper},
        f"{SMALL_TENSORS:,} tensors of 4 KiB": lambda: {"small": small},
    }


def bench(args: argparse.Namespace, work: Path) -> list[Table]:
    blocking = Table(
        "state-blocking",
        "Async save of nested state: blocking time",
        "time until `save()` returns / memcpy",
        limit="the fastest host copy of every tensor of the state (`copy_` into buffers, or `clone`)",
    )
    restore = Table(
        "state-restore",
        "Cold restore of nested state",
        "time to restore in place with the page cache evicted / raw read",
        limit="the fastest cold read of one file of the same bytes (readv, preadv, mmap, O_DIRECT)",
    )
    scratch = Scratch(work / "scratch")
    scratch.directory.mkdir()
    states = variants(int(args.size_gib * GIB))
    managers: dict[str, CheckpointManager] = {}
    limits: dict[str, tuple[MemcpyLimit, ReadLimit]] = {}
    for i, (name, make) in enumerate(states.items()):
        blocking.row(name, target=2.0 if "tensors of" in name else 1.3)
        restore.row(name, target=1.25)
        # Retention(): every checkpoint is kept, so no save prunes during the timings.
        managers[name] = CheckpointManager(work / f"root{i}", retention=Retention())
        managers[name].save(0, make())  # warm-up: the walk's cache and the staging buffers
        managers[name].wait()
        tensors = [t.contiguous() for t in tensors_of(make())]
        buffers = host_buffers(tensors)
        limits[name] = (MemcpyLimit(tensors, buffers), ReadLimit(buffers, scratch))
    for rep in range(args.reps):
        for name in interleaved(list(states), rep):
            mgr, make = managers[name], states[name]
            copy_limit, read_limit = limits[name]
            blocking.add_limit(copy_limit.measure(rep).times, row=name)
            state = make()
            settle()
            start = time.perf_counter()
            mgr.save(rep + 1, state)
            blocking.add_ratio(name, time.perf_counter() - start)
            mgr.wait()
            # The restore takes its turn among the read limit's strategies, each in its own slot.
            reads: dict[str, float] = {}
            restored = 0.0
            for slot in interleaved(["restore", *slots(read_limit.strategies)], rep):
                if (strategy := strategy_of(slot)) is not None:
                    reads[strategy] = read_limit.time(strategy)
                    continue
                target = make()
                settle()
                evict(mgr.root)
                restored = timed(lambda mgr=mgr, target=target: mgr.restore(target))
            restore.add_limit(reads, row=name)
            restore.add_ratio(name, restored)
        scratch.purge()
    for mgr in managers.values():
        mgr.close()
    blocking.notes.append(
        "The state is fetched anew before each save (model.state_dict() builds a new dict), as training "
        "code does; the walk's cache and the staging buffers are reused across saves of one structure. "
        "The first save of each row is a warm-up, not counted."
    )
    restore.notes.append("Restored in place into the live tensors; the checkpoint's files are evicted first.")
    return [blocking, restore]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=0.5, help="size of the model + AdamW states")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: the temp directory)")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="safeckpt-bench-state-", dir=args.dir))
    try:
        tables = bench(args, work)
        info = machine() | {"filesystem": filesystem_of(work)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = shlex.join([".venv/bin/python", "benchmarks/bench_state.py", *argv])
    params = {"state": f"{args.size_gib:g} GiB fp32 model + AdamW", "reps": args.reps}
    report = Report("bench_state", command, info, params, tables, time.monotonic() - started)
    print(report.to_markdown())
    if args.json is not None:
        report.save(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
