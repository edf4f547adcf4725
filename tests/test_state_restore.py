"""Restoring state in every shape: in place, bit-exact resumes, strictness, parts of a checkpoint,
and loading without a template."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import safeckpt
from safeckpt import CheckpointManager
from safeckpt.errors import CheckpointNotFoundError, UnsupportedStateError
from test_state import SYNC_ASYNC, same


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(5, 6, generator=gen)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def trained(steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, steps, seed=1)
    return model, optim


# --- bit-exact resumes ---------------------------------------------------------------------------


@SYNC_ASYNC
def test_bit_exact_resume_through_plain_state_dicts(root: Path, async_save: bool) -> None:
    model, optim = trained()
    with CheckpointManager(root, async_save=async_save) as mgr:
        mgr.save(3, {"model": model.state_dict(), "optim": optim.state_dict(), "epoch": 1})
    expected = train(model, optim, 3, seed=2)

    fresh = make_model(seed=9)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = {"model": fresh.state_dict(), "optim": fresh_optim.state_dict(), "epoch": 0}
    with CheckpointManager(root) as mgr:
        restored = mgr.restore(state)  # strict: the fresh optimizer's empty "state" is a placeholder
    assert restored.step == 3 and state["epoch"] == 1
    fresh.load_state_dict(state["model"])
    fresh_optim.load_state_dict(state["optim"])
    assert train(fresh, fresh_optim, 3, seed=2) == expected
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh), weights(model), strict=True))


def test_bit_exact_resume_through_safeckpt_load_and_load_state_dict(root: Path) -> None:
    model, optim = trained()
    with CheckpointManager(root) as mgr:
        mgr.save(3, {"model": model.state_dict(), "optim": optim.state_dict()})
    expected = train(model, optim, 3, seed=2)
    loaded = safeckpt.load(root)
    assert set(loaded["optim"]["state"]) == {0, 1, 2, 3}  # int keys, as torch wrote them
    fresh = make_model(seed=9)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh.load_state_dict(loaded["model"])
    fresh_optim.load_state_dict(loaded["optim"])
    assert train(fresh, fresh_optim, 3, seed=2) == expected


class OptimizerState:
    """A torchtitan-style Stateful wrapper."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        self.optim = optim

    def state_dict(self) -> dict[str, Any]:
        return {"optim": self.optim.state_dict(), "note": "wrapped"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optim.load_state_dict(state["optim"])
        self.loaded = state


@SYNC_ASYNC
def test_bit_exact_resume_through_a_stateful_around_a_fresh_optimizer(root: Path, async_save: bool) -> None:
    model, optim = trained()
    with CheckpointManager(root, async_save=async_save) as mgr:
        mgr.save(3, {"model": model, "train": OptimizerState(optim)})
        captured = mgr._state_cache  # the moments went to DCP, not to the JSON part
    del captured
    expected = train(model, optim, 3, seed=2)
    fresh = make_model(seed=9)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    wrapper = OptimizerState(fresh_optim)  # state_dict() has no moments yet
    with CheckpointManager(root) as mgr:
        mgr.restore({"model": fresh, "train": wrapper})
    assert wrapper.loaded["note"] == "wrapped"
    assert train(fresh, fresh_optim, 3, seed=2) == expected


def test_module_and_optimizer_objects_resume_bit_exact(root: Path) -> None:
    model, optim = trained()
    with CheckpointManager(root) as mgr:
        mgr.save(3, {"model": model, "optim": optim})
    expected = train(model, optim, 2, seed=2)
    fresh = make_model(seed=9)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with CheckpointManager(root) as mgr:
        mgr.restore({"model": fresh, "optim": fresh_optim})
    assert train(fresh, fresh_optim, 2, seed=2) == expected


# --- in place, strict, all or nothing --------------------------------------------------------------


def test_tensors_are_filled_in_place_and_values_replaced(root: Path) -> None:
    saved = {"ema": {"model.w": torch.arange(4.0)}, "cfg": {"lr": 0.5, "sizes": (1, 2)}, 3: [torch.ones(2)]}
    with CheckpointManager(root) as mgr:
        mgr.save(1, saved)
    ema, listed = torch.zeros(4), torch.zeros(2)
    state: dict[Any, Any] = {"ema": {"model.w": ema}, "cfg": {"lr": 0.1, "sizes": (0,)}, 3: [listed]}
    with CheckpointManager(root) as mgr:
        mgr.restore(state)
    assert state["ema"]["model.w"] is ema and torch.equal(ema, torch.arange(4.0))  # the '.' key loads
    assert state[3][0] is listed and torch.equal(listed, torch.ones(2))
    assert state["cfg"] == {"lr": 0.5, "sizes": (1, 2)}


def test_strict_restore_names_every_missing_and_unexpected_path(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": {"layers": [{"w": torch.ones(2)}, {"w": torch.ones(2), "b": torch.ones(1)}]}})
    state = {"model": {"layers": [{"w": torch.zeros(2)}, {"w": torch.zeros(2)}, {"w": torch.zeros(2)}]}}
    with CheckpointManager(root) as mgr, pytest.raises(UnsupportedStateError) as info:
        mgr.restore(state)
    message = str(info.value)
    assert "'model.layers.2'" in message and "'model.layers.1.b'" in message
    assert "strict=False" in message
    assert all(torch.equal(layer["w"], torch.zeros(2)) for layer in state["model"]["layers"])  # untouched


def test_non_strict_restore_reports_and_warns(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model.ema": torch.ones(2), "gone": torch.ones(1)})
    state = {"model.ema": torch.zeros(2), "new": torch.zeros(1)}
    with caplog.at_level(logging.WARNING, logger="safeckpt"), CheckpointManager(root) as mgr:
        restored = mgr.restore(state, strict=False)
    assert restored.missing == ("new",) and restored.unexpected == ("gone",)
    assert torch.equal(state["model.ema"], torch.ones(2))  # loaded, never silently skipped
    assert "strict=False" in caplog.text and "'gone'" in caplog.text


def test_a_shape_mismatch_changes_nothing_and_names_the_path(root: Path) -> None:
    model = make_model()
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model, "ema": torch.ones(3), "epoch": 4})
    other = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))  # a different head
    before = weights(other)
    state: dict[str, Any] = {"model": other, "ema": torch.zeros(3), "epoch": 0}
    for strict in (True, False):
        with CheckpointManager(root) as mgr, pytest.raises(UnsupportedStateError) as info:
            mgr.restore(state, strict=strict)
        assert "model.2.weight is float32 [3, 8] in the checkpoint but float32 [5, 8]" in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(weights(other), before, strict=True))
    assert torch.equal(state["ema"], torch.zeros(3)) and state["epoch"] == 0


