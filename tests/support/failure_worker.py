"""Processes of the failure-path scenarios (used by test_failure_paths.py).

Two kinds:

* single processes that share a root with the test process (a writer job, an
  owner that hangs mid-save until it is SIGKILLed); they report through an
  append-only log written unbuffered, so the test knows what they did;
* ranks of a real gloo group, each writing what it saw (its result, or the
  error it raised) to ``<results>/rank<r>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from safeckpt import CheckpointManager, Retention
from safeckpt._fs.fileops import FileOps


class SlowTrainStateOps(FileOps):
    """Every train-state write waits ``delay`` s first: each save sits in ``.staging`` a while."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def write_file(self, path: Path, data: bytes) -> None:
        if path.name.startswith("train_state"):
            time.sleep(self.delay)
        super().write_file(path, data)


class HangAtStepOps(FileOps):
    """The train-state write of ``step`` announces itself in ``reached`` and never returns."""

    def __init__(self, step: int, reached: Path) -> None:
        self.step, self.reached = step, reached

    def write_file(self, path: Path, data: bytes) -> None:
        if path.name.startswith("train_state") and path.parent.name.startswith(f"step_{self.step}."):
            self.reached.write_text(str(path.parent))
            threading.Event().wait()  # until SIGKILL
        super().write_file(path, data)


def _log(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


def filled(step: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(step)), "step_count": step}


# --- single processes sharing a root with the test ------------------------------------------


def writer_job(root: str, log: str, steps: int, delay: float, retention: int | None = None) -> None:
    """Save steps 1..steps asynchronously (each slow to write), waiting for each; log every outcome.

    Lines: ``started``, then ``committed <N>`` or ``failed <N> <error>`` per step, then ``closed``.
    """
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    keep = Retention(keep_last=retention) if retention else None
    try:
        with CheckpointManager(root, retention=keep, file_ops=SlowTrainStateOps(delay)) as mgr:
            _log(fd, "started")
            for step in range(1, steps + 1):
                mgr.save(step, filled(step))
                try:
                    mgr.wait()
                    _log(fd, f"committed {step}")
                except Exception as e:
                    _log(fd, f"failed {step} {type(e).__name__}: {e}")
        _log(fd, "closed")
    except BaseException as e:
        _log(fd, f"crashed {type(e).__name__}: {e}")
        raise
    finally:
        os.close(fd)


def owner_that_hangs(root: str, reached: str) -> None:
    """Commit step 1, then hang inside the write of step 2 (with its staging directory on disk)."""
    mgr = CheckpointManager(root, async_save=False, file_ops=HangAtStepOps(2, Path(reached)))
    mgr.save(1, filled(1))
    mgr.save(2, filled(2))  # never returns


# --- ranks of a gloo group ---------------------------------------------------------------------


def mismatched_calls(rank: int, ws: int, root: Path, results: Path) -> dict[str, Any]:
    """Rank 0 calls save(3) while rank 1 calls close()."""
    mgr = CheckpointManager(root, timeout=60)
    started = time.monotonic()
    try:
        if rank == 0:
            mgr.save(3, filled(3))
        else:
            mgr.close()
        return {"error": None, "seconds": time.monotonic() - started}
    except Exception as e:
        return {"error": describe(e), "seconds": time.monotonic() - started}


def save_two_steps(rank: int, ws: int, root: Path, results: Path) -> dict[str, Any]:
    with CheckpointManager(root, async_save=False, timeout=60) as mgr:
        for step in (1, 2):
            state = filled(step)
            state["step_count"] = step * 10 + rank
            mgr.save(step, state)
        return {"latest": mgr.latest_step}


def restore_past_damage(rank: int, ws: int, root: Path, results: Path) -> dict[str, Any]:
    """An explicit restore of step 2 (whose rank-1 file the test damaged), then auto-resume."""
    out: dict[str, Any] = {}
    with CheckpointManager(root, timeout=60) as mgr:
        started = time.monotonic()
        try:
            mgr.restore(filled(0), step=2)
            out["explicit"] = {"error": None}
        except Exception as e:
            out["explicit"] = {"error": describe(e), "seconds": time.monotonic() - started}
        state = filled(0)
        started = time.monotonic()
        restored = mgr.restore(state)
        out["auto"] = {
            "step": restored.step,
            "seconds": time.monotonic() - started,
            "w": float(state["w"][0]),
            "step_count": state["step_count"],
        }
        out["latest"] = mgr.latest_step
    return out


def shared_view(rank: int, ws: int, root: Path, results: Path) -> dict[str, Any]:
    """Saves (async, keep_last=2, one pinned), then the queries on every rank."""

    def view(mgr: CheckpointManager) -> dict[str, Any]:
        return {
            "latest": mgr.latest_step,
            "checkpoints": [
                [s.step, s.status, s.pinned, list(s.kept_because), s.path is not None]
                for s in mgr.checkpoints()
            ],
        }

    out: dict[str, Any] = {}
    with CheckpointManager(root, retention=Retention(keep_last=2), timeout=60) as mgr:
        for step in range(1, 5):
            mgr.save(step, filled(step))
            mgr.wait()
            if step == 1:
                mgr.pin(1)
        out["after_saves"] = view(mgr)
        mgr.unpin(1)
        out["after_unpin"] = view(mgr)
    with CheckpointManager(root, timeout=60) as mgr:  # a fresh manager: rank 0 scans, every rank knows
        out["reopened"] = view(mgr)
    return out


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    f.__name__: f for f in (mismatched_calls, save_two_steps, restore_past_damage, shared_view)
}


def describe(error: BaseException) -> dict[str, Any]:
    return {
        "type": type(error).__name__,
        "message": str(error),
        "rank": getattr(error, "rank", None),
        "failures": {str(k): v for k, v in getattr(error, "failures", {}).items()},
    }


def main(scenario: str, rank: int, ws: int, port: int, root: str, results: str) -> None:
    """Entry point of one spawned rank. Exits hard once its report is written: after a
    mismatch the ranks' managers are in different states, and nothing should wait on them."""
    torch.set_num_threads(1)
    out_path = Path(results) / f"rank{rank}.json"
    code = 0
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=datetime.timedelta(seconds=60))
        result = SCENARIOS[scenario](rank, ws, Path(root), Path(results))
        out_path.write_text(json.dumps({"ok": True, "result": result}))
    except BaseException as e:
        report = {"ok": False, "error": describe(e), "traceback": traceback.format_exc()}
        out_path.write_text(json.dumps(report))
        code = 1
    os._exit(code)
