"""overlap_staging=True: save() returns before the copy, training goes on at once, and the
checkpoint still holds the state at save(), bit for bit.

The background copy is held back (``held``) until the training steps after the save are done,
so the hooks alone keep each checkpoint exact: without them these tests fail (the version
check refuses the save, see ``test_without_the_hooks_the_same_steps_fail_the_save``).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from safeckpt import CheckpointManager
from safeckpt._manager import overlap
from safeckpt.errors import ConfigError, SaveFailedError


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The background copy starts only once the test sets the event."""
    go = threading.Event()
    real = overlap.OverlappedCopy._run

    def run_later(self: overlap.OverlappedCopy) -> None:
        go.wait(30)
        real(self)

    monkeypatch.setattr(overlap.OverlappedCopy, "_run", run_later)
    yield go
    go.set()


def _mlp(bn: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 32)]
    if bn:
        layers.append(nn.BatchNorm1d(32))
    layers += [nn.ReLU(), nn.Linear(32, 4)]
    return nn.Sequential(*layers)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.embed.weight  # one parameter, two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(x))


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(
        {
            k: v.state_dict() if isinstance(v, (nn.Module, torch.optim.Optimizer)) else v
            for k, v in state.items()
        }
    )


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _save_then_train(
    root: Path,
    state: dict[str, Any],
    train: Callable[[], None],
    held: threading.Event,
    fresh: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Save with overlap, train at once (the background copy held), then return the snapshot the
    checkpoint must equal and what a restore into fresh copies reads back."""
    expected = _snapshot(state)
    with CheckpointManager(root, overlap_staging=True) as mgr:
        mgr.save(1, state)
        train()
        held.set()
        mgr.wait()
    fresh = copy.deepcopy(state) if fresh is None else fresh
    with CheckpointManager(root) as mgr:
        assert mgr.restore(fresh).step == 1
    _assert_same(_snapshot(fresh), expected)
    return fresh


def _steps(
    model: nn.Module, optims: list[torch.optim.Optimizer], *, backwards: int = 1, x: Any = None
) -> Callable[[], None]:
    def train() -> None:
        for _ in range(2):
            for _ in range(backwards):
                inp = torch.randn(8, 16) if x is None else x
                model(inp).float().pow(2).mean().backward()
            for o in optims:
                o.step()
                o.zero_grad()

    return train


def _warm(train: Callable[[], None]) -> None:
    train()  # optimizer state exists (exp_avg, momentum_buffer) before the save


@pytest.mark.parametrize(
    "make_optim",
    [
        pytest.param(lambda p: torch.optim.Adam(p, lr=0.1), id="adam"),
        pytest.param(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), id="sgd-momentum"),
    ],
)
def test_the_checkpoint_is_the_state_at_save_though_the_next_steps_ran_before_the_copy(
    tmp_path: Path, held: threading.Event, make_optim: Callable[[Any], torch.optim.Optimizer]
) -> None:
    model = _mlp()
    optim = make_optim(model.parameters())
    train = _steps(model, [optim])
    _warm(train)
    _save_then_train(tmp_path / "r", {"model": model, "optim": optim}, train, held)


def test_batchnorm_buffers_are_copied_before_the_forward_that_changes_them(
    tmp_path: Path, held: threading.Event
) -> None:
    model = _mlp(bn=True)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    train = _steps(model, [optim])
    _warm(train)
    _save_then_train(tmp_path / "r", {"model": model, "optim": optim}, train, held)


def test_tied_weights(tmp_path: Path, held: threading.Event) -> None:
    model = Tied()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    train = _steps(model, [optim], x=torch.randint(0, 10, (8,)))
    _warm(train)
    _save_then_train(tmp_path / "r", {"model": model, "optim": optim}, train, held)


def test_gradient_accumulation(tmp_path: Path, held: threading.Event) -> None:
    model = _mlp(bn=True)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train = _steps(model, [optim], backwards=3)
    _warm(train)
    _save_then_train(tmp_path / "r", {"model": model, "optim": optim}, train, held)


def test_two_optimizers(tmp_path: Path, held: threading.Event) -> None:
    model = _mlp()
    first = torch.optim.Adam(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    train = _steps(model, [first, second])
    _warm(train)
    _save_then_train(tmp_path / "r", {"model": model, "a": first, "b": second}, train, held)


@pytest.mark.parametrize(
    "make_fused",
    [
        pytest.param(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True), id="sgd-fused"),
        pytest.param(lambda p: torch.optim.Adam(p, lr=0.1, fused=True), id="adam-fused"),
    ],
)
def test_an_optimizer_outside_the_state_waits_for_the_copy_of_what_it_steps(
    tmp_path: Path, held: threading.Event, make_fused: Callable[[Any], torch.optim.Optimizer]
) -> None:
    # A fused optimizer moves no version counter: the check cannot see it step a guarded parameter
    # before its copy, so the process-wide step pre-hook must copy that parameter first.
    model = _mlp()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)  # in the state: it guards the parameters
    fused = make_fused(model.parameters())  # not in the state: nothing of it is hooked by name
    _warm(_steps(model, [optim, fused]))
    probe = model[0].weight._version
    _steps(model, [fused])()
    assert model[0].weight._version == probe  # what makes this case silent without the hook
    _save_then_train(tmp_path / "r", {"model": model, "optim": optim}, _steps(model, [fused]), held)
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    assert not _global_optimizer_pre_hooks  # gone with the manager


def _the_batchnorm_steps_fail_the_save(tmp_path: Path, held: threading.Event) -> None:
    """The BatchNorm test's save and steps, the copy held past them: the version check refuses
    the save instead of mixing two states."""
    model = _mlp(bn=True)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    train = _steps(model, [optim])
    _warm(train)
    with CheckpointManager(tmp_path / "r", overlap_staging=True) as mgr:
        mgr.save(1, {"model": model, "optim": optim})
        train()
        held.set()
        with pytest.raises(SaveFailedError, match="changed in place after save"):
            mgr.wait()
        assert mgr.latest_step is None


def test_without_the_hooks_the_same_steps_fail_the_save(
    tmp_path: Path, held: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the tests above rely on: with no hook, the step changes the parameters before the held
    # copy reads them, and the version check refuses the save instead of mixing two states.
    monkeypatch.setattr(overlap.OverlappedCopy, "guard", lambda self: None)
    _the_batchnorm_steps_fail_the_save(tmp_path, held)


@pytest.mark.parametrize("only", ["module hooks", "optimizer hooks"])
def test_each_kind_of_hook_is_needed(
    tmp_path: Path, held: threading.Event, monkeypatch: pytest.MonkeyPatch, only: str
) -> None:
    # With one kind of hook alone, the steps the BatchNorm test runs fail the save: the optimizer's
    # step pre-hook guards its parameters and moments, the modules' forward pre-hooks their buffers.
    real = overlap.OverlappedCopy.guard

    def one_kind(self: overlap.OverlappedCopy) -> None:
        groups = self._groups
        wanted = only == "optimizer hooks"
        self._groups = [g for g in groups if isinstance(g.owners[0], torch.optim.Optimizer) == wanted]
        try:
            real(self)
        finally:
            self._groups = groups

    monkeypatch.setattr(overlap.OverlappedCopy, "guard", one_kind)
    if only == "module hooks":  # and no process-wide step hook, which would guard the optimizer's too
        monkeypatch.setattr(overlap, "register_optimizer_step_pre_hook", lambda hook: _NoHandle())
    _the_batchnorm_steps_fail_the_save(tmp_path, held)


class _NoHandle:
    def remove(self) -> None:
        pass


def test_a_tensor_changed_by_hand_before_its_copy_fails_that_save_and_loses_nothing(
    tmp_path: Path, held: threading.Event
) -> None:
    model = _mlp()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    train = _steps(model, [optim])
    _warm(train)
    held.set()
    with CheckpointManager(tmp_path / "r", overlap_staging=True) as mgr:
        mgr.save(1, {"model": model, "optim": optim})
        mgr.wait()
        held.clear()
        mgr.save(2, {"model": model, "optim": optim})
        with torch.no_grad():
            model[0].weight.mul_(2.0)  # outside the optimizer: no hook can see it
        held.set()
        with pytest.raises(SaveFailedError, match=r"0\.weight.*changed in place after save"):
            mgr.wait()
        assert mgr.latest_step == 1


def test_unguarded_tensors_are_copied_before_save_returns(tmp_path: Path, held: threading.Event) -> None:
    model = _mlp()
    frozen = torch.arange(6.0)  # a plain tensor: nothing guards it
    with CheckpointManager(tmp_path / "r", overlap_staging=True) as mgr:
        mgr.save(1, {"model": model, "extra": {"t": frozen}})
        frozen.fill_(-1.0)  # at once, with the background copy held: it was copied already
        held.set()
        mgr.wait()
        assert torch.equal(mgr.load()["extra"]["t"], torch.arange(6.0))


def test_hooks_are_gone_after_close_and_the_next_save_waits_for_the_copy(
    tmp_path: Path, held: threading.Event
) -> None:
    model = _mlp(bn=True)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    _warm(_steps(model, [optim]))

    def hooks() -> int:
        return len(optim._optimizer_step_pre_hooks) + sum(len(m._forward_pre_hooks) for m in model.modules())

    mgr = CheckpointManager(tmp_path / "r", overlap_staging=True)
    mgr.save(1, {"model": model, "optim": optim})
    assert hooks() == 3  # the optimizer, the BatchNorm, and the model above it
    timer = threading.Timer(0.2, held.set)
    timer.start()
    mgr.save(2, {"model": model, "optim": optim})  # waits for save 1's copy (released by the timer)
    held.set()
    mgr.close()
    timer.join()
    assert hooks() == 0
    with CheckpointManager(tmp_path / "r") as again:
        assert again.latest_step == 2


def test_overlap_staging_needs_async_save(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs async_save=True"):
        CheckpointManager(tmp_path / "r", async_save=False, overlap_staging=True)


@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_every_rank_checkpoints_its_state_at_save_under_fsdp2_and_ddp(tmp_path: Path, kind: str) -> None:
    from test_distributed import launch, results_of

    reports = results_of(launch("overlap_exact", 2, tmp_path / "root", tmp_path / "results", kind=kind))
    for report in reports:
        assert report["changed_since"] > 0  # the steps after save() did change the state
        assert report["checked"] > 0 and report["mismatch"] == [], report


def test_a_buffer_another_forward_pre_hook_changes_is_copied_first(
    tmp_path: Path, held: threading.Event
) -> None:
    # spectral_norm's power iteration updates its buffer in a forward pre-hook registered long before.
    def build() -> dict[str, Any]:
        torch.manual_seed(0)
        model = nn.utils.spectral_norm(nn.Linear(16, 4))  # the state's module: its hook comes first
        return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}

    state = build()
    train = _steps(state["model"], [state["optim"]])
    _warm(train)
    fresh = build()
    _warm(_steps(fresh["model"], [fresh["optim"]]))  # its optimizer state exists, to be loaded into
    _save_then_train(tmp_path / "r", state, train, held, fresh=fresh)


def test_a_change_made_while_its_group_was_being_copied_fails_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The copy releases the GIL: a change by hand can land while it runs. The version counters are
    # checked again after the copy, so the torn copy is refused, never committed.
    model = _mlp()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    _warm(_steps(model, [optim]))
    real = overlap.OverlappedCopy._copy_group

    def copy_then_changed(self: overlap.OverlappedCopy, group: Any, on_training_thread: bool) -> None:
        real(self, group, on_training_thread)
        with torch.no_grad():
            model[2].bias.add_(1.0)  # as if the training thread changed it meanwhile

    monkeypatch.setattr(overlap.OverlappedCopy, "_copy_group", copy_then_changed)
    with CheckpointManager(tmp_path / "r", overlap_staging=True) as mgr:
        mgr.save(1, {"model": model, "optim": optim})
        with pytest.raises(SaveFailedError, match=r"2\.bias.*changed in place after save"):
            mgr.wait()
        assert mgr.latest_step is None
