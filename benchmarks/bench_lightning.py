"""Lightning: SafeCheckpointIO against Lightning's own plugins, ManagedCheckpoint against ModelCheckpoint.

    .venv/bin/python benchmarks/bench_lightning.py                   # ~1 GiB checkpoint dict, 5 reps
    .venv/bin/python benchmarks/bench_lightning.py --size-gib 0.25 --reps 3

Sections (``--only``):

* ``io``: one checkpoint dict as Lightning builds it (``state_dict``, ``optimizer_states``
  with AdamW moments, loops, epoch, step) saved by ``SafeCheckpointIO``,
  ``AsyncCheckpointIO(TorchCheckpointIO)`` and ``TorchCheckpointIO``. Every variant
  fsyncs (Lightning's plugins do not: here they fsync the file and its directory
  after writing), so "durable" means the same thing for all. Blocking: seconds until
  ``save_checkpoint`` returns, against a memcpy of the same tensors into preallocated
  buffers (or a clone, whichever is faster: ``bench_limits.MemcpyLimit``). Durable:
  seconds until the file is on disk, against that copy plus the fastest raw write +
  fsync of the same bytes into a new file (``bench_limits.WriteLimit``). Each plugin
  saves once before timing (steady state: reused buffers).
* ``callback``: a ``Trainer.fit`` of that model (a third of ``--size-gib``: SGD keeps no
  optimizer state), ``--epochs`` epochs of one batch, a checkpoint each epoch:
  ``ManagedCheckpoint`` against ``ModelCheckpoint`` (fsynced ``TorchCheckpointIO``, and
  ``SafeCheckpointIO``). Value: milliseconds a checkpoint adds to the fit, per epoch,
  over the same fit without checkpoints (the durable wait at the end of fit included).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

from bench_common import (
    BEATEN,
    GIB,
    BenchState,
    Report,
    Table,
    build_state,
    filesystem_of,
    host_buffers,
    interleaved,
    machine,
    settle,
    timed,
)
from bench_limits import MemcpyLimit, Scratch, WriteLimit, combined
from safeckpt import Retention
from safeckpt.lightning import ManagedCheckpoint, SafeCheckpointIO

SECTIONS = ("io", "callback")
warnings.filterwarnings("ignore")


class FsyncTorchIO(TorchCheckpointIO):
    """Lightning's TorchCheckpointIO, then fsync of the file and its directory (durable, like ours)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        for target, flags in ((path, os.O_RDONLY), (os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)):
            fd = os.open(target, flags)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def lightning_dict(state: BenchState) -> dict[str, Any]:
    """A checkpoint dict shaped like ``Trainer.save_checkpoint``'s."""
    assert state.optimizer is not None
    return {
        "epoch": 3,
        "global_step": 1000,
        "pytorch-lightning_version": "2.x",
        "state_dict": state.model.state_dict(),
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 3}}}},
        "callbacks": {},
        "optimizer_states": [state.optimizer.state_dict()],
        "lr_schedulers": [],
    }


# --- io ---------------------------------------------------------------------------------


class Plugin:
    """One plugin under test: ``save()`` returns (blocking s, durable s)."""

    def __init__(
        self, name: str, io: Any, checkpoint: dict[str, Any], durable: str, scratch: Scratch
    ) -> None:
        self.name, self.io, self.checkpoint, self.durable, self.scratch = (
            name,
            io,
            checkpoint,
            durable,
            scratch,
        )

    def save(self) -> tuple[float, float]:
        path = self.scratch.fresh(f"{self.name.split()[0]}.ckpt")  # never over an existing file
        start = time.perf_counter()
        self.io.save_checkpoint(self.checkpoint, path)
        returned = time.perf_counter()
        if self.durable == "wait":
            self.io.wait()
        elif self.durable == "teardown":
            self.io.teardown()  # AsyncCheckpointIO: the only public way to wait for its write
        done = time.perf_counter() - start
        self.scratch.discard(path)
        return returned - start, done


