"""Processes of the edge scenarios (used by test_edges.py): a job restarted as a user restarts it,
a writer that re-saves or prunes under a reader, a live owner. Each reports through files.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from safeckpt import CheckpointManager, Retention


def consistent_state(value: int) -> dict[str, Any]:
    """A state whose every part says which save it came from: a reader can tell a mix."""
    return {
        "model": {"w": torch.full((64 << 10,), float(value)), "b": torch.full((7,), float(value))},
        "n": value,
    }


def is_whole(state: dict[str, Any]) -> bool:
    """Whether ``state`` came from one save: its tensors and its train state agree."""
    value = float(state["n"])
    return all(bool((t == value).all()) for t in state["model"].values())


def quickstart(root: str, steps: str, out: str) -> None:
    """The quickstart loop, unchanged between restarts: resume, then save every 5 steps to ``steps``."""
    last = int(steps)
    state = consistent_state(0)
    with CheckpointManager(root, async_save=False) as mgr:
        start = mgr.restore(state).step or 0
        Path(out).write_text(str(start))
        for step in range(start + 1, last + 1):
            state.update(consistent_state(step))
            if step % 5 == 0:
                mgr.save(step, state)


def resaver(root: str, stop: str, ready: str, async_save: bool) -> None:
    """Save step 5 again and again (``overwrite=True``), each time with new values, until ``stop``."""
    with CheckpointManager(root, async_save=async_save) as mgr:
        n = 0
        while not os.path.exists(stop):
            n += 1
            mgr.save(5, consistent_state(n), overwrite=True)
            mgr.wait()
            if n == 1:
                Path(ready).write_text("ready")
        Path(ready).write_text(str(n))


def pruner(root: str, stop: str, ready: str) -> None:
    """Save step after step with keep_last=1 (each commit prunes the one before), until ``stop``."""
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=1)) as mgr:
        step = 0
        while not os.path.exists(stop):
            step += 1
            mgr.save(step, consistent_state(step))
            if step == 1:
                Path(ready).write_text("ready")
        Path(ready).write_text(str(step))


def live_owner(root: str, ready: str, stop: str) -> None:
    """Become the root's writer (save step 1 into an empty root, else pin step 1), then hold it
    (a live writer) until ``stop`` appears."""
    with CheckpointManager(root, async_save=False) as mgr:
        if mgr.latest_step is None:
            mgr.save(1, consistent_state(1))
        else:
            mgr.pin(1)
        Path(ready).write_text(str(os.getpid()))
        while not os.path.exists(stop):
            time.sleep(0.05)
