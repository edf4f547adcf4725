"""Restore fills what the template holds once per path: one list or dict the template holds under
several keys gets, at each key, what was saved there (issue 38, item 7)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from safeckpt import CheckpointManager


class Pair:
    """A Stateful whose fresh state_dict() holds one list under two keys, as SequentialLR's does."""

    def __init__(self, x: list[float], y: list[float] | None = None) -> None:
        self.x = x
        self.y = x if y is None else y

    def state_dict(self) -> dict[str, Any]:
        return {"x": self.x, "y": self.y}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.x, self.y = state["x"], state["y"]


def test_a_list_under_two_keys_of_the_state_gets_each_key_its_own_value(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"x": [1.0], "y": [5.0]})
    shared = [0.0]
    state: dict[str, Any] = {"x": shared, "y": shared}
    with CheckpointManager(root) as mgr:
        mgr.restore(state)
    assert state == {"x": [1.0], "y": [5.0]}
    assert state["x"] is shared  # the first path still fills the caller's list in place


def test_a_stateful_whose_state_dict_holds_one_list_twice_gets_both_values(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"pair": Pair([1.0], [5.0])})
    fresh = Pair([0.0])
    assert fresh.state_dict()["x"] is fresh.state_dict()["y"]
    with CheckpointManager(root) as mgr:
        mgr.restore({"pair": fresh})
    assert (fresh.x, fresh.y) == ([1.0], [5.0])


def test_a_shared_list_saved_with_one_value_stays_one_list(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"pair": Pair([2.0])})
    fresh = Pair([0.0])
    with CheckpointManager(root) as mgr:
        mgr.restore({"pair": fresh})
    assert fresh.x == [2.0] and fresh.y is fresh.x  # nothing to tell apart: the aliasing is kept


def test_a_shared_dict_keeps_its_tensors_filled_in_place(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"a": {"w": torch.ones(3), "lr": [0.1]}, "b": {"w": torch.ones(3), "lr": [0.2]}})
    w = torch.zeros(3)
    shared = {"w": w, "lr": [0.0]}
    state: dict[str, Any] = {"a": shared, "b": shared}
    with CheckpointManager(root) as mgr:
        mgr.restore(state)
    assert state["a"]["w"] is w and state["b"]["w"] is w and torch.equal(w, torch.ones(3))
    assert state["a"]["lr"] == [0.1] and state["b"]["lr"] == [0.2]


def test_a_later_path_keeps_the_states_value_where_its_checkpoint_has_none(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"p": {"lr": [0.1], "n": 3}, "q": {"lr": [0.2]}})
    shared: dict[str, Any] = {"lr": [0.0], "n": 0}
    state: dict[str, Any] = {"p": shared, "q": shared}
    with CheckpointManager(root) as mgr:
        restored = mgr.restore(state, strict=False)
    assert restored.missing == ("q.n",)
    assert state["p"] == {"lr": [0.1], "n": 3}
    assert state["q"] == {"lr": [0.2], "n": 0}  # what the state held there, not what p loaded


def _sequential(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.SequentialLR]:
    optim = torch.optim.SGD(model.parameters(), lr=1.0)
    warmup = torch.optim.lr_scheduler.LinearLR(optim, start_factor=0.1, total_iters=2)
    decay = torch.optim.lr_scheduler.ExponentialLR(optim, gamma=0.5)
    return optim, torch.optim.lr_scheduler.SequentialLR(optim, [warmup, decay], milestones=[2])


def test_sequential_lr_gets_its_last_lr_back_without_a_step(root: Path) -> None:
    model = nn.Linear(2, 1)
    optim, sched = _sequential(model)
    for _ in range(4):  # past the milestone: its _last_lr and the warmup's differ
        optim.step()
        sched.step()
    assert sched.get_last_lr() != sched._schedulers[0].get_last_lr()
    with CheckpointManager(root) as mgr:
        mgr.save(4, {"model": model, "optim": optim, "sched": sched})
    fresh_model = nn.Linear(2, 1)
    fresh_optim, fresh_sched = _sequential(fresh_model)
    with CheckpointManager(root) as mgr:
        mgr.restore({"model": fresh_model, "optim": fresh_optim, "sched": fresh_sched})
    assert fresh_sched.get_last_lr() == sched.get_last_lr()
    assert fresh_sched._schedulers[0].get_last_lr() == sched._schedulers[0].get_last_lr()
    sched.step()
    fresh_sched.step()
    assert fresh_sched.get_last_lr() == sched.get_last_lr()
