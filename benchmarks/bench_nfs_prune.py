"""Pruning on (emulated) NFS: the review's "save every step, keep_last=1" run (not a test).

    .venv/bin/python benchmarks/bench_nfs_prune.py                   # sync and async, 4 seeds
    .venv/bin/python benchmarks/bench_nfs_prune.py --seeds 0 --modes async --json out.json

Each run mounts the NFS-semantics FUSE filesystem (``safeckpt.testing``) with a
field-like linger: a ``.nfs`` file goes within 0.38 s of its last close, and 1 in
300 stays 4.0 s (the Isilon server of the review: 316 of 317 within 0.38 s). It
saves a small model every step for 40 steps with ``Retention(keep_last=1)`` while
a reader process keeps the newest checkpoint's files open for a moment after each
save, so removals meet ``.nfs`` files. It reports, from the ``FileOps`` seam
(``CountingFileOps``) and the filesystem's own counters:

* removals that needed retries (trash entries ``rmtree`` tried more than once);
* the largest retry sleep of one cleanup pass during training (cap: 0.75 s);
* directories left at ``close()`` (must be 0) and prune warnings;
* time the training thread spent in cleanup (removing, waiting, renaming into
  the trash) against the time it spent in ``save()``.

The last seed of the default set is the first whose linger stream draws a 4 s
``.nfs`` file among its first 20 files, so the slow case is in the table.
Needs FUSE (Debian's fuse3) and mfusepy, as the FUSE tests do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from safeckpt import CheckpointManager, Retention
from safeckpt.testing import CountingFileOps, FileHolder, Linger, fuse_unavailable_reason, mount_nfs

FAST_MAX, SLOW, SLOW_PROB = 0.38, 4.0, 1 / 300


@dataclass
class Row:
    mode: str
    seed: int
    nfs_files: int
    slow_lingers: int
    removals: int
    retried: int
    max_pass_sleep: float
    refused_passes: int
    warnings: int
    left_at_close: int
    training_cleanup_ms: float
    training_save_ms: float
    close_s: float


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def slow_seed(limit: int = 20) -> int:
    """The first seed whose linger stream draws a 4 s file among its first ``limit``."""
    seed = 0
    while SLOW not in Linger(seed=seed, fast_max=FAST_MAX, slow_prob=SLOW_PROB, slow=SLOW).sample(limit):
        seed += 1
    return seed


def state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-3), "step": 0}


def files_of(directory: Path) -> list[Path]:
    try:
        return [p for p in directory.rglob("*") if p.is_file()]
    except FileNotFoundError:
        return []


def one_run(base: Path, *, async_save: bool, seed: int, steps: int, hold: float) -> Row:
    linger = Linger(seed=seed, fast_max=FAST_MAX, slow_prob=SLOW_PROB, slow=SLOW)
    warnings = _Warnings()
    logging.getLogger("safeckpt").addHandler(warnings)
    try:
        with mount_nfs(base / "backing", base / "mnt", linger=linger) as nfs, FileHolder() as reader:
            root = nfs.path / "ckpt"
            ops = CountingFileOps()
            mgr = CheckpointManager(
                root, async_save=async_save, retention=Retention(keep_last=1), file_ops=ops
            )
            ops.watch(mgr)
            st, in_save = state(), 0.0
            for step in range(1, steps + 1):
                st["step"] = step
                started = time.monotonic()
                mgr.save(step, st)
                in_save += time.monotonic() - started
                latest = mgr.latest_step
                if latest is not None:
                    with contextlib.suppress(OSError):  # pruned between listing and opening
                        reader.hold(files_of(root / f"step_{latest}"), seconds=hold)
            started = time.monotonic()
            ops.close(mgr)
            close_s = time.monotonic() - started
            left = [
                p.name for p in root.iterdir() if p.name.startswith("step_") and p.name != f"step_{steps}"
            ]
            left += os.listdir(root / ".trash") + os.listdir(root / ".staging")
            stats = nfs.stats()
            del mgr
    finally:
        logging.getLogger("safeckpt").removeHandler(warnings)
    trash_attempts = {p: n for p, n in ops.attempts.items() if "/.trash/" in p}
    return Row(
        mode="async" if async_save else "sync",
        seed=seed,
        nfs_files=stats["silly_renames"],
        slow_lingers=sum(1 for d in stats["lingers"] if d == SLOW),
        removals=len(trash_attempts),
        retried=sum(1 for n in trash_attempts.values() if n > 1),
        max_pass_sleep=max((sum(p.sleeps) for p in ops.training_passes()), default=0.0),
        refused_passes=sum(1 for p in ops.training_passes() if p.refused),
        warnings=len(warnings.messages),
        left_at_close=len(left),
        training_cleanup_ms=ops.training_seconds * 1e3,
        training_save_ms=in_save * 1e3,
        close_s=close_s,
    )


def table(rows: list[Row]) -> str:
    head = (
        "| mode | seed | .nfs files | 4 s lingers | removals | needed retries | max retry sleep / pass (s) "
        "| refused passes | prune warnings | dirs left at close | training thread in cleanup (ms) "
        "| training thread in save() (ms) | close() (s) |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        lines.append(
            f"| {r.mode} | {r.seed} | {r.nfs_files} | {r.slow_lingers} | {r.removals} | {r.retried} "
            f"| {r.max_pass_sleep:.2f} | {r.refused_passes} | {r.warnings} | {r.left_at_close} "
            f"| {r.training_cleanup_ms:.1f} | {r.training_save_ms:.0f} | {r.close_s:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 2 and a slow seed")
    parser.add_argument("--modes", nargs="+", choices=["sync", "async"], default=["sync", "async"])
    parser.add_argument(
        "--hold", type=float, default=0.1, help="seconds the reader keeps each checkpoint open"
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    reason = fuse_unavailable_reason()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 77  # cannot run here: run_all.py reports the section as skipped
    seeds = args.seeds if args.seeds is not None else [0, 1, 2, slow_seed()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="safeckpt-bench-nfs-") as tmp:
        for i, (mode, seed) in enumerate((m, s) for s in seeds for m in args.modes):
            rows.append(
                one_run(
                    Path(tmp, f"run{i}"),
                    async_save=mode == "async",
                    seed=seed,
                    steps=args.steps,
                    hold=args.hold,
                )
            )
            print(f"  {mode} seed {seed}: done", file=sys.stderr)
    print(f"`{shlex.join(['.venv/bin/python', 'benchmarks/bench_nfs_prune.py', *sys.argv[1:]])}`\n")
    print(
        f"{args.steps} saves, keep_last=1, a reader holding the newest checkpoint {args.hold} s after each "
        f"save; linger: uniform 0 to {FAST_MAX} s, 1 in {round(1 / SLOW_PROB)} for {SLOW} s.\n"
    )
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 0 if all(r.left_at_close == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
