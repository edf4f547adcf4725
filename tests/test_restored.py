"""What ``restore()`` gives back: a :class:`Restored`, falsy when nothing was restored, with the
step, path, metrics, extra and record of the checkpoint loaded (on every rank: see
test_preemption.py's two-rank resume)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from safeckpt import CheckpointManager, Restored, read_record
from toy import make_state, same_weights, train_step, weights


def test_an_empty_root_restores_nothing_and_is_falsy(root: Path) -> None:
    state = make_state()
    before = weights(state)
    with CheckpointManager(root) as mgr:
        r = mgr.restore(state)
    assert isinstance(r, Restored) and not r
    assert r.step is None and r.path is None and r.record is None
    assert r.metrics == {} and r.extra == {} and r.missing == () and r.unexpected == ()
    assert (r.step or 0) == 0
    assert same_weights(before, weights(state))


def test_a_step_0_checkpoint_is_restored_and_truthy(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(0, make_state(), extra={"note": "initial weights"})
    with CheckpointManager(root) as mgr:
        r = mgr.restore(make_state(seed=1))
    assert r and r.step == 0 and r.extra == {"note": "initial weights"}
    assert (r.step or 0) == 0


def test_metrics_extra_path_and_record_come_back(root: Path) -> None:
    state = make_state()
    extra = {"wandb_run_id": "abc123", "tokens_seen": 123_456, "nested": {"a": [1, 2.5, None]}}
    with CheckpointManager(root) as mgr:
        train_step(state)
        mgr.save(1, state, metrics={"val_loss": 0.5})
        train_step(state)
        mgr.save(2, state, metrics={"val_loss": 0.25, "acc": 0.9}, extra=extra)
    fresh = make_state(seed=3)
    with CheckpointManager(root) as mgr:
        r = mgr.restore(fresh)
        older = mgr.restore(make_state(seed=4), step=1)
    assert same_weights(weights(fresh), weights(state))
    assert r.step == 2 and r.path == root.absolute() / "step_2"
    assert r.metrics == {"val_loss": 0.25, "acc": 0.9}
    assert r.extra == extra
    assert r.record == read_record(root / "step_2")
    assert older.step == 1 and older.metrics == {"val_loss": 0.5} and older.extra == {}
    start = (again := older).step or 0
    assert start == 1 and again


def test_restored_is_a_frozen_value() -> None:
    r = Restored(step=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.step = 4  # type: ignore[misc]
    assert r != 3, "a Restored is not its step: compare .step"
    assert bool(Restored()) is False and bool(Restored(step=0)) is True
