"""A tiny, fully seeded training setup shared by the manager tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class DataStream:
    """A stateful, seeded source of batches (like a resumable data loader)."""

    def __init__(self, seed: int = 0, batch: int = 8, dim: int = 16) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.batch, self.dim = batch, dim
        self.cursor = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.cursor += 1
        x = torch.randn(self.batch, self.dim, generator=self.generator)
        return x, x.sum(dim=1, keepdim=True).sin()

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.generator.get_state(), "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["rng"])
        self.cursor = state["cursor"]


def make_state(seed: int = 0, dim: int = 16) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=5, gamma=0.5)
    return {"model": model, "optim": optim, "sched": sched, "data": DataStream(seed, dim=dim), "epoch": 0}


def train_step(state: dict[str, Any]) -> float:
    model, optim = state["model"], state["optim"]
    x, y = state["data"].next()
    loss = nn.functional.mse_loss(model(x), y)
    optim.zero_grad()
    loss.backward()
    optim.step()
    state["sched"].step()
    state["epoch"] += 1
    return float(loss.detach())


def weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state["model"].state_dict().items()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