def test_include_and_exclude_load_part_of_a_checkpoint(root: Path) -> None:
    model, optim = trained()
    with CheckpointManager(root) as mgr:
        mgr.save(
            3, {"model": model, "optim": optim, "epoch": 2, "ema": {"a": torch.ones(1), "b": torch.ones(1)}}
        )
    fine_tune = make_model(seed=9)
    with CheckpointManager(root) as mgr:
        mgr.restore({"model": fine_tune}, include=["model"])  # strict, but only within "model"
    assert all(torch.equal(a, b) for a, b in zip(weights(fine_tune), weights(model), strict=True))
    state: dict[str, Any] = {"epoch": 0, "ema": {"a": torch.zeros(1), "b": torch.zeros(1)}}
    with CheckpointManager(root) as mgr:
        mgr.restore(state, include=["ema", "epoch"], exclude=["ema.b"])
    assert state["epoch"] == 2 and torch.equal(state["ema"]["a"], torch.ones(1))
    assert torch.equal(state["ema"]["b"], torch.zeros(1))


def test_a_stateful_gets_the_saved_subtree_it_lacks(root: Path) -> None:
    class Loader:
        def __init__(self) -> None:
            self.state: dict[str, Any] = {}

        def state_dict(self) -> dict[str, Any]:
            return dict(self.state)

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.state = state

    saved = Loader()
    saved.state = {"pos": 7, "buffer": torch.arange(3), "order": [2, 0, 1]}
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"loader": saved})
    fresh = Loader()
    with CheckpointManager(root) as mgr:
        mgr.restore({"loader": fresh})
    assert same(fresh.state, {"pos": 7, "buffer": torch.arange(3), "order": [2, 0, 1]})


