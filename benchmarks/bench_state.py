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
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (
    GIB,
    Report,
    Table,
    build_state,
    evict,
    evict_all,
    filesystem_of,
    host_buffers,
    interleaved,
    machine,
    settle,
    timed,
)
from bench_limits import MemcpyLimit, ReadLimit, Scratch, slots, strategy_of
from bench_peers import AsyncRunner, DcpAsync, LightningAsync, lightning_available
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


def plain(value: Any) -> Any:
    """``value`` as peers that know no ``Stateful`` take it: each wrapper replaced by its state_dict()."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if hasattr(value, "state_dict") and not isinstance(value, torch.Tensor):
        return plain(value.state_dict())
    return value


def flat_tensors(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor leaf by its dotted path (safetensors takes a flat dict of tensors, nothing else)."""
    if isinstance(value, torch.Tensor):
        return {prefix: value.detach()}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    out: dict[str, torch.Tensor] = {}
    for key, child in items:
        out |= flat_tensors(child, f"{prefix}.{key}" if prefix else str(key))
    return out


class Peers:
    """One state's peers: their async saves (blocking time) and their cold loads of files written once."""

    def __init__(self, name: str, make: Callable[[], dict[str, Any]], scratch: Scratch, files: Path) -> None:
        self.name = name
        self.savers: dict[str, AsyncRunner] = {f"{name}: dcp.async_save": DcpAsync(scratch, make)}
        if lightning_available():
            lightning = LightningAsync(scratch, lambda: plain(make()))
            self.savers[f"{name}: Lightning AsyncCheckpointIO"] = lightning
        files.mkdir()
        state = make()
        torch.save(plain(state), files / "state.pt")
        save_file(flat_tensors(plain(state)), str(files / "state.safetensors"))
        dcp.save(state, checkpoint_id=files / "dcp", no_dist=True)
        self.files = files
        self.loaders: dict[str, Callable[[], Any]] = {
            f"{name}: torch.load": lambda: torch.load(files / "state.pt", weights_only=True),
            f"{name}: safetensors load_file": lambda: load_file(files / "state.safetensors"),
            f"{name}: dcp.load": lambda: dcp.load(make(), checkpoint_id=files / "dcp", no_dist=True),
        }
        for saver in self.savers.values():
            saver.run()  # warm-up: DCP's stager allocates its reused buffers

    def close(self) -> None:
        for saver in self.savers.values():
            saver.close()


def bench(args: argparse.Namespace, work: Path) -> list[Table]:
    blocking = Table(
        "state-blocking",
        "Async save of nested state: blocking time",
        "time until `save()` returns / memcpy",
        limit="the fastest host copy of every tensor of the state (`copy_` into buffers, or `clone`)",
        bound=True,
    )
    restore = Table(
        "state-restore",
        "Cold restore of nested state",
        "time to restore in place with the page cache evicted / raw read",
        limit="the fastest cold read of one file of the same bytes (readv, preadv, mmap, O_DIRECT)",
        bound=True,
    )
    scratch = Scratch(work / "scratch")
    scratch.directory.mkdir()
    states = variants(int(args.size_gib * GIB))
    managers: dict[str, CheckpointManager] = {}
    limits: dict[str, tuple[MemcpyLimit, ReadLimit]] = {}
    peers: dict[str, Peers] = {}
    for i, (name, make) in enumerate(states.items()):
        blocking.row(name, target=2.0 if "tensors of" in name else 1.3, role="ours", group=name)
        restore.row(name, target=1.25, role="ours", group=name)
        # Retention(): every checkpoint is kept, so no save prunes during the timings.
        managers[name] = CheckpointManager(work / f"root{i}", retention=Retention())
        managers[name].save(0, make())  # warm-up: the walk's cache and the staging buffers
        managers[name].wait()
        tensors = [t.contiguous() for t in tensors_of(make())]
        buffers = host_buffers(tensors)
        limits[name] = (MemcpyLimit(tensors, buffers), ReadLimit(buffers, scratch))
        peers[name] = Peers(name, make, scratch, work / f"peers{i}")
        for peer in peers[name].savers:
            blocking.row(peer, role="peer", group=name)
        for peer in peers[name].loaders:
            restore.row(peer, role="peer", group=name)
    scratch.purge()
    for rep in range(args.reps):
        for name in interleaved(list(states), rep):
            mgr, make, group = managers[name], states[name], peers[name]
            copy_limit, read_limit = limits[name]
            copies = copy_limit.measure(rep).times
            for row in (name, *group.savers):
                blocking.add_limit(copies, row=row)
            for saver in interleaved([name, *group.savers], rep):
                settle()
                if saver != name:
                    blocking.add_ratio(saver, group.savers[saver].run()[0])
                    continue
                state = make()
                start = time.perf_counter()
                mgr.save(rep + 1, state)
                blocking.add_ratio(name, time.perf_counter() - start)
                mgr.wait()
            # The restore and each peer's load take their turns among the read limit's strategies.
            reads: dict[str, float] = {}
            loaded: dict[str, float] = {}
            for slot in interleaved([name, *group.loaders, *slots(read_limit.strategies)], rep):
                if (strategy := strategy_of(slot)) is not None:
                    reads[strategy] = read_limit.time(strategy)
                    continue
                if slot == name:
                    target = make()
                    settle()
                    evict_all(mgr.root)
                    loaded[slot] = timed(lambda mgr=mgr, target=target: mgr.restore(target))
                else:
                    settle()
                    evict(group.files)
                    loaded[slot] = timed(group.loaders[slot])
            for row, seconds in loaded.items():
                restore.add_limit(reads, row=row)
                restore.add_ratio(row, seconds)
        scratch.purge()
    for mgr in managers.values():
        mgr.close()
    for group in peers.values():
        group.close()
    blocking.notes.append(
        "The state is fetched anew before each save (model.state_dict() builds a new dict), as training "
        "code does; the walk's cache and the staging buffers are reused across saves of one structure. "
        "The first save of each row is a warm-up, not counted. Each row is compared with its own state's "
        "peers: dcp.async_save through one reused `DefaultStager` (unpinned) and Lightning's "
        "AsyncCheckpointIO (a clone of every tensor), given the wrapper's state_dict()."
    )
    restore.notes.append(
        "safeckpt and dcp.load restore in place into the live tensors (through the wrapper's "
        "load_state_dict() for the Stateful row); torch.load and load_file allocate new ones, from files "
        "the peers wrote of the same state. Every file read is evicted first. safeckpt verifies every byte "
        "against its CRC32; no peer checks anything."
    )
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
