"""Where a compute loop's long steps come from while a write runs beside it (a trace, not a benchmark).

    .venv/bin/python benchmarks/trace_steps.py                 # 1 GiB, 3 rounds
    .venv/bin/python benchmarks/trace_steps.py --size-gib 0.5 --rounds 5

Runs ``bench_save``'s compute loop (a 512x512 matmul per step, one intra-op
thread) alone, then beside each background write: a safeckpt async save of the
model and AdamW state until ``wait()`` returns; the same bytes written by one
thread that copies each 16 MiB into an aligned buffer and then writes it with
``O_DIRECT`` (copy and disk never overlap); the same through
``safeckpt._fs.direct_write.DirectFileWriter`` (a second thread writes one buffer
while the next one fills, as a save does); and ``bench_common.raw_write`` (buffered
64 MiB writes and an fsync: ``bench_save``'s floor). For each it prints the step-time
inflation, the steps that took more than 3x the idle median, what the
compute thread did during them (voluntary and involuntary context switches,
its own CPU time, from ``getrusage(RUSAGE_THREAD)``) and the host's steal time
over the window (``/proc/stat``). A long step with no context switch and a few
ms of its own CPU was not waiting for the GIL or a lock: its CPU was taken by
the hypervisor.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import GIB, build_state, raw_write, steal_seconds
from safeckpt import CheckpointManager, Retention
from safeckpt._fs.direct_write import BUFFER_BYTES, DirectFileWriter, copy_bytes, give_back, take_buffer

_MATMUL = 512


class Loop:
    def __init__(self) -> None:
        self.a, self.b = torch.randn(_MATMUL, _MATMUL), torch.randn(_MATMUL, _MATMUL)
        self.out = torch.empty(_MATMUL, _MATMUL)

    def run(
        self, keep_going: Callable[[float], bool]
    ) -> tuple[list[float], list[tuple[float, int, int, float]]]:
        """Step times, and for each step over 12 ms: (ms, voluntary, involuntary switches, own CPU ms)."""
        steps: list[float] = []
        slow: list[tuple[float, int, int, float]] = []
        start = time.perf_counter()
        while True:
            before = resource.getrusage(resource.RUSAGE_THREAD)
            t0 = time.perf_counter()
            torch.mm(self.a, self.b, out=self.out)
            t1 = time.perf_counter()
            steps.append(t1 - t0)
            if t1 - t0 > 0.012:
                after = resource.getrusage(resource.RUSAGE_THREAD)
                cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
                slow.append(
                    (
                        1e3 * (t1 - t0),
                        after.ru_nvcsw - before.ru_nvcsw,
                        after.ru_nivcsw - before.ru_nivcsw,
                        1e3 * cpu,
                    )
                )
            if not keep_going(t1 - start):
                return steps, slow


def _sequential_direct(views: list[memoryview], path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    direct = os.open(path, os.O_WRONLY | os.O_DIRECT)
    buffer = take_buffer()
    try:
        offset = 0
        for view in views:
            for begin in range(0, len(view) - len(view) % BUFFER_BYTES, BUFFER_BYTES):
                copy_bytes(memoryview(buffer), view[begin : begin + BUFFER_BYTES])
                os.pwrite(direct, buffer, offset)
                offset += BUFFER_BYTES
        os.fsync(fd)
    finally:
        os.close(direct)
        os.close(fd)
        give_back(buffer)


def _overlapped_direct(views: list[memoryview], path: Path) -> None:
    with DirectFileWriter(path) as out:
        for view in views:
            out.write(view)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    state = build_state(int(args.size_gib * GIB), optimizer=True)
    tensors = list(state.flat().values())
    views = [memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for t in tensors]
    work = Path(tempfile.mkdtemp(prefix="trace-steps-", dir=args.dir))
    mgr = CheckpointManager(work / "root", retention=Retention(keep_last=1))
    loop = Loop()
    steps = iter(range(1, 1 << 30))

    def beside(
        name: str, write: Callable[[Path], None]
    ) -> tuple[list[float], list[tuple[float, int, int, float]], float]:
        path = work / f"{name}-{time.time_ns()}.bin"
        thread = threading.Thread(target=write, args=(path,), daemon=True)
        stolen = steal_seconds()
        thread.start()
        out = loop.run(lambda _: thread.is_alive())
        thread.join()
        path.unlink(missing_ok=True)
        return (*out, steal_seconds() - stolen)

    def safeckpt_save(_: Path) -> None:
        mgr.wait()

    writers: dict[str, Callable[[Path], None]] = {
        "safeckpt async save": safeckpt_save,
        "O_DIRECT, copy then write": lambda path: _sequential_direct(views, path),
        "O_DIRECT, DirectFileWriter": lambda path: _overlapped_direct(views, path),
        "buffered + fsync": lambda path: raw_write(tensors, path),
    }
    mgr.save(next(steps), state.state)
    mgr.wait()
    for round_ in range(args.rounds):
        os.sync()
        stolen = steal_seconds()
        idle, _ = loop.run(lambda elapsed: elapsed < 1.5)
        idle_steal = (steal_seconds() - stolen) / sum(idle)
        base = statistics.median(idle)
        print(f"round {round_ + 1}: idle step {1e3 * base:.2f} ms, steal {1e3 * idle_steal:.0f} ms/s")
        for name, write in writers.items():
            os.sync()
            if name.startswith("safeckpt"):
                mgr.save(next(steps), state.state)  # staging is not part of the window
            times, slow, stolen = beside(name, write)
            window = sum(times)
            inflation = statistics.mean(times) / base
            long = [t for t in times if t > 3 * base]
            print(
                f"  {name:28s} {inflation:.2f}x  {len(long):3d} long steps ({1e3 * sum(long):4.0f} ms)  "
                f"steal {1e3 * stolen / window:4.0f} ms/s"
            )
            if slow:
                voluntary = sum(s[1] for s in slow)
                involuntary = sum(s[2] for s in slow)
                own = statistics.median(s[3] for s in slow)
                print(
                    f"      steps over 12 ms: median {statistics.median(s[0] for s in slow):.0f} ms, own CPU "
                    f"{own:.1f} ms, {voluntary} voluntary, {involuntary} involuntary switches in {len(slow)}"
                )
    mgr.close()


if __name__ == "__main__":
    main()
