"""A training loop that stops on a preemption signal (used by test_preemption.py).

Each rank runs :func:`main` in its own process (forkserver): it resumes from
the root, trains, writes its progress to ``<results>/progress<rank>`` after
every step (so the test knows when to signal it), saves when
``mgr.should_save`` says so or at the last step, and leaves the loop once
``mgr.preempted``. It writes what it saw to ``<results>/rank<r>.json`` and exits
with ``128 + signal`` when preempted, 0 when it finished.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from safeckpt import CheckpointManager, SaveSchedule
from safeckpt._fs.fileops import FileOps

SAVE_EVERY = 50
STEP_SECONDS = 0.01


class SlowEmergencySave(FileOps):
    """Holds the emergency save's train-state write until the test has sent a second signal."""

    def __init__(self, results: Path) -> None:
        self.results = results
        self.armed = False

    def write_file(self, path: Path, data: bytes) -> None:
        if self.armed and path.name.startswith("train_state"):
            (self.results / "saving").write_text(str(os.getpid()))
            deadline = time.monotonic() + 60
            while not (self.results / "second-sent").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # the second signal is being handled while this save is mid-write
        super().write_file(path, data)


def build(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Linear(16, 8)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1), "count": 0}


def train_step(state: dict[str, Any], rank: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(state["count"] * 7 + rank))
    loss = state["model"](x).pow(2).mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["count"] += 1


def run(
    rank: int,
    root: Path,
    results: Path,
    *,
    total: int,
    signals: list[int],
    slow_emergency: bool = False,
    app_handler: bool = False,
) -> tuple[dict[str, Any], int]:
    chained: list[int] = []
    if app_handler:
        # an application's own handler, which the manager's must chain (and put back at close)
        signal.signal(signal.SIGTERM, lambda signum, frame: chained.append(signum))
    before = signal.getsignal(signal.SIGTERM)
    ops = SlowEmergencySave(results) if slow_emergency else FileOps()
    state = build()
    out: dict[str, Any] = {"stopped": None}
    with CheckpointManager(
        root,
        schedule=SaveSchedule(every=SAVE_EVERY),
        preemption_signals=signals,
        timeout=60,
        file_ops=ops,
    ) as mgr:
        start = (r := mgr.restore(state)).step or 0
        out.update(start=start, restored=bool(r), extra=r.extra, metrics=r.metrics, count=state["count"])
        done = start
        for step in range(start, total):
            train_step(state, rank)
            time.sleep(STEP_SECONDS)
            done = step + 1
            (results / f"progress{rank}").write_text(str(done))
            if mgr.should_save(done) or done == total:
                if isinstance(ops, SlowEmergencySave):
                    ops.armed = mgr.preempted  # hold the emergency save only
                mgr.save(done, state, metrics={"loss": 1.0 / done}, extra={"tokens_seen": done * 100})
            if mgr.preempted:
                out["stopped"] = done
                break
        out["last"] = done
        preempted_by = mgr.preemption_signal
    out.update(
        preempted=preempted_by is not None,
        signal=preempted_by,
        chained=chained,
        handler_restored=signal.getsignal(signal.SIGTERM) is before,
    )
    return out, (128 + preempted_by if preempted_by is not None else 0)


def clock(rank: int, root: Path, results: Path) -> tuple[dict[str, Any], int]:
    """Rank 0 finds every save due (1 ms), rank 1 none (an hour): rank 0's clock decides for both."""
    schedule = SaveSchedule(every_seconds=0.001 if rank == 0 else 3600.0)
    with CheckpointManager(root, schedule=schedule, timeout=60) as mgr:
        time.sleep(0.05)
        answers = [mgr.should_save(step) for step in range(1, 4)]
    return {"answers": answers}, 0


def main(rank: int, ws: int, port: int, root: str, results: str, kwargs: dict[str, Any]) -> None:
    """Entry point of one spawned rank."""
    torch.set_num_threads(1)
    out_path = Path(results) / f"rank{rank}.json"
    code = 1
    try:
        if ws > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=datetime.timedelta(seconds=60))
        scenario = clock if kwargs.pop("scenario", None) == "clock" else run
        result, code = scenario(rank, Path(root), Path(results), **kwargs)
        out_path.write_text(json.dumps({"ok": True, "result": result}))
    except BaseException as e:
        out_path.write_text(json.dumps({"ok": False, "error": repr(e), "traceback": traceback.format_exc()}))
        raise
    finally:
        if ws > 1 and dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code)
