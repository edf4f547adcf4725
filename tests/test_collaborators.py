"""The manager's collaborators, each built from what it needs and used alone (no CheckpointManager)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from safeckpt import CheckpointManager, RootInUseError, RootNotWritableError, SaveSchedule
from safeckpt._dist.participants import Participants
from safeckpt._format.catalog import damaged_note, scan
from safeckpt._format.layout import Layout
from safeckpt._manager.damaged import DamagedCommits
from safeckpt._manager.outcomes import Outcomes
from safeckpt._manager.preemption import PreemptionHandlers
from safeckpt._manager.saves import SaveJob, SaveView
from safeckpt._manager.session import RootSession
from safeckpt._manager.triggers import Triggers
from safeckpt._root.ownership import read_owner
from safeckpt.errors import SaveFailedError
from stores import root as root_loc


def session_of(root: Path, *, read_only: bool = False) -> tuple[RootSession, SaveView, DamagedCommits]:
    layout, view = Layout(root_loc(root)), SaveView()
    damaged = DamagedCommits(layout, view)
    session = RootSession(
        layout,
        view,
        damaged,
        read_only=read_only,
        lock_timeout=5,
        retry_interval=60,
    )
    return session, view, damaged


def save_steps(root: Path, *steps: int) -> None:
    with CheckpointManager(root, async_save=False) as mgr:
        for step in steps:
            mgr.save(step, {"w": torch.full((4,), float(step))})


def test_a_root_session_claims_loads_the_view_writes_and_gives_the_root_up(root: Path) -> None:
    save_steps(root, 1, 2)
    session, view, _ = session_of(root)
    session.open()
    assert view.latest == 2 and view.newest_step() == 2
    owner = read_owner(root)
    assert owner is not None and owner.writing  # claimed at open: the writer, before any restore
    session.ensure_writer("a test")
    assert read_owner(root) == owner  # already ours: nothing written
    assert session.release() == []
    assert read_owner(root) is None


def test_a_read_only_root_session_writes_nothing_and_refuses_to_write(root: Path) -> None:
    save_steps(root, 1)
    before = sorted(p.name for p in root.iterdir())
    session, view, _ = session_of(root, read_only=True)
    session.open()
    assert view.latest == 1
    with pytest.raises(RootNotWritableError, match="read_only=True"):
        session.ensure_writer("a test")
    assert session.release() == []
    assert sorted(p.name for p in root.iterdir()) == before


def test_a_second_root_session_is_refused_while_the_first_writes(root: Path) -> None:
    first, _, _ = session_of(root)
    first.open()
    first.ensure_writer("the first")
    second, _, _ = session_of(root)
    with pytest.raises(RootInUseError, match="close\\(\\) the other CheckpointManager"):
        second.open()  # refused at open, before it could restore
    assert first.release() == [] and second.release() == []


def test_damaged_commits_are_moved_aside_only_by_the_roots_owner(root: Path) -> None:
    save_steps(root, 1, 2)
    entry = scan(root).committed[2]
    reader, view, damaged = session_of(root, read_only=True)
    reader.open()
    damaged.note(entry.path, entry.record, "a test says so")
    assert damaged.steps == {2}
    reader.move_damaged_aside()  # not the owner: nothing moves
    assert (root / "step_2").is_dir() and damaged.steps == {2}
    owner, view, damaged = session_of(root)
    owner.open()
    damaged.note(entry.path, entry.record, "a test says so")
    owner.move_damaged_aside()
    assert damaged.steps == frozenset() and not (root / "step_2").exists()
    assert view.latest == 1 and os.readlink(root / "latest") == "step_1"
    (moved,) = scan(root).damaged
    assert damaged_note(moved)["reason"] == "a test says so"
    assert owner.release() == [] and reader.release() == []


def test_triggers_answer_from_the_schedule_alone() -> None:
    triggers = Triggers(Participants(), SaveSchedule(every=3), PreemptionHandlers(()))
    assert [s for s in range(1, 10) if triggers.should_save(s)] == [3, 6, 9]
    assert not triggers.preempted and triggers.preemption_signal is None


def test_outcomes_raise_a_failed_background_save_once(root: Path) -> None:
    view = SaveView()
    outcomes = Outcomes(Participants(), view)
    job = SaveJob(
        seq=1,
        step=5,
        staging_dir=root,
        dcp_state=None,
        encode_train_state=bytes,
        metrics={},
        extra={},
        time=0.0,
    )
    view.add(job)
    view.finish(job, "failed", SaveFailedError("the disk is full", step=5))
    with pytest.raises(SaveFailedError, match="the disk is full"):
        outcomes.conclude(None, what="wait()")
    assert outcomes.conclude(None, what="wait()") is None  # raised once, then cleared


def test_a_record_amended_on_another_thread_never_stands_in_for_a_newer_commit_of_its_step(
    root: Path,
) -> None:
    """The uploader marks step 5 as uploaded while a second save of step 5 commits: the view keeps
    the newer commit (else local retention would take it for uploaded, and prune it unuploaded)."""
    import dataclasses

    from safeckpt._format.tier_fields import Upload
    from safeckpt._manager.saves import Committed

    save_steps(root, 5)
    session, view, _ = session_of(root)
    session.open()
    first = view.get(5)
    assert first is not None
    again = Committed(first.path, dataclasses.replace(first.record, seq=(first.record.seq or 0) + 1))
    view.commit(again)
    view.update(Committed(first.path, dataclasses.replace(first.record, uploaded=Upload(at=1.0, to="x"))))
    now = view.get(5)
    assert now is not None and now.record.seq == again.record.seq and now.record.uploaded is None
    view.update(Committed(again.path, dataclasses.replace(again.record, pinned=True)))  # its own amendment
    now = view.get(5)
    assert now is not None and now.record.pinned
    session.release()


def test_the_core_calls_the_tier_protocol_in_its_documented_order(root: Path, tmp_path: Path) -> None:
    """The seam of _manager.tiering, seen from a real manager: its hooks in the order its docstring
    gives (a spy on the no-op tiers stands in for the second tier)."""
    from safeckpt._manager import tiering

    calls: list[str] = []

    class Spy(tiering.OneTier):
        def start(self, core: tiering.Core) -> None:
            calls.append("start")

        def before_write(self, step: int) -> None:
            calls.append(f"before_write {step}")

        def commit(self, job: SaveJob, record: Any) -> tiering.TierCommit:
            calls.append(f"commit {job.step}")
            return super().commit(job, record)

        def settled(self, job: SaveJob, *, everywhere: bool) -> None:
            calls.append(f"settled {job.step} everywhere={everywhere}")

        def protected(self) -> frozenset[int]:
            calls.append("protected")
            return frozenset()

        def wait(self, *, closing: bool) -> tiering.Waited:
            calls.append(f"wait closing={closing}")
            return super().wait(closing=closing)

    def spied(options: tiering.TierOptions) -> tiering.TierSetup:
        return tiering.TierSetup(options.root, options.retention, frozenset({0}), Spy())

    real = tiering._second_tier
    tiering.register_second_tier(spied)
    try:
        with CheckpointManager(root, local_dir=tmp_path / "fast", async_save=False) as mgr:
            assert calls == ["start"]  # once, as the manager is made
            mgr.save(1, {"w": torch.ones(2)})
            mgr.wait()
            assert calls[1:] == ["before_write 1", "commit 1", "settled 1 everywhere=True", "protected"]
            mgr.wait(durable=True)
    finally:
        tiering.register_second_tier(real)  # type: ignore[arg-type]
    assert calls[5:] == ["wait closing=False", "wait closing=True"]
