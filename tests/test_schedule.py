"""The save schedule (every N, milestones, seconds), the milestone and time-interval retention
policies, and custom policies in ``CheckpointManager(retention=...)``."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from safeckpt import (
    CheckpointInfo,
    CheckpointManager,
    ConfigError,
    KeepMilestones,
    KeepTimeInterval,
    Milestones,
    Retention,
    SaveSchedule,
    read_record,
)
from safeckpt._policy.retention import explain, retention_json
from toy import make_state, train_step


@pytest.mark.parametrize(
    "schedule, due",
    [
        (dict(every=5), [5, 10, 15, 20]),
        (dict(milestones="pow2"), [1, 2, 4, 8, 16]),
        (dict(milestones=Milestones("pow2", start=3, stop=16)), [4, 8, 16]),
        (dict(milestones=Milestones("pow2", start=4)), [4, 8, 16]),
        (dict(milestones=[3, 7, 7, 0]), [0, 3, 7]),
        (dict(every=6, milestones="pow2"), [1, 2, 4, 6, 8, 12, 16, 18]),
        (dict(every_seconds=10.0), []),
        (dict(), []),
    ],
    ids=["every-5", "pow2", "pow2-window", "pow2-from-4", "explicit", "every-and-pow2", "seconds", "none"],
)
def test_steps_due(schedule: dict[str, Any], due: list[int]) -> None:
    s = SaveSchedule(**schedule)
    assert [step for step in range(21) if s.due_at_step(step)] == due


def test_seconds_due() -> None:
    s = SaveSchedule(every_seconds=10)
    assert s.timed and not SaveSchedule(every=3).timed
    assert [s.due_by_time(t) for t in (0.0, 9.99, 10.0, 50.0)] == [False, False, True, True]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(every=0),
        dict(every=2.5),
        dict(every=True),
        dict(every_seconds=0),
        dict(every_seconds=float("nan")),
        dict(milestones="pow3"),
        dict(milestones=[1, -2]),
        dict(milestones={"steps": "pow2", "start": 8, "stop": 4}),
    ],
    ids=["every-0", "every-float", "every-bool", "seconds-0", "seconds-nan", "pow3", "negative", "window"],
)
def test_bad_schedules_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        SaveSchedule(**kwargs)


def test_should_save_follows_the_schedule(root: Path) -> None:
    with CheckpointManager(root, schedule=SaveSchedule(every=3, milestones=[5])) as mgr:
        assert [s for s in range(1, 10) if mgr.should_save(s)] == [3, 5, 6, 9]
        assert not mgr.preempted
    with CheckpointManager(root) as mgr:  # no schedule: nothing is due
        assert not any(mgr.should_save(s) for s in range(1, 10))


def test_should_save_without_a_schedule_warns_once_per_manager(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for _ in range(2):  # once for each manager, not once per step
        with CheckpointManager(root) as mgr:
            caplog.clear()
            assert not any(mgr.should_save(s) for s in range(1, 10))
            warnings = [r for r in caplog.records if "should_save()" in r.getMessage()]
            assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
            assert "schedule=SaveSchedule(every=N)" in warnings[0].getMessage()
    caplog.clear()
    with CheckpointManager(root, schedule=SaveSchedule(every=3)) as mgr:
        assert [s for s in range(1, 7) if mgr.should_save(s)] == [3, 6]
    assert not [r for r in caplog.records if "should_save()" in r.getMessage()]


def test_should_save_every_seconds_counts_from_the_last_save(root: Path) -> None:
    state = make_state()
    with CheckpointManager(root, schedule=SaveSchedule(every_seconds=3600)) as mgr:
        assert not mgr.should_save(1)
    with CheckpointManager(root, async_save=False, schedule=SaveSchedule(every_seconds=0.05)) as mgr:
        time.sleep(0.1)
        assert mgr.should_save(1)
        assert mgr.should_save(1), "still due while nothing was saved"
        mgr.schedule = SaveSchedule(every_seconds=3600)
        train_step(state)
        mgr.save(1, state)
        assert not mgr.should_save(2)


def test_schedule_must_be_a_save_schedule(root: Path) -> None:
    with pytest.raises(ConfigError, match="SaveSchedule"):
        CheckpointManager(root, schedule={"every": 3})  # type: ignore[arg-type]
    assert not root.exists()
    with CheckpointManager(root, schedule=SaveSchedule(every=2)) as mgr:
        with pytest.raises(ConfigError, match="SaveSchedule"):
            mgr.schedule = 5  # type: ignore[assignment]
        assert mgr.should_save(2) and not mgr.should_save(3)  # the schedule it had is kept


# --- retention -------------------------------------------------------------------------


def infos(steps: range, seconds_apart: float = 1.0) -> list[CheckpointInfo]:
    return [CheckpointInfo(step, {}, 1000.0 + step * seconds_apart) for step in steps]


@pytest.mark.parametrize(
    "policy, kept",
    [
        (KeepMilestones(Milestones("pow2")), [1, 2, 4, 8, 16]),
        (KeepMilestones(Milestones("pow2", start=2, stop=8)), [2, 4, 8]),
        (KeepMilestones(Milestones((5, 10, 99))), [5, 10]),
        (KeepTimeInterval(5.0), [1, 6, 11, 16]),
        (KeepTimeInterval(100.0), [1]),
        (KeepTimeInterval(0.5), list(range(1, 21))),
    ],
    ids=["pow2", "pow2-window", "explicit", "5s", "100s", "below-spacing"],
)
def test_policy_keeps(policy: Any, kept: list[int]) -> None:
    assert sorted(policy.keep(infos(range(1, 21)))) == kept


def test_time_interval_goes_by_time_not_step_and_is_stable() -> None:
    # step 30 was saved before step 20 (a restart from an earlier checkpoint with overwrite=True)
    saved = [CheckpointInfo(10, {}, 0.0), CheckpointInfo(30, {}, 4.0), CheckpointInfo(20, {}, 11.0)]
    assert KeepTimeInterval(10.0).keep(saved) == {10, 20}
    more = [*saved, CheckpointInfo(40, {}, 12.0), CheckpointInfo(50, {}, 25.0)]
    assert KeepTimeInterval(10.0).keep(more) == {10, 20, 50}, "a newer one changes nothing before it"


def test_retention_fields_round_trip_through_json() -> None:
    r = Retention(keep_last=2, keep_milestones=Milestones("pow2", start=64), keep_time_interval=3600)
    assert Retention.from_json(r.to_json()) == r
    assert Retention(keep_milestones=[3, 1]).keep_milestones == Milestones((1, 3))
    reasons = explain(infos(range(60, 70)), r)
    assert reasons[64] == ["milestone (power-of-two steps in [64, ...])"]
    assert reasons[60] == ["one per 1 h"] and reasons[69] == ["last 2"] and reasons[61] == []
    with pytest.raises(ConfigError, match="keep_time_interval"):
        Retention(keep_time_interval=-1)


def test_retention_keeps_the_milestones_a_schedule_saves(root: Path) -> None:
    state = make_state()
    retention = Retention(keep_last=2, keep_milestones="pow2")
    with CheckpointManager(
        root, async_save=False, retention=retention, schedule=SaveSchedule(every=3, milestones="pow2")
    ) as mgr:
        for step in range(1, 21):
            train_step(state)
            if mgr.should_save(step):
                mgr.save(step, state)
        kept = {c.step: c.kept_because for c in mgr.checkpoints()}
    # saved: 1 2 3 4 6 8 9 12 15 16 18; kept: the powers of two and the last two
    assert sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*")) == [1, 2, 4, 8, 16, 18]
    assert sorted(kept) == [1, 2, 4, 8, 16, 18]
    assert "milestone (power-of-two steps)" in kept[16] and "last 2" in kept[16]
    assert read_record(root / "step_18").retention["keep_milestones"]["steps"] == "pow2"


class KeepOdd:
    """A custom policy: odd steps."""

    def keep(self, infos: Any) -> frozenset[int]:
        return frozenset(i.step for i in infos if i.step % 2)

    def reason(self) -> str:
        return "odd step"


def test_a_custom_policy_retains_explains_and_is_recorded(root: Path) -> None:
    state = make_state()
    with CheckpointManager(root, async_save=False, retention=KeepOdd()) as mgr:
        for step in range(1, 7):
            train_step(state)
            mgr.save(step, state)
            if step == 2:
                mgr.pin(2)  # a pin still holds under a custom policy
        kept = {c.step: c.kept_because for c in mgr.checkpoints()}
    assert sorted(kept) == [1, 2, 3, 5, 6]
    assert kept[1] == ("odd step",) and kept[2] == ("pinned",) and "latest" in kept[6]
    recorded = read_record(root / "step_6").retention
    assert recorded == {"custom_policy": "KeepOdd", "reason": "odd step"}
    with pytest.raises(ConfigError, match="custom policy"):
        Retention.from_json(recorded)  # `safeckpt ls` then shows no rule rather than "keep all"


class KeepEven(KeepOdd):
    def __init__(self, data: Any) -> None:
        self.data = data

    def to_json(self) -> Any:
        return self.data


@pytest.mark.parametrize(
    "data, recorded",
    [
        ({"kind": "even"}, {"custom_policy": "KeepEven", "kind": "even"}),
        ({"kind": object()}, {"custom_policy": "KeepEven", "reason": "odd step"}),
        ([1, 2], {"custom_policy": "KeepEven", "reason": "odd step"}),
    ],
    ids=["json", "not-json", "not-a-dict"],
)
def test_a_custom_policy_records_its_to_json_if_it_can(data: Any, recorded: dict[str, Any]) -> None:
    assert retention_json(KeepEven(data)) == recorded


def test_retention_must_be_a_policy(root: Path) -> None:
    with pytest.raises(ConfigError, match="Policy"):
        CheckpointManager(root, retention=3)  # type: ignore[arg-type]