def bench_io(args: argparse.Namespace, work: Path, state: BenchState) -> list[Table]:
    checkpoint = lightning_dict(state)
    tensors = list(state.flat().values())
    scratch = Scratch(work)
    memcpy_limit = MemcpyLimit(tensors, host_buffers(tensors))
    write_limit = WriteLimit(tensors, scratch)
    blocking = Table(
        "lightning_io_blocking",
        "Lightning CheckpointIO: blocking per save",
        "time until save_checkpoint() returns / memcpy",
        limit="the fastest host copy of every tensor (`copy_` into preallocated buffers, or `clone`)",
        bound=True,
    )
    durable = Table(
        "lightning_io_durable",
        "Lightning CheckpointIO: time until durable",
        "time from save_checkpoint() until the file is fsynced / (memcpy + raw write)",
        limit="memcpy + the fastest write of the same bytes into one new file with fsync",
        bound=True,
    )
    plugins = [
        Plugin("SafeCheckpointIO (async)", SafeCheckpointIO(), checkpoint, "wait", scratch),
        Plugin(
            "AsyncCheckpointIO(TorchCheckpointIO + fsync)",
            AsyncCheckpointIO(FsyncTorchIO()),
            checkpoint,
            "teardown",
            scratch,
        ),
        Plugin("TorchCheckpointIO + fsync", FsyncTorchIO(), checkpoint, "none", scratch),
    ]
    for table in (blocking, durable):
        table.row(plugins[0].name, role="ours")
        for plugin in plugins[1:]:
            table.row(plugin.name, role="peer")
    for plugin in plugins:  # warm-up: staging buffers allocated, executors started
        plugin.save()
    scratch.purge()
    for rep in range(args.reps):
        times: dict[str, tuple[float, float]] = {}
        copies: dict[str, float] = {}
        writes: dict[str, float] = {}
        for name in interleaved(["limit", *(p.name for p in plugins)], rep):
            settle()
            if name == "limit":
                copies = memcpy_limit.measure(rep).times
                writes = write_limit.measure(rep).times
            else:
                times[name] = next(p for p in plugins if p.name == name).save()
        blocking.add_limit(copies)
        durable.add_limit(combined(copies, writes))
        for name, (returned, done) in times.items():
            blocking.add_ratio(name, returned)
            durable.add_ratio(name, done)
        scratch.purge()  # delete this repetition's files, outside every timing
        print(f"[bench_lightning] io rep {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
    for plugin in plugins:
        if hasattr(plugin.io, "teardown"):
            plugin.io.teardown()
    blocking.notes.append(
        "SafeCheckpointIO copies into host buffers it reuses from save to save; AsyncCheckpointIO "
        "clones every tensor on each save; TorchCheckpointIO serialises on the caller's thread. "
        "The first save of each is a warm-up, not counted."
    )
    durable.notes.append(
        "Lightning's TorchCheckpointIO does not fsync; the benchmark adds a file and directory fsync "
        "so all rows mean durable."
    )
    durable.notes += write_limit.notes
    return [blocking, durable]


# --- callback -----------------------------------------------------------------------------


class BigModule(LightningModule):
    """The benchmark transformer's parameters as a LightningModule with a trivial step."""

    def __init__(self, state: BenchState) -> None:
        super().__init__()
        self.net = state.model

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return next(self.net.parameters())[:1].sum() * 0.0 + batch.sum() * 0.0

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.zeros(4, 1), batch_size=1)


def fit_seconds(args: argparse.Namespace, state: BenchState, directory: Path, variant: str) -> float:
    callbacks: list[Any] = []
    plugins: list[Any] = []
    checkpointing = variant != "none"  # ManagedCheckpoint is a Checkpoint callback, too
    if variant == "ManagedCheckpoint":
        callbacks.append(
            ManagedCheckpoint(directory, retention=Retention(keep_last=2), save_on_train_end=False)
        )
    elif variant.startswith("ModelCheckpoint"):
        callbacks.append(ModelCheckpoint(dirpath=directory, save_top_k=2, monitor="step", mode="max"))
        plugins.append(SafeCheckpointIO() if "Safe" in variant else FsyncTorchIO())
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        limit_train_batches=1,
        callbacks=callbacks,
        plugins=plugins,
        enable_checkpointing=checkpointing,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        default_root_dir=directory,
    )
    return timed(lambda: trainer.fit(BigModule(state)))


def bench_callback(args: argparse.Namespace, work: Path, state: BenchState) -> list[Table]:
    table = Table(
        "lightning_callback",
        "Lightning checkpoint callbacks: cost per checkpoint",
        f"ms a checkpoint adds to Trainer.fit per epoch ({args.epochs} epochs) over the same fit without one",
        unit="ms",
    )
    variants = [
        "ManagedCheckpoint",
        "ModelCheckpoint + SafeCheckpointIO",
        "ModelCheckpoint + TorchCheckpointIO + fsync",
    ]
    table.row(variants[0], role="ours")
    table.row(variants[1], role="ours")
    table.row(variants[2], role="peer")
    for i, variant in enumerate(["none", *variants]):  # warm-up: imports, first-touch of the code paths
        fit_seconds(args, state, work / f"warmup{i}", variant)
        shutil.rmtree(work / f"warmup{i}", ignore_errors=True)
    for rep in range(args.reps):
        settle()
        baseline = fit_seconds(args, state, work / f"base{rep}", "none")
        table.limit_seconds.append(baseline)
        for variant in interleaved(variants, rep):
            settle()
            directory = work / f"v{variants.index(variant)}-{rep}"
            seconds = fit_seconds(args, state, directory, variant)
            table.add_value(variant, (seconds - baseline) / args.epochs * 1000, seconds)
            shutil.rmtree(directory, ignore_errors=True)
        print(f"[bench_lightning] callback rep {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
    table.limit = "the same fit without checkpoints"
    return [table]


BENCHES = {"io": bench_io, "callback": bench_callback}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="size of the checkpoint (model + AdamW)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions per measurement")
    p.add_argument("--epochs", type=int, default=4, help="epochs (one checkpoint each) per fit (callback)")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: the temp directory)")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    return p.parse_args(argv)


def run(args: argparse.Namespace, command: str) -> Report:
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="safeckpt-bench-lightning-", dir=args.dir))
    try:
        state = build_state(int(args.size_gib * GIB), optimizer=True)
        tables: list[Table] = []
        for name in args.only:
            print(f"[bench_lightning] {name} ...", file=sys.stderr, flush=True)
            tables += BENCHES[name](args, work, state)
        info = machine() | {"filesystem": filesystem_of(work)}
        params = {
            "checkpoint": f"{state.nbytes / GIB:.2f} GiB fp32 (model + AdamW moments)",
            "reps": args.reps,
        }
        return Report("bench_lightning", command, info, params, tables, time.monotonic() - started)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = shlex.join([".venv/bin/python", "benchmarks/bench_lightning.py", *argv])
    report = run(args, command)
    print(report.to_markdown())
    if args.json is not None:
        report.save(args.json)
    if beaten := report.beaten():
        print(f"[bench_lightning] FAILED: {'; '.join(beaten)}: the limit is not a limit", file=sys.stderr)
        return BEATEN
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
