"""Single-process save and restore: safeckpt against raw limits and its peers (not a test).

    .venv/bin/python benchmarks/bench_save.py                    # 1 GiB model + AdamW state, 5 reps
    .venv/bin/python benchmarks/bench_save.py --size-gib 0.25    # a quick run
    .venv/bin/python benchmarks/bench_save.py --only restore --reps 3 --json out.json

Every value is a ratio against a limit measured in the same repetition (or, for
the cleanup table, milliseconds against a baseline root measured in the same
repetition). A memcpy, write or read limit is the fastest of several strategies
(``bench_limits``); a peer that still beats one makes the script exit with
status 3 after printing. Repetitions are interleaved: the order of the variants
rotates. No timing truncates or deletes an earlier file: every write goes to a
new path, a repetition's files are deleted after it, and a manager's previous
checkpoint is pruned after the timed save (``bench_common.held``). ``run_all.py``
runs this script 3 times and merges the runs.
The state is a transformer-shaped fp32 model (embedding, attention and MLP
weights, layer norms) plus its AdamW moments; ``--size-gib`` is the size of
the whole state.

Sections (``--only``): ``async`` (blocking and durable time of an async save),
``sync`` (a blocking save), ``restore`` (cold), ``inflation`` (compute steps/s
while a save persists) and ``cleanup`` (retention bookkeeping in ``save()`` with
10/100/1000 retained checkpoints).

``safeckpt, SAFECKPT_DCP_IO=torch`` rows run the manager with DCP's own writer
and reader instead of ``safeckpt._storage.writer`` (same files): what storage.py buys.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (
    BEATEN,
    GIB,
    BenchState,
    Report,
    Table,
    build_state,
    evict_all,
    filesystem_of,
    fsync_path,
    held,
    host_buffers,
    interleaved,
    machine,
    raw_write,
    settle,
    steal_seconds,
)
from bench_limits import MemcpyLimit, ReadLimit, Scratch, WriteLimit, combined, slots, strategy_of
from bench_peers import AsyncRunner, DcpAsync, LightningAsync, lightning_available
from safeckpt import CheckpointManager, Retention
from safeckpt._fs.atomic import swap_pointer
from safeckpt._fs.fileops import DEFAULT_FILE_OPS

SECTIONS = ("async", "sync", "restore", "inflation", "cleanup")
SAFECKPT = "safeckpt"
TORCH_IO = "safeckpt, SAFECKPT_DCP_IO=torch"
BUFFERED_IO = "safeckpt, SAFECKPT_DIRECT_IO=0"
UNVERIFIED = "safeckpt, SAFECKPT_VERIFY=0"
CLEANUP_COUNTS = (10, 100, 1000)


# --- the bench -----------------------------------------------------------------------------


@dataclass
class Bench:
    """What every section shares: the state, its tensors, host buffers, a work directory."""

    args: argparse.Namespace
    work: Path
    state: BenchState
    names: list[str]
    tensors: list[torch.Tensor]
    buffers: list[torch.Tensor]

    @functools.cached_property
    def scratch(self) -> Scratch:
        """Fresh paths; what a repetition wrote is deleted by ``purge()`` after it, outside the timings."""
        return Scratch(self.work)

    @property
    def flat(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.tensors, strict=True))

    def fresh(self, name: str) -> Path:
        """A new, unused path under the work directory."""
        return self.scratch.fresh(name)

    @functools.cached_property
    def memcpy_limit(self) -> MemcpyLimit:
        return MemcpyLimit(self.tensors, self.buffers)

    @functools.cached_property
    def write_limit(self) -> WriteLimit:
        return WriteLimit(self.tensors, self.scratch)

    @functools.cached_property
    def read_limit(self) -> ReadLimit:
        return ReadLimit(self.buffers, self.scratch)

    def safeckpt_variants(self) -> list[tuple[str, Mapping[str, str]]]:
        """``(row name, environment)``: the manager as it is, and with DCP's own writer and reader."""
        return [(SAFECKPT, {}), (TORCH_IO, {"SAFECKPT_DCP_IO": "torch"})]


