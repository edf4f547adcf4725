"""The demo: a small seeded model trained on CPU with checkpoints, killed, and resumed bit-exactly.

    safeckpt demo --dir runs/demo                  # trains, saves every 25 steps, keeps 3 (+ the best)
    safeckpt demo --dir runs/demo --kill-at 130    # SIGKILLs itself at step 130, mid-run
    safeckpt demo --dir runs/demo                  # prints "resumed from step N", finishes

``kill -TERM <pid>`` (or SIGUSR1, as SLURM sends) mid-run is a preemption: the
demo saves the step it is at, waits until that save is durable, and exits with
status 128 + the signal (143 for SIGTERM); run it again and it resumes there.

Whether or not the run was interrupted, it ends with the same ``final weights
sha256``: model, optimizer, LR scheduler, data position and RNG all travel in the
checkpoint, so a resumed run continues exactly where the saved one was.

Also ``python -m safeckpt.demo`` and, data-parallel over gloo,
``torchrun --nproc-per-node 2 -m safeckpt.demo``: each rank trains a replica on
its own shard of the data, gradients are all-reduced, and only rank 0 prints.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from .parser import DEMO_METRIC as METRIC  # the demo's options are in .parser

# The task: classify noisy inputs by a fixed random linear "teacher". Sized so that
# 300 steps take about ten seconds on one CPU thread and a checkpoint is a few MB.
FEATURES, HIDDEN, CLASSES = 64, 1024, 10
SAMPLES, BATCH = 8192, 128


class SyntheticData:
    """A resumable data source: a fixed synthetic data set, reshuffled every epoch,
    with fresh input noise on every batch.

    Its state (epoch, cursor, this epoch's order and the generator) goes into the
    checkpoint through ``state_dict()``/``load_state_dict()``, so a resumed run
    sees exactly the batches the uninterrupted run would have seen.
    """

    def __init__(self, *, seed: int, rank: int = 0, world_size: int = 1, batch: int = BATCH) -> None:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(SAMPLES, FEATURES, generator=g)
        teacher = torch.randn(FEATURES, CLASSES, generator=g)
        y = (x @ teacher + 2.0 * torch.randn(SAMPLES, CLASSES, generator=g)).argmax(dim=1)
        self.x, self.y = x[rank::world_size], y[rank::world_size]  # this rank's shard
        self.batch = batch
        self.generator = torch.Generator().manual_seed(seed * 1000 + 1 + rank)
        self.epoch = 0
        self.cursor = 0
        self.order = torch.randperm(len(self.x), generator=self.generator)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cursor + self.batch > len(self.x):
            self.epoch += 1
            self.cursor = 0
            self.order = torch.randperm(len(self.x), generator=self.generator)
        index = self.order[self.cursor : self.cursor + self.batch]
        self.cursor += self.batch
        noise = 0.3 * torch.randn(len(index), FEATURES, generator=self.generator)
        return self.x[index] + noise, self.y[index]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "order": self.order.clone(),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self.order = state["order"].clone()
        self.generator.set_state(state["generator"])


def build_model() -> nn.Module:
    """An MLP with dropout, so the RNG state matters for a bit-exact resume."""
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(HIDDEN, CLASSES),
    )


def weights_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over ``tensors`` in sorted key order: name, dtype, shape, then the raw bytes."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            digest.update(ctypes.string_at(tensor.data_ptr(), nbytes))
    return digest.hexdigest()


def _configure_torch() -> None:
    # One thread and deterministic kernels: the same seed gives the same bits in every
    # process, so an interrupted-and-resumed run can be compared with an uninterrupted one.
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # only settable before any inter-op work
        torch.set_num_interop_threads(1)


class _ShortFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage().removeprefix("safeckpt: ")


def _show_library_logs(console: Console) -> contextlib.AbstractContextManager[None]:
    """Show the manager's INFO lines (committed, pruned, cancelled) above the progress bar.

    The library never configures handlers; the demo is an application, so it does,
    and puts the logger back as it was when it ends.
    """
    logger = logging.getLogger("safeckpt")
    handler = RichHandler(console=console, show_time=False, show_path=False, markup=False)
    handler.setFormatter(_ShortFormatter())

    @contextlib.contextmanager
    def attached() -> Iterator[None]:
        level, propagate = logger.level, logger.propagate
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate

    return attached()


def _init_distributed() -> tuple[int, int]:
    """gloo process group when launched by torchrun with WORLD_SIZE > 1; else (0, 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce_gradients(model: nn.Module, world_size: int) -> None:
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad.div_(world_size)


def _die(console: Console, progress: Progress, step: int) -> None:
    progress.stop()  # give the terminal its cursor back; SIGKILL leaves no chance later
    console.print(f"[bold red]--kill-at {step}: sending SIGKILL to myself (pid {os.getpid()})[/]")
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def run(args: argparse.Namespace) -> int:
    """Train, checkpoint, maybe die; print ``resumed from step N`` and ``final weights sha256``.

    Returns the exit status: 0 when the run finished, 128 + the signal after a preemption.
    """
    _configure_torch()
    rank, world_size = _init_distributed()
    console = Console(quiet=rank != 0, highlight=False, soft_wrap=True)
    try:
        with _show_library_logs(console) if rank == 0 else contextlib.nullcontext():
            return _run(args, console, rank, world_size)
    finally:
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _run(args: argparse.Namespace, console: Console, rank: int, world_size: int) -> int:
    from .. import CheckpointManager, Retention, SaveSchedule, per_rank
    from .._manager.preemption import signal_name
    from .ls import print_listing

    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = build_model()
    optim = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.steps)
    data = SyntheticData(seed=args.seed, rank=rank, world_size=world_size)
    torch.manual_seed(args.seed * 7919 + rank)  # dropout: each rank its own stream
    # The data's position and generator are this rank's own: per_rank keeps each rank's (DCP would
    # keep one plain tensor for all ranks, as it keeps a replica).
    state: dict[str, Any] = {"model": model, "optim": optim, "sched": sched, "data": per_rank(data)}
    retention = Retention(
        keep_last=args.keep_last,
        keep_best=args.keep_best or None,
        metric=METRIC if args.keep_best else None,
    )
    root = args.dir  # a path or a URL: the manager opens the store that serves it
    console.print(
        f"safeckpt demo: {args.steps} steps, a save every {args.save_every}, "
        f"keeping the last {args.keep_last}"
        + (f" and the best {args.keep_best} by {METRIC}" if args.keep_best else "")
        + f", in {root}"
        + (f" ({world_size} ranks)" if world_size > 1 else "")
    )
    with CheckpointManager(
        root,
        async_save=True,
        retention=retention,
        schedule=SaveSchedule(every=args.save_every),
        preemption_signals=PREEMPTION_SIGNALS,
    ) as mgr:
        start = (r := mgr.restore(state)).step or 0
        if r and rank == 0:
            print(f"resumed from step {start}", flush=True)
        stopped = _train(mgr, state, start, args, console, world_size)
        preempted_by = mgr.preemption_signal
    # leaving the block waited until the last save was durable
    if preempted_by is not None:
        console.print(
            f"[bold yellow]{signal_name(preempted_by)}: saved step {stopped} and stopped; "
            "run the same command again to resume[/]"
        )
        return 128 + preempted_by
    if rank == 0:
        print_listing(console, root, retention)
        digest = weights_sha256(model.state_dict())
        if args.weights_out:
            path = _write_weights(model, args.weights_out, digest, args.steps)
            console.print(f"final weights written to {path}")
        print(f"final weights sha256: {digest}", flush=True)
    return 0


def _train(
    mgr: Any, state: dict[str, Any], start: int, args: argparse.Namespace, console: Console, world_size: int
) -> int:
    """Train from ``start``; the step it stopped at (the last, or the one a preemption saved)."""
    model, optim, sched = state["model"], state["optim"], state["sched"]
    data = state["data"].value  # inside per_rank()
    model.train()
    losses: list[float] = []
    progress = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        task = progress.add_task("training", total=args.steps, completed=start, loss="-")
        done = start
        for step in range(start, args.steps):
            x, y = data.next_batch()
            loss = nn.functional.cross_entropy(model(x), y)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            if world_size > 1:
                _all_reduce_gradients(model, world_size)
            optim.step()
            sched.step()
            losses.append(loss.item())
            done = step + 1
            progress.update(task, completed=done, loss=f"{losses[-1]:.4f}")
            # every --save-every steps, after a SIGTERM/SIGUSR1 (on any rank), and the last step, once
            if mgr.should_save(done) or done == args.steps:
                # the mean loss since the previous save: resumes start at a save, so it
                # is the same number in a resumed run as in an uninterrupted one
                mgr.save(done, state, metrics={METRIC: sum(losses) / len(losses)})
                losses.clear()
            if mgr.preempted:
                progress.stop()
                break
            if args.kill_at is not None and done == args.kill_at:
                _die(console, progress, done)
    return done


def _write_weights(model: nn.Module, out: str, digest: str, step: int) -> Path:
    from safetensors.torch import save_file

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(tmp), metadata={"sha256": digest, "step": str(step)})
    os.replace(tmp, path)
    return path