def test_a_load_state_dict_that_raises_is_named_and_said_to_leave_the_state_partly_loaded(root: Path) -> None:
    class Scheduler:
        def __init__(self, refuse: bool) -> None:
            self.refuse = refuse
            self.last_epoch = 0

        def state_dict(self) -> dict[str, Any]:
            return {"last_epoch": self.last_epoch}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            if self.refuse:
                raise ValueError("this scheduler was built for another optimizer")
            self.last_epoch = state["last_epoch"]

    saved = Scheduler(refuse=False)
    saved.last_epoch = 5
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"weights": torch.ones(3), "sched": saved})
        mgr.save(2, {"weights": torch.full((3,), 2.0), "sched": saved})
    weights = torch.zeros(3)
    with CheckpointManager(root) as mgr, pytest.raises(UnsupportedStateError) as info:
        mgr.restore({"weights": weights, "sched": Scheduler(refuse=True)})
    message = str(info.value)
    assert "step 2" in message and "loading sched raised ValueError: this scheduler" in message
    assert "the state now holds part of this checkpoint" in message and "build it anew" in message
    assert isinstance(info.value.__cause__, ValueError) and info.value.step == 2
    assert torch.equal(weights, torch.full((3,), 2.0))  # what the message says: filled, no fallback to step 1
    with CheckpointManager(root) as mgr:  # nothing saved was touched: the same step restores
        fine = Scheduler(refuse=False)
        assert mgr.restore({"weights": torch.zeros(3), "sched": fine}).step == 2
    assert fine.last_epoch == 5


# --- without a template ------------------------------------------------------------------------------


def test_load_without_a_template_on_a_root_a_step_and_a_step_dir(root: Path) -> None:
    with CheckpointManager(root, save_rng=False) as mgr:
        mgr.save(1, {"m": {0: (torch.ones(2, dtype=torch.bfloat16), "a")}})
        mgr.save(2, {"m": {0: (torch.zeros(2, dtype=torch.bfloat16), "b")}})
        mgr.wait()
        assert same(mgr.load(), {"m": {0: (torch.zeros(2, dtype=torch.bfloat16), "b")}})
        assert same(mgr.load(1), {"m": {0: (torch.ones(2, dtype=torch.bfloat16), "a")}})
    assert safeckpt.load(root)["m"][0][1] == "b"  # what auto-resume takes
    assert safeckpt.load(root, step=1)["m"][0][1] == "a"
    assert safeckpt.load(root / "step_1")["m"][0][1] == "a"
    with pytest.raises(CheckpointNotFoundError):
        safeckpt.load(root.parent / "nothing-here")


def test_load_gives_modules_as_state_dicts_and_optimizers_by_parameter_name(root: Path) -> None:
    model, optim = trained()
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model, "optim": optim})
    loaded = safeckpt.load(root)
    assert same(loaded["model"], {k: v.detach() for k, v in model.state_dict().items()})
    assert set(loaded["optim"]["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert loaded["optim"]["param_groups"][0]["lr"] == 1e-2


def test_a_tensor_where_the_state_has_a_dict_is_refused_not_overwritten(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"a": torch.ones(1), "b": {"c": torch.ones(1)}, "n": None})
    state: dict[str, Any] = {"a": {"x": torch.zeros(1)}, "b": torch.zeros(1), "n": None}
    with CheckpointManager(root) as mgr, pytest.raises(UnsupportedStateError) as info:
        mgr.restore(state, strict=False)
    assert "a is a tensor in the checkpoint but a dict in the state" in str(info.value)
    assert "b is a dict in the checkpoint but a tensor in the state" in str(info.value)
    placeholder: dict[str, Any] = {"a": None, "b": None, "n": None}  # None takes whatever was saved
    with CheckpointManager(root) as mgr:
        mgr.restore(placeholder)
    assert same(placeholder, {"a": torch.ones(1), "b": {"c": torch.ones(1)}, "n": None})