@contextlib.contextmanager
def wiring(env: Mapping[str, str]) -> Iterator[None]:
    """Run the manager with the variables of ``env`` set (``SAFECKPT_DCP_IO=torch``: DCP's own
    writer and reader), and the environment as it was afterwards."""
    previous = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# --- async: blocking and durable ---------------------------------------------------------


class SafeckptAsync:
    def __init__(self, b: Bench, env: Mapping[str, str]) -> None:
        self.b, self.env = b, env
        self.mgr = CheckpointManager(b.fresh("async-root"), retention=Retention(keep_last=1))
        self.step = 0

    def run(self) -> tuple[float, float]:
        self.step += 1
        with held(self.mgr), wiring(self.env):
            start = time.perf_counter()
            self.mgr.save(self.step, self.b.state.state)
            returned = time.perf_counter()
            self.mgr.wait()
            durable = time.perf_counter() - start
        return returned - start, durable

    def close(self) -> None:
        self.mgr.close()


def bench_async(b: Bench) -> list[Table]:
    blocking = Table(
        "blocking",
        "Async save: blocking time",
        "time until the save call returns / memcpy",
        limit="the fastest host copy of every tensor (`copy_` into preallocated buffers, or `clone`)",
        bound=True,
    )
    durable = Table(
        "durable",
        "Async save: time until durable",
        "time from the save call until the data is durable (`wait()` returns) / (memcpy + raw write)",
        limit="memcpy + the fastest write of the same bytes into one new file with fsync",
        bound=True,
    )
    runners: dict[str, AsyncRunner] = {}
    for name, env in b.safeckpt_variants():
        blocking.row(name, target=1.3)
        durable.row(name, target=1.3)  # issue 15: at most 1.3x (memcpy + write)
        runners[name] = SafeckptAsync(b, env)
    runners["dcp.async_save"] = DcpAsync(b.scratch, lambda: b.flat)
    if lightning_available():
        runners["Lightning AsyncCheckpointIO"] = LightningAsync(b.scratch, lambda: b.flat)
    else:
        blocking.notes.append("Lightning is not installed (`pip install -c constraints/ci.txt lightning`).")
    for runner in runners.values():
        runner.run()  # warm-up: allocates the reused staging buffers
    b.scratch.purge()
    for rep in range(b.args.reps):
        times: dict[str, tuple[float, float]] = {}
        raw: dict[str, float] = {}
        copies: dict[str, float] = {}
        for name in interleaved(["memcpy", *slots(b.write_limit.strategies), *runners], rep):
            settle()
            if name == "memcpy":
                copies = b.memcpy_limit.measure(rep).times
            elif (strategy := strategy_of(name)) is not None:  # each write strategy in its own slot
                raw[strategy] = b.write_limit.time(strategy)
            else:
                times[name] = runners[name].run()
        blocking.add_limit(copies)
        durable.add_limit(combined(copies, raw))
        for name, (returned, done) in times.items():
            blocking.add_ratio(name, returned)
            durable.add_ratio(name, done)
        b.scratch.purge()  # delete this repetition's files, outside every timing
    for runner in runners.values():
        runner.close()
    blocking.notes.append(
        "safeckpt and dcp.async_save reuse their staging buffers (dcp: one `DefaultStager`, unpinned); "
        "Lightning clones every tensor on each save. The first save of each is a warm-up, not counted."
    )
    durable.notes.append(
        "Lightning's TorchCheckpointIO does not fsync; the benchmark adds one so all rows mean durable."
    )
    durable.notes += b.write_limit.notes
    return [blocking, durable]


# --- sync save ---------------------------------------------------------------------------------


