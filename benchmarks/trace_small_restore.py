"""Cold restores of 10,000 small tensors, timed one by one (a trace, not a benchmark).

    .venv/bin/python benchmarks/trace_small_restore.py             # 6 restores
    PYTHONPATH=/path/to/other/checkout/src .venv/bin/python benchmarks/trace_small_restore.py

Saves ``bench_state``'s 10,000-tensor state (4 KiB each, int keys, in a nested
dict) with an async manager, then restores it in place into fresh tensors with
the page cache evicted before each restore, and prints every time and the
median. Run it alternately against two checkouts (``PYTHONPATH``) to compare
them on the same machine state.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import safeckpt
from bench_common import evict
from bench_state import SMALL_NUMEL, SMALL_TENSORS
from safeckpt import CheckpointManager, Retention


def small_state(make: Callable[[int], torch.Tensor]) -> dict[str, object]:
    return {"small": {"layers": {i: make(SMALL_NUMEL) for i in range(SMALL_TENSORS)}, "step": 0}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--restores", type=int, default=6)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="safeckpt-small-")) / "ckpt"
    try:
        with CheckpointManager(root, retention=Retention()) as mgr:
            saved = small_state(torch.randn)
            for step in range(4):  # warm: the walk's cache, the staging buffers, the plans
                mgr.save(step, saved)
                mgr.wait()
            times = []
            for _ in range(args.restores):
                target = small_state(torch.empty)
                evict(root)
                start = time.perf_counter()
                mgr.restore(target)
                times.append(time.perf_counter() - start)
        print(
            f"{Path(safeckpt.__file__).parent}: restores (ms) {[round(t * 1e3) for t in times]}, "
            f"median {statistics.median(times) * 1e3:.0f} ms"
        )
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
