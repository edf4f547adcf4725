"""Ranks of the agreement scenarios in test_guards.py: one rank fails, every rank must raise.

Each scenario runs on every rank of a real gloo group and returns what this rank
saw (the error it raised, and how long that took); ``main`` writes it to
``<results>/rank<r>.json`` and exits hard, since after a disagreement nothing
should wait on the ranks' groups.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from safeckpt import CheckpointManager

TIMEOUT = 20.0  # the managers' rank timeout: a rank left waiting raises after this


def filled(step: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(step)), "step_count": step}


def describe(error: BaseException) -> dict[str, Any]:
    return {
        "type": type(error).__name__,
        "message": str(error),
        "rank": getattr(error, "rank", None),
    }


def attempt(call: Callable[[], Any]) -> dict[str, Any]:
    """What ``call`` did on this rank: its error (or None) and the seconds it took."""
    started = time.monotonic()
    try:
        call()
        error = None
    except Exception as e:
        error = describe(e)
    return {"error": error, "seconds": time.monotonic() - started}


# --- scenarios --------------------------------------------------------------------------------------


def open_fails_on_rank0(rank: int, root: Path) -> dict[str, Any]:
    """The root is a file: only rank 0 opens the root, so only rank 0 finds out."""
    root.parent.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        root.write_text("not a directory\n")
    dist.barrier()
    return {"open": attempt(lambda: CheckpointManager(root, timeout=TIMEOUT))}


def pin_fails_on_rank0(rank: int, root: Path) -> dict[str, Any]:
    """pin() of a step that is not there: only rank 0 (which changes records) finds out.
    Afterwards the ranks are still in step: a save and close() succeed on both."""
    mgr = CheckpointManager(root, async_save=False, timeout=TIMEOUT)
    out = {"pin": attempt(lambda: mgr.pin(7))}

    def save_and_close() -> None:
        mgr.save(1, filled(1))
        mgr.close()

    out["after"] = attempt(save_and_close)
    return out


def restore_mismatch_on_rank1(rank: int, root: Path) -> dict[str, Any]:
    """Only rank 1's state has a key the checkpoint lacks: rank 0 alone would go on into DCP's
    collective load. Afterwards the ranks are still in step: a restore that matches succeeds."""
    out: dict[str, Any] = {}
    mgr = CheckpointManager(root, async_save=False, timeout=TIMEOUT)
    mgr.save(1, filled(1))
    state = filled(0)
    if rank == 1:
        state["extra"] = torch.zeros(3)
    out["auto"] = attempt(lambda: mgr.restore(state))
    out["explicit"] = attempt(lambda: mgr.restore(state, step=1))
    out["untouched"] = float(state["w"][0]) == 0.0 and state["step_count"] == 0
    fresh = filled(0)
    out["after"] = attempt(lambda: mgr.restore(fresh))
    out["restored"] = [float(fresh["w"][0]), fresh["step_count"]]
    out["close"] = attempt(mgr.close)
    return out


SCENARIOS: dict[str, Callable[[int, Path], dict[str, Any]]] = {
    f.__name__: f for f in (open_fails_on_rank0, pin_fails_on_rank0, restore_mismatch_on_rank1)
}


def main(scenario: str, rank: int, ws: int, port: int, root: str, results: str) -> None:
    """Entry point of one spawned rank."""
    torch.set_num_threads(1)
    out_path = Path(results) / f"rank{rank}.json"
    code = 0
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=datetime.timedelta(seconds=30))
        result = SCENARIOS[scenario](rank, Path(root))
        out_path.write_text(json.dumps({"ok": True, "result": result}))
    except BaseException as e:
        report = {"ok": False, "error": describe(e), "traceback": traceback.format_exc()}
        out_path.write_text(json.dumps(report))
        code = 1
    os._exit(code)