def bench_sync(b: Bench) -> list[Table]:
    table = Table(
        "sync",
        "Blocking (sync) save",
        "time to a durable checkpoint / raw write",
        limit="the fastest write of the same bytes into one new file with fsync",
        bound=True,
    )
    managers = {}
    for name, env in b.safeckpt_variants():
        table.row(name, target=1.1)
        mgr = CheckpointManager(b.fresh("sync-root"), async_save=False, retention=Retention(keep_last=1))
        managers[name] = (mgr, env)
    steps = iter(range(1, 1 << 30))

    def safeckpt_save(name: str) -> Callable[[], Path | None]:
        mgr, env = managers[name]

        def run() -> Path | None:
            with wiring(env):
                mgr.save(next(steps), b.state.state)
            return None  # the previous checkpoint is pruned after the timing (held)

        return run

    def torch_save() -> Path:
        path = b.fresh("torch.pt")
        torch.save(b.flat, path)
        fsync_path(path)
        return path

    def dcp_save() -> Path:
        path = b.fresh("dcp")
        dcp.save(b.flat, checkpoint_id=path, no_dist=True)  # FileSystemWriter fsyncs every file
        return path

    def safetensors_save() -> Path:
        path = b.fresh("model.safetensors")
        save_file(b.flat, path)
        fsync_path(path)
        return path

    variants: dict[str, Callable[[], Path | None]] = {name: safeckpt_save(name) for name in managers}
    variants |= {"torch.save": torch_save, "dcp.save": dcp_save, "safetensors save_file": safetensors_save}
    for run in variants.values():  # warm-up
        b.scratch.discard(run())
    b.scratch.purge()
    for rep in range(b.args.reps):
        times: dict[str, float] = {}
        raw: dict[str, float] = {}
        for name in interleaved([*slots(b.write_limit.strategies), *variants], rep):
            settle()
            if (strategy := strategy_of(name)) is not None:  # each strategy in its own slot
                raw[strategy] = b.write_limit.time(strategy)
                continue
            with held(managers[name][0] if name in managers else None):
                start = time.perf_counter()
                written = variants[name]()
                times[name] = time.perf_counter() - start
            b.scratch.discard(written)
        table.add_limit(raw)
        for name, seconds in times.items():
            table.add_ratio(name, seconds)
        b.scratch.purge()  # delete this repetition's files, outside every timing
    for mgr, _ in managers.values():
        mgr.close()
    table.notes.append("Peers are followed by an fsync of what they wrote; dcp.save fsyncs on its own.")
    table.notes += b.write_limit.notes
    return [table]


# --- cold restore --------------------------------------------------------------------------------


def bench_restore(b: Bench) -> list[Table]:
    table = Table(
        "restore",
        "Cold restore",
        "time to load a checkpoint whose pages were evicted / raw read",
        limit="the fastest read of one file of the same bytes into preallocated buffers (or new ones), "
        "page cache evicted",
        bound=True,
    )
    root = b.fresh("restore-root")
    mgr = CheckpointManager(root, async_save=False)
    mgr.save(1, b.state.state)
    files = {
        "torch": b.fresh("restore.pt"),
        "dcp": b.fresh("restore-dcp"),
        "safetensors": b.fresh("restore.safetensors"),
    }
    torch.save(b.flat, files["torch"])
    dcp.save(b.flat, checkpoint_id=files["dcp"], no_dist=True)
    save_file(b.flat, files["safetensors"])
    targets = dict(zip(b.names, b.buffers, strict=True))

    def safeckpt_restore(env: Mapping[str, str]) -> Callable[[], Any]:
        def run() -> Any:
            with wiring(env):
                return mgr.restore(b.state.state)

        return run

    variants: dict[str, tuple[Path, Callable[[], Any]]] = {}
    for name, env in b.safeckpt_variants():
        table.row(name, target=1.25)
        variants[name] = (root, safeckpt_restore(env))
    table.row(UNVERIFIED, note="checksums not checked: what verification costs")
    variants[UNVERIFIED] = (root, safeckpt_restore({"SAFECKPT_VERIFY": "0"}))
    variants |= {
        "torch.load": (files["torch"], lambda: torch.load(files["torch"], weights_only=True)),
        "dcp.load": (files["dcp"], lambda: dcp.load(targets, checkpoint_id=files["dcp"], no_dist=True)),
        "safetensors load_file": (files["safetensors"], lambda: load_file(files["safetensors"])),
    }

    b.read_limit  # noqa: B018  (writes its file now, before any timing)
    for rep in range(b.args.reps):
        times: dict[str, float] = {}
        raw: dict[str, float] = {}
        for name in interleaved([*slots(b.read_limit.strategies), *variants], rep):
            settle()
            if (strategy := strategy_of(name)) is not None:  # each strategy in its own slot
                raw[strategy] = b.read_limit.time(strategy)  # evicts first
                continue
            path, run = variants[name]
            evict_all(path)
            start = time.perf_counter()
            loaded = run()
            times[name] = time.perf_counter() - start
            del loaded
        table.add_limit(raw)
        for name, seconds in times.items():
            table.add_ratio(name, seconds)
    mgr.close()
    for path in (root, *files.values()):
        remove(path)
    table.notes.append(
        "safeckpt and dcp.load load in place into existing tensors; torch.load and load_file allocate new "
        "ones. Every file of a checkpoint is fsynced and evicted (`POSIX_FADV_DONTNEED`) before each read. "
        "safeckpt verifies every byte it loads against its CRC32 (none of the peers checks anything); "
        "the SAFECKPT_VERIFY=0 row is the same restore without that check."
    )
    return [table]


