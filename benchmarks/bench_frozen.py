"""Frozen weights stored once (issue 56): a LoRA-style run's saves, against the trainable state alone.

    .venv/bin/python benchmarks/bench_frozen.py [--base-mib 256] [--saves 4] [--main-src /work/main/src]

A frozen base of ``--base-mib`` MiB (``nn.Linear`` layers, ``requires_grad=False``),
rank-8 LoRA adapters on each and their AdamW state; an adapter step between
saves. Each save is async (``save()`` then ``wait()``), on a fresh local root.
Rows, per save after the first (median):

* bytes written (files of the new checkpoint not shared with an earlier one)
  over the adapter + optimizer bytes (the issue's target: <= 1.05x);
* time until durable (``save()`` to ``wait()``) over that of a root saving the
  trainable state alone (<= 1.2x);
* ``save()`` blocking over a memcpy of the trainable state (<= 1.2x);
* a full fine-tune (nothing frozen, same model) with this code and, with
  ``--main-src``, with that source tree, in a subprocess of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

WIDTH = 1024
RANK = 8


class LoraLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.lora_a = nn.Parameter(torch.randn(RANK, WIDTH) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(WIDTH, RANK))


def build(base_mib: int, frozen: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    layers = max(1, (base_mib << 20) // (4 * (WIDTH * WIDTH + WIDTH)))
    model = nn.Sequential(*(LoraLinear() for _ in range(layers)))
    if frozen:
        for layer in model:
            layer.base.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-3)


def adapter_step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    optim.step()
    optim.zero_grad()


def trainable_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> int:
    total = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    for state in optim.state.values():
        total += sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
    return total


def written_bytes(step_dir: Path) -> int:
    record = json.loads((step_dir / "metadata.json").read_text())
    shared = {n for n, c in (record.get("contents") or {}).items() if "from" in c}
    return sum(size for name, size in record["files"].items() if name not in shared)


def run_saves(
    root: Path, state: dict[str, Any], model: nn.Module, optim: Any, saves: int
) -> list[dict[str, float]]:
    from safeckpt import CheckpointManager, Retention

    rows = []
    with CheckpointManager(root, retention=Retention(keep_last=2)) as mgr:
        for step in range(1, saves + 1):
            adapter_step(model, optim)
            start = time.perf_counter()
            mgr.save(step, state)
            blocked = time.perf_counter() - start
            mgr.wait()
            durable = time.perf_counter() - start
            rows.append(
                {"blocked": blocked, "durable": durable, "written": written_bytes(root / f"step_{step}")}
            )
    return rows


def memcpy_time(model: nn.Module, optim: torch.optim.Optimizer, reps: int = 5) -> float:
    tensors = [p.detach() for p in model.parameters() if p.requires_grad]
    tensors += [v for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    targets = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for t, d in zip(tensors, targets, strict=True):
            d.copy_(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def full_fine_tune(base_mib: int, saves: int) -> dict[str, float]:
    torch.manual_seed(0)
    model, optim = build(base_mib, frozen=False)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_saves(Path(tmp) / "full", {"model": model, "optim": optim}, model, optim, saves)[1:]
    return {k: statistics.median(r[k] for r in rows) for k in ("blocked", "durable", "written")}


def row(*cells: str) -> None:
    print("| " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-mib", type=int, default=256)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--main-src", default=None, help="a source tree to compare the full fine-tune with")
    parser.add_argument("--full-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.full_only:  # the subprocess of --main-src
        print(json.dumps(full_fine_tune(args.base_mib, args.saves)))
        return 0
    torch.manual_seed(0)
    model, optim = build(args.base_mib, frozen=True)
    adapter_step(model, optim)  # the optimizer has its state before the first save
    trainable_only = nn.ParameterDict(
        {n.replace(".", "_"): p for n, p in model.named_parameters() if p.requires_grad}
    )
    with tempfile.TemporaryDirectory() as tmp:
        lora = run_saves(Path(tmp) / "lora", {"model": model, "optim": optim}, model, optim, args.saves)[1:]
        alone = run_saves(
            Path(tmp) / "alone", {"model": trainable_only, "optim": optim}, model, optim, args.saves
        )[1:]
    useful = trainable_bytes(model, optim)
    copy = memcpy_time(model, optim)
    med = {k: statistics.median(r[k] for r in lora) for k in ("blocked", "durable", "written")}
    base = {k: statistics.median(r[k] for r in alone) for k in ("blocked", "durable", "written")}
    full_here = full_fine_tune(args.base_mib, args.saves)
    full_main = None
    if args.main_src:
        env = dict(os.environ, PYTHONPATH=args.main_src)
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--full-only",
                "--base-mib",
                str(args.base_mib),
                "--saves",
                str(args.saves),
            ],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        full_main = json.loads(out.stdout.strip().splitlines()[-1])
    frozen_mib = sum(p.nbytes for p in model.parameters() if not p.requires_grad) / 2**20
    command = f"bench_frozen.py --base-mib {args.base_mib} --saves {args.saves}"
    if args.main_src:
        command += f" --main-src {args.main_src}"
    print(
        f"Produced by `.venv/bin/python benchmarks/{command}`: frozen base {frozen_mib:.0f} MiB, "
        f"adapters + AdamW state {useful / 2**20:.1f} MiB; medians of saves 2..{args.saves}."
    )
    print()
    row("measure", "value", "against", "ratio", "target")
    row("---", "---", "---", "---", "---")
    mib, ms = 2**20, 1e-3
    row(
        "bytes written per save",
        f"{med['written'] / mib:.1f} MiB",
        f"adapters + optimizer {useful / mib:.1f} MiB",
        f"{med['written'] / useful:.2f}x",
        "<= 1.05x",
    )
    row(
        "time until durable",
        f"{med['durable'] / ms:.0f} ms",
        f"trainable state alone {base['durable'] / ms:.0f} ms",
        f"{med['durable'] / base['durable']:.2f}x",
        "<= 1.2x",
    )
    row(
        "save() blocking",
        f"{med['blocked'] / ms:.0f} ms",
        f"memcpy of trainable state {copy / ms:.1f} ms",
        f"{med['blocked'] / copy:.1f}x",
        "<= 1.2x",
    )
    row(
        "save() blocking, trainable state alone",
        f"{base['blocked'] / ms:.0f} ms",
        f"memcpy {copy / ms:.1f} ms",
        f"{base['blocked'] / copy:.1f}x",
        "(for scale)",
    )
    for label, full in (("this tree", full_here), ("main", full_main)):
        if full is not None:
            row(
                f"full fine-tune ({label}): blocking / durable / written",
                f"{full['blocked'] / ms:.0f} ms / {full['durable'] / ms:.0f} ms / "
                f"{full['written'] / mib:.0f} MiB",
                "",
                "",
                "no more than main",
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
