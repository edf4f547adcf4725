"""Overlapped staging: how long ``save()`` blocks, and what the training step after a save costs.

    .venv/bin/python benchmarks/bench_overlap.py [--width 2048] [--batch 512] [--reps 25]
    .venv/bin/python benchmarks/run_all.py --only bench_overlap     # into benchmarks/results.md

The model: an MLP with BatchNorm and its Adam state (about 50 MB at width 2048), whose forward,
backward and ``optimizer.step()`` outlast a memcpy of its state. Each round times, in a rotated
order: a memcpy of the state's tensors into preallocated buffers (the limit); a training step
without a save; and for each way to save, ``save()`` (how long it blocks) followed at once by one
training step (the save's write then runs beside it, as in a job). The ways: safeckpt with
``overlap_staging=True``, safeckpt ``async_save=True`` without it, and ``dcp.async_save`` with
DCP's background staging (``DefaultStager``, waited for before ``optimizer.step()``, as DCP
leaves to its user). Each save's write is waited for outside the timings. Prints Markdown.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import safeckpt
from bench_common import host_buffers, memcpy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument(
        "--compute-threads",
        type=int,
        default=1,
        help="intra-op threads of the training step: 1 leaves a core to the save's background work, "
        "as a GPU job leaves its CPU",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.compute_threads)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(args.width, args.width), nn.BatchNorm1d(args.width), nn.ReLU(), nn.Linear(args.width, 16)
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width)

    def step(before_step: Callable[[], None] = lambda: None) -> None:
        model(x).pow(2).mean().backward()
        before_step()
        optim.step()
        optim.zero_grad(set_to_none=True)

    step()  # Adam's moments exist
    state = {"model": model, "optim": optim}
    tensors = [*model.state_dict().values()] + [
        v for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    buffers = host_buffers(tensors)
    times: dict[str, list[float]] = {}
    steps = iter(range(1, 1 << 30))

    with tempfile.TemporaryDirectory() as tmp:
        keep = safeckpt.Retention(keep_last=1)
        overlapped = safeckpt.CheckpointManager(Path(tmp) / "o", overlap_staging=True, retention=keep)
        plain = safeckpt.CheckpointManager(Path(tmp) / "a", retention=keep)
        stager = _dcp_stager()

        def with_manager(mgr: safeckpt.CheckpointManager, name: str) -> Callable[[], None]:
            def run() -> None:
                start = time.perf_counter()
                mgr.save(next(steps), state)
                blocked = time.perf_counter()
                step()
                times.setdefault(f"{name}: save() blocks", []).append(blocked - start)
                times.setdefault(f"{name}: save() + next step", []).append(time.perf_counter() - start)
                mgr.wait()

            return run

        def with_dcp() -> None:
            start = time.perf_counter()
            response = dcp.async_save(
                {"model": model.state_dict(), "optim": optim.state_dict()},
                checkpoint_id=str(Path(tmp) / f"dcp{next(steps) % 2}"),
                async_stager=stager,
                no_dist=True,
            )
            blocked = time.perf_counter()
            staged = getattr(response, "staging_completion", None)
            step(lambda: staged.result() if staged is not None else None)  # before the step changes it
            times.setdefault("dcp.async_save: save() blocks", []).append(blocked - start)
            times.setdefault("dcp.async_save: save() + next step", []).append(time.perf_counter() - start)
            getattr(response, "upload_completion", response).result()

        def timed(name: str, fn: Callable[[], Any]) -> Callable[[], None]:
            def run() -> None:
                start = time.perf_counter()
                fn()
                times.setdefault(name, []).append(time.perf_counter() - start)

            return run

        rows = {
            "memcpy": timed("memcpy", lambda: memcpy(tensors, buffers)),
            "step": timed("step without a save", step),
            "overlap": with_manager(overlapped, "overlap_staging=True"),
            "async": with_manager(plain, "async_save=True"),
            "dcp": with_dcp,
        }
        for run in rows.values():  # warm-up: staging buffers, plans
            run()
        times.clear()
        order = list(rows)
        for rep in range(args.reps):
            for name in order[rep % len(order) :] + order[: rep % len(order)]:
                rows[name]()
        overlapped.close()
        plain.close()
    print(_markdown(times, nbytes, args))
    return 0


def _dcp_stager() -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # Pinned memory and non-blocking copies need CUDA; shared memory is for a separate upload process.
    cuda = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )
    )


def _markdown(times: dict[str, list[float]], nbytes: int, args: argparse.Namespace) -> str:
    memcpy_t = statistics.median(times["memcpy"])
    step_t = statistics.median(times["step without a save"])
    out = [
        f"State: {nbytes / 1e6:.0f} MB (an MLP of width {args.width} with BatchNorm, and its Adam "
        f"state); a step: forward, backward and `optimizer.step()` on a batch of {args.batch}, on "
        f"{args.compute_threads} intra-op thread(s) of {os.cpu_count()} cores; "
        f"{args.reps} rounds in a rotated order: medians, and for the step after a save the median "
        f"of the rounds' ratios to the step without a save timed in the same round, with their "
        f"range. memcpy: {memcpy_t * 1e3:.1f} ms; a step without a save: {step_t * 1e3:.1f} ms.",
        "",
        "| saving with | `save()` blocks | / memcpy | `save()` + next step | / a step without a save "
        "| extra / memcpy |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("overlap_staging=True", "async_save=True", "dcp.async_save"):
        blocked = statistics.median(times[f"{name}: save() blocks"])
        totals = times[f"{name}: save() + next step"]
        # Each round's ratio to the step without a save and the memcpy timed in the same round.
        ratios = [t / s for t, s in zip(totals, times["step without a save"], strict=True)]
        extras = [
            (t - s) / m for t, s, m in zip(totals, times["step without a save"], times["memcpy"], strict=True)
        ]
        out.append(
            f"| {name} | {blocked * 1e3:.2f} ms | {blocked / memcpy_t:.2f}x | "
            f"{statistics.median(totals) * 1e3:.1f} ms | {statistics.median(ratios):.3f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {statistics.median(extras):.2f}x |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