# --- step-time inflation ------------------------------------------------------------------------


@dataclass
class Window:
    """A compute loop run alongside some background work."""

    rate: float
    """Steps per second."""
    background_cpu: float
    """CPU seconds the process spent outside the compute thread meanwhile."""
    steal: float
    """Seconds the hypervisor ran something else on this VM's CPUs meanwhile (all CPUs together)."""
    elapsed: float
    """Seconds the loop ran."""

    @property
    def steal_per_second(self) -> float:
        return self.steal / self.elapsed


class Compute:
    """A CPU stand-in for a training step: one matmul, on ``threads`` intra-op threads."""

    def __init__(self, size: int, threads: int) -> None:
        self.a, self.b = torch.randn(size, size), torch.randn(size, size)
        self.out = torch.empty(size, size)
        self.threads = threads

    def run(self, keep_going: Callable[[float], bool]) -> Window:
        """Steps while ``keep_going(elapsed)`` (at least one step)."""
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            process, own, stolen = _process_cpu(), time.thread_time(), steal_seconds()
            steps, start = 0, time.perf_counter()
            while True:
                torch.mm(self.a, self.b, out=self.out)
                steps += 1
                elapsed = time.perf_counter() - start
                if not keep_going(elapsed):
                    other = _process_cpu() - process - (time.thread_time() - own)
                    return Window(steps / elapsed, other, steal_seconds() - stolen, elapsed)
        finally:
            torch.set_num_threads(previous)


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _in_thread(fn: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


FLOOR = "raw write + fsync in a thread (floor)"
NO_SAVE = "nothing in the background (the limit's loop)"


def bench_inflation(b: Bench) -> list[Table]:
    table = Table(
        "inflation",
        "Step-time inflation while a save persists",
        "steps/s of a compute loop without a save / steps/s while the save persists in the background",
        limit=f"the same loop with nothing in the background for {b.args.window:g} s",
    )
    cpu = Table(
        "background-cpu",
        "CPU time of a background save",
        "CPU seconds the process spends outside the compute thread while the save persists / the same "
        "for a raw write of the same bytes in a thread",
        limit="the floor row of the table above",
    )
    steal = Table(
        "steal",
        "Hypervisor steal time during the compute loop",
        "ms of steal time (/proc/stat, all CPUs) per second of the compute loop's window",
        unit="ms",
    )
    compute = Compute(b.args.matmul, b.args.compute_threads)
    managers: dict[str, tuple[CheckpointManager, Mapping[str, str]]] = {}
    # Buffered writes: O_DIRECT's disk requests cost this VM's host CPU it takes from the guest
    # (the steal table); the row shows what turning it off gives the loop and costs the save.
    for name, env in [*b.safeckpt_variants(), (BUFFERED_IO, {"SAFECKPT_DIRECT_IO": "0"})]:
        table.row(name, target=None if name == BUFFERED_IO else 1.05)
        mgr = CheckpointManager(b.fresh("inflation-root"), retention=Retention(keep_last=1))
        managers[name] = (mgr, env)
    dcp_async = DcpAsync(b.scratch, lambda: b.flat, "inflation-dcp")
    steps = iter(range(1, 1 << 30))

    def safeckpt_save(name: str) -> Callable[[], Window]:
        mgr, env = managers[name]

        def run() -> Window:
            with held(mgr), wiring(env):
                mgr.save(next(steps), b.state.state)  # staging is not part of the window
                waiter = _in_thread(mgr.wait)
                window = compute.run(lambda _: waiter.is_alive())
            return window

        return run

    def dcp_save() -> Window:
        future = dcp_async.start()
        window = compute.run(lambda _: not future.done())
        dcp_async.finish(future)
        return window

    def raw_background_write() -> Window:
        path = b.fresh("floor.bin")  # a new file: raw_write's O_TRUNC truncates nothing
        writer = _in_thread(lambda: raw_write(b.buffers, path))
        window = compute.run(lambda _: writer.is_alive())
        b.scratch.discard(path)
        return window

    variants: dict[str, Callable[[], Window]] = {name: safeckpt_save(name) for name in managers}
    variants |= {"dcp.async_save": dcp_save, FLOOR: raw_background_write}
    table.row(FLOOR, role="reference")  # a floor to compare with, not a peer
    for run in variants.values():  # warm-up: staging buffers
        run()
    b.scratch.purge()
    for rep in range(b.args.reps):
        windows: dict[str, Window] = {}
        for name in interleaved(["limit", *variants], rep):
            settle()
            if name == "limit":
                windows[name] = compute.run(lambda elapsed: elapsed < b.args.window)
            else:
                windows[name] = variants[name]()
        for name, window in windows.items():
            steal.add_value(NO_SAVE if name == "limit" else name, 1e3 * window.steal_per_second)
        base = windows.pop("limit").rate
        table.limit_seconds.append(1 / base)
        floor_cpu = windows[FLOOR].background_cpu
        cpu.limit_seconds.append(floor_cpu)
        for name, window in windows.items():
            table.add_value(name, base / window.rate, 1 / window.rate)
            if name != FLOOR:
                cpu.add_ratio(name, window.background_cpu, floor_cpu)
        b.scratch.purge()  # delete this repetition's files, outside every timing
    for mgr, _ in managers.values():
        mgr.close()
    dcp_async.close()
    table.notes.append(
        f"Compute: a {b.args.matmul}x{b.args.matmul} fp32 matmul per step on {b.args.compute_threads} "
        f"intra-op thread(s) of {os.cpu_count()} cores; 'median time' is the step time."
    )
    cpu.notes.append(
        "From getrusage (user + system) less the compute thread's own time; the kernel's writeback "
        "threads are not counted for any row. 'median time' is CPU seconds."
    )
    steal.notes.append(
        "Steal time is what a virtual machine's host takes from its CPUs (/proc/stat). A compute "
        "step that takes 10x its usual time with no context switch of its thread is stolen time: "
        "an inflation row on a machine with steal is the host's as much as the save's."
    )
    return [table, cpu, steal]


# --- cleanup on the training thread ------------------------------------------------------------


def tiny_state() -> dict[str, Any]:
    return {"weights": torch.zeros(16), "epoch": 1}


def make_root(root: Path, count: int) -> None:
    """A root with ``count`` committed checkpoints: one real save, copied with rewritten records."""
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, tiny_state())
    template = root / "step_1"
    record = json.loads((template / "metadata.json").read_text())
    for step in range(2, count + 1):
        target = root / f"step_{step}"
        shutil.copytree(template, target)
        record["step"] = step
        (target / "metadata.json").write_text(json.dumps(record))
    os.sync()
    swap_pointer(root / "latest", f"step_{count}", DEFAULT_FILE_OPS)


