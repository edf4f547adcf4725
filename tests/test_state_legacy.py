"""A checkpoint written by safeckpt 0.1 (train-state format 1) still restores after the upgrade.

The fixture under ``tests/data/safeckpt-0.1`` was written by the 0.1 manager
from :func:`build` (``async_save=False, save_rng=False``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import safeckpt
from safeckpt import CheckpointManager
from safeckpt.errors import IncompleteCheckpointError

FIXTURE = Path(__file__).parent / "data" / "safeckpt-0.1"


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def build(seed: int = 0, trained: bool = True) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counter = Counter()
    if trained:
        model(torch.ones(4, 3)).sum().backward()
        optim.step()
        counter.n = 7
    return {"model": model, "optim": optim, "ema": torch.arange(3.0), "counter": counter, "epoch": 4}


def test_a_safeckpt_0_1_checkpoint_restores_bit_exact(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, root, symlinks=True)
    expected = build()
    state = build(seed=5, trained=False)
    state["ema"] = torch.zeros(3)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state).step == 3
    assert state["epoch"] == 4 and state["counter"].n == 7 and torch.equal(state["ema"], torch.arange(3.0))
    for a, b in zip(state["model"].parameters(), expected["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    moments = [s["exp_avg"] for s in state["optim"].state.values()]
    assert all(
        torch.equal(a, s["exp_avg"]) for a, s in zip(moments, expected["optim"].state.values(), strict=True)
    )
    with pytest.raises(IncompleteCheckpointError, match=r"written by safeckpt 0\.1"):
        safeckpt.load(root)
    only = {"ema": torch.zeros(3), "epoch": 0}
    with CheckpointManager(root) as mgr:
        mgr.restore(only, include=["ema"])
    assert torch.equal(only["ema"], torch.arange(3.0)) and only["epoch"] == 0
