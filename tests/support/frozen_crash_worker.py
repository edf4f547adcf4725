"""A training process with a frozen part that SIGKILLs itself at a chosen filesystem operation
(used by test_frozen_sharing.py).

The state is a module with a frozen parameter (the bytes saves share) and a
trained one, and its optimizer. Each step fills the trained parameter with the
step; the frozen one holds ``frozen_value(step)``, which changes once (through
``.data``) so that a kill can also land in the save that must write it again.
``keep_last=1``: every commit prunes the checkpoint whose file it shares.
"""

from __future__ import annotations

import os
import signal
import threading

import torch
from torch import nn

from crash_worker import KillAtOps
from safeckpt import CheckpointManager, Retention

CHANGE_AT = 3  # the step from which the frozen parameter holds other bytes


def frozen_value(step: int) -> float:
    return 40.0 if step >= CHANGE_AT else 3.0


class Model(nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.zeros(numel), requires_grad=False)
        self.head = nn.Parameter(torch.zeros(7))


def make_state(numel: int) -> tuple[Model, dict[str, object]]:
    model = Model(numel)
    optim = torch.optim.SGD([model.head], lr=0.1)
    return model, {"model": model, "optim": optim}


def train(
    root: str,
    log: str,
    *,
    steps: int,
    numel: int,
    kill_at: int | None = None,
    kill_after: float | None = None,
    async_save: bool = False,
) -> list[str]:
    """Save steps 1..steps (resuming where the root is); returns the kinds of the operations."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    ops = KillAtOps(kill_at, log_fd=fd)
    if kill_after is not None:
        timer = threading.Timer(kill_after, os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()
    model, state = make_state(numel)
    with CheckpointManager(
        root, async_save=async_save, retention=Retention(keep_last=1), file_ops=ops, drain_timeout=5
    ) as mgr:
        start = mgr.restore(state).step or 0
        for step in range(start + 1, steps + 1):
            with torch.no_grad():
                model.head.fill_(float(step))
            model.base.data.fill_(frozen_value(step))  # the same bytes again, until CHANGE_AT
            mgr.save(step, state)
            mgr.wait()
            os.write(fd, f"committed {step}\n".encode())
    os.write(fd, f"committed {mgr.latest_step or 0}\n".encode())
    os.close(fd)
    return ops.names