def bench_cleanup(b: Bench) -> list[Table]:
    table = Table(
        "cleanup",
        "Retention bookkeeping on the training thread",
        "extra time inside async `save()` of a tiny state with N retained checkpoints "
        "(`Retention(keep_last=N)`, so every commit also prunes one), over a root that retains one",
        unit="ms",
    )
    counts = (1, *CLEANUP_COUNTS)
    managers: dict[int, CheckpointManager] = {}
    opened: dict[int, float] = {}
    for count in counts:
        root = b.fresh(f"cleanup-{count}")
        make_root(root, count)
        start = time.perf_counter()
        managers[count] = CheckpointManager(root, retention=Retention(keep_last=count))
        opened[count] = time.perf_counter() - start
        target = 5.0 if count == max(CLEANUP_COUNTS) else None
        table.row(f"{count} checkpoints", target=target, role="ours")  # all safeckpt; no peer here
    steps = {count: count for count in counts}

    def save_time(count: int) -> float:
        mgr = managers[count]
        times = []
        for _ in range(b.args.cleanup_saves):
            steps[count] += 1
            start = time.perf_counter()
            mgr.save(steps[count], tiny_state())
            times.append(time.perf_counter() - start)
            mgr.wait()
        return statistics.median(times)

    save_time(1)  # warm-up
    for rep in range(b.args.reps):
        times = {count: save_time(count) for count in interleaved(counts, rep)}
        base = times.pop(1)
        table.limit_seconds.append(base)
        for count, seconds in times.items():
            table.add_value(f"{count} checkpoints", (seconds - base) * 1000, seconds)
    table.rows = [table.row(f"{count} checkpoints") for count in CLEANUP_COUNTS]
    for mgr in managers.values():
        mgr.close()
    table.limit = "async `save()` of the same state into a root with `Retention(keep_last=1)`"
    table.notes.append(
        f"Each value is the median over {b.args.cleanup_saves} saves in one repetition, minus the same "
        "for the baseline root; 'median time' is the whole `save()` call."
    )
    table.notes.append(
        "Opening the root (reading every record) took "
        + ", ".join(f"{opened[c] * 1000:.0f} ms at {c}" for c in CLEANUP_COUNTS)
        + " (once per run, not per save)."
    )
    return [table]


