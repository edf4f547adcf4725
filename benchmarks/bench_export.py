"""Export throughput: ``safeckpt export`` of a checkpoint against a raw read plus write (not a test).

    .venv/bin/python benchmarks/bench_export.py                   # 1 GiB fp32 model, 3 reps
    .venv/bin/python benchmarks/bench_export.py --size-gib 0.25 --reps 2

The state is the transformer-shaped fp32 model of ``bench_common`` saved once
with ``CheckpointManager``. Each repetition evicts the checkpoint's pages from
the cache, then times (order rotating):

* raw: read every DCP data file of the checkpoint and write the same bytes to
  one file, fsynced (64 MiB at a time): the limit for any converter;
* ``export_weights`` to one safetensors file (the library call the command makes);
* ``export_weights`` to a Hugging Face folder in 256 MB shards.

A value is the export's time over the raw time of the same repetition. The
peak RSS of the real command (``safeckpt export`` in a fresh interpreter, minus that
of ``safeckpt ls``, i.e. the interpreter and torch) shows that memory stays near
one read group, not the model's size.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (
    GIB,
    MIB,
    Report,
    Table,
    build_state,
    evict_all,
    filesystem_of,
    interleaved,
    machine,
    settle,
)
from safeckpt import CheckpointManager
from safeckpt.export import DEFAULT_READ_BUDGET, export_weights

_CHUNK = 64 * MIB


def raw_copy(sources: list[Path], target: Path) -> None:
    """Read ``sources`` and write their bytes to ``target``, fsynced: the bound for any converter."""
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for source in sources:
            fd = os.open(source, os.O_RDONLY)
            try:
                while n := os.readv(fd, [view]):
                    written = 0
                    while written < n:
                        written += os.write(out, view[written:n])
            finally:
                os.close(fd)
        os.fsync(out)
    finally:
        os.close(out)


# Runs the command in a fresh interpreter and reports that process's own peak RSS (VmHWM): the
# rusage of a child would include the parent's, which Linux carries across fork and exec.
_PEAK = (
    "import sys\n"
    "from safeckpt.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1]\n"
    "print('VmHWM', hwm, file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def peak_rss_kib(argv: list[str]) -> int:
    """Peak resident set (KiB) of ``safeckpt ARGV`` run in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _PEAK, *argv], capture_output=True, text=True, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("VmHWM ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"safeckpt {shlex.join(argv)} failed: {proc.stderr[-2000:]}")
    return int(lines[-1].split()[1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-gib", type=float, default=1.0, help="model size (fp32 parameters)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the tables as JSON here")
    args = parser.parse_args(argv)
    command = shlex.join([".venv/bin/python", "benchmarks/bench_export.py", *argv])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="safeckpt-bench-export-", dir=os.environ.get("BENCH_DIR")) as tmp:
        work = Path(tmp)
        root = work / "ckpt"
        bench = build_state(int(args.size_gib * GIB), optimizer=False)
        model_bytes = bench.nbytes
        with CheckpointManager(root, async_save=False) as mgr:
            mgr.save(1, bench.state)
        del bench
        settle()
        data_files = sorted((root / "step_1").glob("*.distcp"))
        table = Table(
            key="export",
            title="Export to safetensors vs. raw read + write",
            measure="export time / raw read + write of the checkpoint's data files (cold cache)",
            limit="read every .distcp file, write the bytes to one file, fsync",
        )
        variants = {
            "export_weights, one .safetensors file": lambda: export_weights(
                root, work / "model.safetensors", force=True
            ),
            "export_weights, --format hf --shard-size 256MB": lambda: export_weights(
                root, work / "hf", format="hf", shard_size=256 * 10**6, force=True
            ),
        }
        table.row("export_weights, one .safetensors file", target=1.5)
        table.row("export_weights, --format hf --shard-size 256MB", target=1.5)
        for rep in range(args.reps):
            times: dict[str, float] = {}
            for name in interleaved(["raw", *variants], rep):
                evict_all(root)
                settle()
                begin = time.perf_counter()
                if name == "raw":
                    raw_copy(data_files, work / "raw.bin")
                else:
                    variants[name]()
                times[name] = time.perf_counter() - begin
            table.limit_seconds.append(times["raw"])
            for name in variants:
                table.add_ratio(name, times[name], times["raw"])
            print(f"rep {rep}: " + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()), file=sys.stderr)
        base = peak_rss_kib(["ls", str(root)])
        peak = peak_rss_kib(["export", str(root), "--to", str(work / "cli.safetensors"), "--force"])
        table.notes.append(
            f"Throughput: {model_bytes / GIB:.2f} GiB; raw median "
            f"{model_bytes / MIB / sorted(table.limit_seconds)[len(table.limit_seconds) // 2]:.0f} MiB/s."
        )
        table.notes.append(
            f"Peak RSS of `safeckpt export` above `safeckpt ls`: {(peak - base) / 1024:.0f} MiB "
            f"for a {model_bytes / MIB:.0f} MiB model (read group: {DEFAULT_READ_BUDGET / MIB:.0f} MiB)."
        )
        report = Report(
            section="bench_export",
            command=command,
            machine={**machine(), "filesystem (benchmark files)": filesystem_of(work)},
            parameters={"model": f"{model_bytes / GIB:.2f} GiB fp32", "reps": args.reps},
            tables=[table],
            wall_seconds=time.perf_counter() - started,
        )
    print(report.to_markdown())
    if args.json is not None:
        report.save(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
