"""The Hugging Face Trainer: the training stall per save, its own save against ``safeckpt.hf.attach``.

    .venv/bin/python benchmarks/bench_hf.py                  # ~200 MB of weights (~600 MB with AdamW)
    .venv/bin/python benchmarks/bench_hf.py --layers 2 --saves 3

A GPT-2 built from a config (no download: ``--vocab``, ``--width``, ``--layers``), AdamW, one
batch of random tokens a step, a save every step; each variant in a process of its own. Stall:
seconds the training loop spends in ``Trainer._save_checkpoint`` (the one call the loop makes
when a save is due), over the saves after the first (the first allocates safeckpt's reused
buffers). Before each step the previous save is let finish, outside the timing: a stall, not the
back-pressure of saving faster than the disk writes (``save()`` then waits for the write before,
by design, ``queue_depth=1``). Baseline: a memcpy of the same state (the model's tensors and
AdamW's moments) into preallocated buffers (``bench_common.memcpy``), the least a save that copies
the state must block, timed at the start of each step (:class:`Baseline`): on a shared machine a
copy's time changes by 5x within minutes, so the ratio is the median of each save's stall over
its own step's copy. The Trainer's own save writes safetensors and ``torch.save`` files
synchronously and does not fsync; ``attach`` returns after the copy and writes, fsyncs and
commits in the background.

Resume: seconds from ``train()`` to its first step, the Trainer resuming from its own
``checkpoint-N`` against ``attach`` resuming from its root (both from the page cache).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import host_buffers, memcpy, settle, timed


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.rows = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def build(options: argparse.Namespace, out: Path, steps: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=options.vocab, n_positions=64, n_embd=options.width, n_layer=options.layers, n_head=12
    )
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=1,
        max_steps=steps,
        save_strategy="steps",
        save_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
    )
    return Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(64, 32, options.vocab))


class Clock:
    """Seconds in each ``_save_checkpoint`` call, and the time of the first step's start."""

    def __init__(self, trainer: Any) -> None:
        from transformers import TrainerCallback

        self.stalls: list[float] = []
        self.first_step: float | None = None
        original = trainer._save_checkpoint
        clock = self

        def timed_save(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                clock.stalls.append(time.perf_counter() - start)

        trainer._save_checkpoint = timed_save

        class FirstStep(TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if clock.first_step is None:
                    clock.first_step = time.perf_counter()

        trainer.add_callback(FirstStep())


class Baseline:
    """At each step's start, outside the timed save: waits until the previous save is committed (a
    stall, not the back-pressure of saving faster than the disk writes: ``save()`` then waits for
    the write before, by design, ``queue_depth=1``), then times a memcpy of the state into
    preallocated buffers, so each save has its baseline from the same moment of a shared machine."""

    def __new__(cls, trainer: Any, manager: Any, copies: list[float]) -> Any:
        from transformers import TrainerCallback

        buffers: list[torch.Tensor] = []

        class _Baseline(TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if manager is not None:
                    manager.wait()
                tensors = state_tensors(trainer)
                if len(buffers) != len(tensors):
                    buffers[:] = host_buffers(tensors)
                    memcpy(tensors, buffers)
                settle()
                copies.append(timed(lambda: memcpy(tensors, buffers)))

        return _Baseline()


def state_tensors(trainer: Any) -> list[torch.Tensor]:
    tensors = [t.detach() for t in trainer.model.state_dict().values()]
    for per_param in trainer.optimizer.state.values():
        tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return tensors


def variant(options: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One variant in this process: ``own`` (with the memcpy baseline) or ``attach``."""
    import safeckpt.hf

    steps = options.saves
    trainer = build(options, work / options.variant, steps)
    manager = None
    if options.variant == "attach":  # before the clock: it times the method the Trainer has then
        manager = safeckpt.hf.attach(trainer, work / "root")
    copies: list[float] = []
    trainer.add_callback(Baseline(trainer, manager, copies))
    clock = Clock(trainer)
    trainer.train()
    if manager is not None:
        manager.close()
    # save k ends step k, whose start timed copy k; the first save allocates buffers, and the
    # first step's copy has no optimizer state yet
    stalls, copies = clock.stalls[1:], copies[1:]
    results: dict[str, Any] = {
        "stall": statistics.median(stalls),
        "memcpy": statistics.median(copies),
        "ratio": statistics.median(s / c for s, c in zip(stalls, copies, strict=True)),
        "stalls": clock.stalls,
        "copies": copies,
        "state_bytes": sum(t.numel() * t.element_size() for t in state_tensors(trainer)),
    }
    # resume (one more step): the Trainer from its own last folder, attach from its root
    del trainer
    settle()
    again = build(options, work / f"{options.variant}-again", steps + 1)
    clock = Clock(again)
    resume_from = None
    if options.variant == "attach":
        manager = safeckpt.hf.attach(again, work / "root")
    else:
        resume_from = str(work / "own" / f"checkpoint-{steps}")
    start = time.perf_counter()
    again.train(resume_from_checkpoint=resume_from)
    results["resume"] = (clock.first_step or start) - start
    if manager is not None:
        manager.close()
    return results


def run(options: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Each variant in a process of its own (neither sees the other's memory or page cache)."""
    results: dict[str, Any] = {}
    for name in ("own", "attach"):
        out = work / f"{name}.json"
        command = [sys.executable, __file__, "--variant", name, "--dir", str(work), "--out", str(out)]
        command += [f"--{k}={getattr(options, k)}" for k in ("vocab", "width", "layers", "saves")]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results[name] = json.loads(out.read_text())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--variant", choices=["own", "attach"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.variant:
        options.out.write_text(json.dumps(variant(options, options.dir)))
        return
    work = Path(tempfile.mkdtemp(prefix="bench_hf.", dir=options.dir))
    try:
        both = run(options, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r = {
        "state_bytes": both["own"]["state_bytes"],
        "memcpy_own": both["own"]["memcpy"],
        "memcpy_attach": both["attach"]["memcpy"],
        "own": both["own"]["stall"],
        "attach": both["attach"]["stall"],
        "ratio_own": both["own"]["ratio"],
        "ratio_attach": both["attach"]["ratio"],
        "resume_own": both["own"]["resume"],
        "resume_attach": both["attach"]["resume"],
    }
    mib = r["state_bytes"] / 2**20
    print(f"command: {' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}")
    print(f"state: {mib:.0f} MiB (weights and AdamW moments); cpu count {os.cpu_count()}")
    print()
    print("| stall per save (median) | seconds | memcpy of the state, same moments | x memcpy |")
    print("|---|---|---|---|")
    rows = (("Trainer's own save (`_save_checkpoint`)", "own"), ("`safeckpt.hf.attach`", "attach"))
    for label, key in rows:
        print(f"| {label} | {r[key]:.3f} | {r['memcpy_' + key]:.3f} | {r['ratio_' + key]:.2f} |")
    print()
    print("| resume: `train()` to the first step | seconds |")
    print("|---|---|")
    print(f"| Trainer from its own checkpoint-N | {r['resume_own']:.2f} |")
    print(f"| `safeckpt.hf.attach`, auto-resume | {r['resume_attach']:.2f} |")


if __name__ == "__main__":
    main()