# --- main ---------------------------------------------------------------------------------------------


BENCHES: dict[str, Callable[[Bench], list[Table]]] = {
    "async": bench_async,
    "sync": bench_sync,
    "restore": bench_restore,
    "inflation": bench_inflation,
    "cleanup": bench_cleanup,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="size of the whole state (model + AdamW)")
    p.add_argument(
        "--reps", type=int, default=5, help="interleaved repetitions per run (run_all makes 3 runs)"
    )
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: the temp directory)")
    p.add_argument("--json", type=Path, default=None, help="also write the report here (run_all.py reads it)")
    p.add_argument("--window", type=float, default=2.0, help="seconds of the no-save compute baseline")
    p.add_argument("--matmul", type=int, default=512, help="size of the compute loop's square matmul")
    p.add_argument("--compute-threads", type=int, default=1, help="intra-op threads of the compute loop")
    p.add_argument("--cleanup-saves", type=int, default=25, help="saves per root per repetition (cleanup)")
    return p.parse_args(argv)


def run(args: argparse.Namespace, command: str) -> Report:
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="safeckpt-bench-", dir=args.dir))
    try:
        state = build_state(int(args.size_gib * GIB), optimizer=True)
        flat = state.flat()
        bench = Bench(args, work, state, list(flat), list(flat.values()), host_buffers(flat.values()))
        tables = []
        for name in args.only:
            print(f"[bench_save] {name} ...", file=sys.stderr, flush=True)
            tables += BENCHES[name](bench)
        shape = state.shape
        info = machine() | {"filesystem": filesystem_of(work)}
        params = {
            "state": f"{state.nbytes / GIB:.2f} GiB fp32 (model {shape.layers} layers, hidden "
            f"{shape.hidden}, vocab {shape.vocab}, + AdamW moments; {len(flat)} tensors)",
            "reps": args.reps,
        }
        return Report("bench_save", command, info, params, tables, time.monotonic() - started)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = shlex.join([".venv/bin/python", "benchmarks/bench_save.py", *argv])
    report = run(args, command)
    print(report.to_markdown())
    if args.json is not None:
        report.save(args.json)
    if beaten := report.beaten():
        print(f"[bench_save] FAILED: {'; '.join(beaten)}: the limit is not a limit", file=sys.stderr)
        return BEATEN
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
