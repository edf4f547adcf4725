"""Removal: retries with one shared budget per pass, the sidecar lock on every attempt, the deleter.

What pr-nfs-prune-retries.txt asks for, checked through the FileOps seam: which
errors are retried, how many ``rmtree`` calls and which waits a pass makes,
and the lock state of every attempt and every wait.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from faults import FaultyFileOps
from safeckpt._format.layout import ABANDONED, PRUNED, REPLACED, Layout, parse_trash_name
from safeckpt._posix.store import PosixStore
from safeckpt._root.removal import (
    RETRY_WAITS,
    Deleter,
    RetryBudget,
    collect_abandoned_staging,
    recover_interrupted_replacements,
    remove_tree,
)
from safeckpt._store.loc import Loc


class Root:
    """A checkpoint root with its layout, lock and a fault-injecting FileOps under its store."""

    def __init__(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.ops = FaultyFileOps()
        self.store = PosixStore(path, self.ops)
        self.lock = self.store.lock(timeout=30)
        self.ops.lock = self.lock
        self.layout = Layout(Loc(self.store))
        self.at = _Paths(self.layout)
        self.deleter = Deleter(self.layout, self.lock)

    def loc(self, path: Path) -> Loc:
        return Loc(self.store, path.relative_to(self.path).as_posix())

    def trash_dir(self, step: int, reason: str = PRUNED, *, files: int = 3) -> Path:
        path = self.at.new_trash_path(step, reason)
        _fill(path, files)
        return path

    def attempts_and_waits(self) -> list[tuple[str, bool | None]]:
        """Every rmtree and sleep, in order, with whether the calling thread held the lock."""
        return [(c.op, c.locked) for c in self.ops.calls_of("rmtree", "sleep")]


class _Paths:
    """The layout's names as local paths (what the assertions look at on disk)."""

    def __init__(self, layout: Layout) -> None:
        self._layout = layout

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._layout, name)
        if callable(value):
            return lambda *args: paths(value(*args))
        return paths(value)


def paths(value: Any) -> Any:
    """Locs (one, a list, or a mapping's keys) as the local paths they name."""
    if isinstance(value, Loc):
        return value.where
    return [loc.where for loc in value]


def _fill(path: Path, files: int) -> None:
    (path / "sub").mkdir(parents=True)
    for i in range(files):
        (path / f"shard_{i}.distcp").write_bytes(b"x" * 100)
        (path / "sub" / f"f{i}").write_bytes(b"y")


@pytest.fixture
def r(root_dir: Path) -> Root:
    """A root on local disk, and on the NFS-semantics filesystem."""
    return Root(root_dir)


def _wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# --- remove_tree -------------------------------------------------------------------------------

TRANSIENT = [
    pytest.param(errno.ENOTEMPTY, id="ENOTEMPTY"),
    pytest.param(errno.EBUSY, id="EBUSY"),
    pytest.param(errno.ENOENT, id="ENOENT-while-the-directory-exists"),
]


@pytest.mark.parametrize("err", TRANSIENT)
@pytest.mark.parametrize("failures", [1, 3, 4])
def test_transient_errors_are_retried_then_succeed(r: Root, err: int, failures: int) -> None:
    path = r.trash_dir(1)
    r.ops.fail("rmtree", err, times=failures)
    result = remove_tree(r.loc(path), RetryBudget(), r.lock)
    assert result.removed and result.error is None
    assert result.attempts == failures + 1
    assert not path.exists()
    assert r.ops.sleeps == list(RETRY_WAITS[:failures])
    expected = [("rmtree", True)]
    for _ in range(failures):
        expected += [("sleep", False), ("rmtree", True)]
    assert r.attempts_and_waits() == expected


@pytest.mark.parametrize("err", TRANSIENT)
def test_a_transient_error_that_outlasts_the_budget_gives_up_after_five_attempts(r: Root, err: int) -> None:
    path = r.trash_dir(1)
    r.ops.fail("rmtree", err, times=None)
    budget = RetryBudget()
    result = remove_tree(r.loc(path), budget, r.lock)
    assert not result.removed
    assert result.error is not None and result.error.errno == err
    assert result.attempts == 5
    assert budget.exhausted() and budget.slept == pytest.approx(0.75)
    assert path.exists()
    # The waits in order; each of the five attempts (the fifth and last too) under the lock,
    # no wait under it.
    assert r.ops.sleeps == [0.05, 0.1, 0.2, 0.4]
    assert r.attempts_and_waits() == [
        ("rmtree", True),
        ("sleep", False),
        ("rmtree", True),
        ("sleep", False),
        ("rmtree", True),
        ("sleep", False),
        ("rmtree", True),
        ("sleep", False),
        ("rmtree", True),
    ]


OTHER_ERRORS = [
    pytest.param(errno.EACCES, id="EACCES"),
    pytest.param(errno.EPERM, id="EPERM"),
    pytest.param(errno.EROFS, id="EROFS"),
    pytest.param(errno.EIO, id="EIO"),
]


@pytest.mark.parametrize("err", OTHER_ERRORS)
def test_other_errors_are_tried_once(r: Root, err: int) -> None:
    path = r.trash_dir(1)
    r.ops.fail("rmtree", err, times=None)
    result = remove_tree(r.loc(path), RetryBudget(), r.lock)
    assert not result.removed
    assert result.attempts == 1
    assert result.error is not None and result.error.errno == err
    assert r.ops.sleeps == []
    assert r.attempts_and_waits() == [("rmtree", True)]
    assert path.exists()


def test_a_directory_already_gone_is_tried_once_and_counts_as_removed(r: Root) -> None:
    gone = r.at.new_trash_path(1, PRUNED)
    result = remove_tree(r.loc(gone), RetryBudget(), r.lock)  # the real rmtree raises ENOENT
    assert result.removed and result.error is None and result.attempts == 1
    assert r.ops.sleeps == []
    # An injected ENOENT for a directory that is gone by then: removed as well.
    r.ops.fail("rmtree", errno.ENOENT)
    result = remove_tree(r.loc(gone), RetryBudget(), r.lock)
    assert result.removed and result.attempts == 1
    assert r.ops.sleeps == []


def test_a_spent_budget_allows_one_attempt_and_no_wait(r: Root) -> None:
    budget = RetryBudget()
    while budget.next_wait() is not None:
        pass
    path = r.trash_dir(1)
    r.ops.fail("rmtree", errno.ENOTEMPTY, times=1)
    result = remove_tree(r.loc(path), budget, r.lock)
    assert not result.removed and result.attempts == 1 and r.ops.sleeps == []
    assert remove_tree(r.loc(path), RetryBudget(), r.lock).removed


# --- one pass over the trash --------------------------------------------------------------------


def test_ten_failing_directories_share_one_budget(r: Root) -> None:
    entries = [r.trash_dir(step, files=1) for step in range(10)]
    r.ops.fail("rmtree", errno.ENOTEMPTY, times=None)
    result = r.deleter.run_pass()
    assert r.ops.count("rmtree") == 14
    assert result.attempts == 14
    assert r.ops.sleeps == [0.05, 0.1, 0.2, 0.4]
    assert sum(r.ops.sleeps) <= 0.75 + 1e-9
    assert result.slept == pytest.approx(0.75)
    assert sorted(paths(result.remaining)) == entries
    assert result.removed == []
    assert all(locked for op, locked in r.attempts_and_waits() if op == "rmtree")
    assert not any(locked for op, locked in r.attempts_and_waits() if op == "sleep")


def test_a_pass_shares_the_budget_and_keeps_going_after_it_is_spent(r: Root) -> None:
    stuck = r.trash_dir(1)
    others = [r.trash_dir(step) for step in (2, 3, 4)]
    r.ops.fail("rmtree", errno.EBUSY, times=None, match=stuck.name)
    r.ops.fail("rmtree", errno.ENOTEMPTY, times=1, match=others[1].name)
    result = r.deleter.run_pass()
    # step_1 spends every wait; step_3's transient failure then has none left and waits for the next pass.
    assert r.ops.sleeps == [0.05, 0.1, 0.2, 0.4]
    assert sorted(paths(result.removed)) == [others[0], others[2]]
    assert sorted(paths(result.remaining)) == [stuck, others[1]]
    assert r.ops.count("rmtree") == 5 + 1 + 1 + 1
    r.ops.clear_faults()
    second = r.deleter.run_pass()
    assert sorted(paths(second.removed)) == [stuck, others[1]] and not second.remaining
    assert r.layout.trash_entries() == []


def test_what_a_pass_leaves_is_retried_by_the_next(r: Root, caplog: pytest.LogCaptureFixture) -> None:
    path = r.trash_dir(7)
    r.ops.fail("rmtree", errno.ENOTEMPTY, times=5 * 3)  # outlasts three passes
    for _ in range(3):
        result = r.deleter.run_pass()
        assert paths(result.remaining) == [path]
        assert result.remaining[r.loc(path)] is not None
    assert r.ops.count("rmtree") == 15
    assert paths(r.deleter.run_pass().removed) == [path]
    assert not path.exists()
    warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING and path.name in rec.message]
    assert len(warnings) == 1, "warned once per directory, not once per pass"
    assert "will be retried" in warnings[0].message
    assert any("after earlier failures" in rec.message for rec in caplog.records)


def test_a_permission_error_is_tried_once_per_pass_and_warned_about_once(
    r: Root, caplog: pytest.LogCaptureFixture
) -> None:
    path = r.trash_dir(3)
    fault = r.ops.fail("rmtree", errno.EACCES, times=None)
    for passes in (1, 2, 3):
        result = r.deleter.run_pass()
        assert paths(result.remaining) == [path]
        assert r.ops.count("rmtree") == passes
    assert r.ops.sleeps == []
    warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1 and path.name in warnings[0].message
    assert "Permission denied" in warnings[0].message
    fault.times = fault.fired  # the permission is fixed
    assert paths(r.deleter.run_pass().removed) == [path]


def test_each_directory_is_warned_about_once(r: Root, caplog: pytest.LogCaptureFixture) -> None:
    first, second = r.trash_dir(1), r.trash_dir(2)
    r.ops.fail("rmtree", errno.EIO, times=None)
    for _ in range(4):
        r.deleter.run_pass()
    warnings = [rec.message for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert sum(first.name in w for w in warnings) == 1 and sum(second.name in w for w in warnings) == 1


def test_a_pass_never_deletes_replaced_entries(r: Root) -> None:
    replaced = r.trash_dir(4, REPLACED)
    pruned = r.trash_dir(4, PRUNED)
    result = r.deleter.run_pass()
    assert paths(result.removed) == [pruned]
    assert replaced.is_dir()
    assert all(replaced not in c.paths for c in r.ops.calls_of("rmtree"))
    assert r.deleter.drain(timeout=5) == []
    assert replaced.is_dir()


# --- drain and the background thread ------------------------------------------------------------


def test_drain_passes_until_the_trash_is_empty(r: Root) -> None:
    entries = [r.trash_dir(step) for step in (1, 2, 3)]
    # Clears only after three passes (five attempts per pass for the first directory).
    r.ops.fail("rmtree", errno.ENOTEMPTY, times=13)
    assert r.deleter.drain(timeout=60) == []
    assert r.layout.trash_entries() == []
    assert r.deleter.passes >= 3
    assert all(not e.exists() for e in entries)
    # Pauses between passes go through the seam, never under the lock.
    assert r.ops.sleeps and not any(c.locked for c in r.ops.calls_of("sleep"))
    assert all(c.locked for c in r.ops.calls_of("rmtree"))


def test_drain_gives_up_after_its_budget_and_says_what_is_left(
    r: Root, caplog: pytest.LogCaptureFixture
) -> None:
    stuck = r.trash_dir(1)
    gone = r.trash_dir(2)
    r.ops.fail("rmtree", errno.EBUSY, times=None, match=stuck.name)
    assert paths(r.deleter.drain(timeout=0)) == [stuck]
    assert not gone.exists()
    assert any("drain budget" in rec.message and stuck.name in rec.message for rec in caplog.records)


def test_drain_does_not_wait_for_errors_that_will_not_clear(
    r: Root, caplog: pytest.LogCaptureFixture
) -> None:
    denied = r.trash_dir(1)
    r.ops.fail("rmtree", errno.EACCES, times=None, match=denied.name)
    assert paths(r.deleter.drain(timeout=3600)) == [denied]
    assert r.deleter.passes == 1 and r.ops.sleeps == []
    assert any(denied.name in rec.message and "stays in the trash" in rec.message for rec in caplog.records)


def test_a_stray_file_in_the_trash_is_removed(r: Root) -> None:
    stray = r.at.new_trash_path(0, "abandoned")
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"not a directory")
    assert r.deleter.drain(timeout=5) == []
    assert not stray.exists()


def test_drain_of_an_empty_trash_makes_no_call(r: Root) -> None:
    assert r.deleter.drain(timeout=5) == []
    assert r.ops.calls == []


def test_the_background_deleter_removes_scheduled_trash(r: Root) -> None:
    deleter = Deleter(r.layout, r.lock, retry_interval=0.05)
    deleter.start()
    try:
        path = r.trash_dir(5)
        r.ops.fail("rmtree", errno.ENOTEMPTY, times=7)  # more than one pass
        deleter.schedule()
        _wait_until(lambda: not path.exists())
    finally:
        deleter.close()
    assert deleter.passes >= 2
    attempts = r.ops.calls_of("rmtree")
    assert attempts and all(c.locked and c.thread == "safeckpt-deleter" for c in attempts)
    assert not any(c.locked for c in r.ops.calls_of("sleep"))


class _FlakyLayout(Layout):
    """A layout whose first three listings of the trash raise, as a vanished mount would."""

    listings: list[int] = []

    def trash_entries(self) -> list[Loc]:
        self.listings.append(1)
        if len(self.listings) <= 3:
            raise RuntimeError("listing failed")
        return super().trash_entries()


def test_the_background_deleter_survives_an_unexpected_error(
    r: Root, caplog: pytest.LogCaptureFixture
) -> None:
    layout = _FlakyLayout(r.layout.root)
    layout.listings.clear()
    path = r.trash_dir(1)
    deleter = Deleter(layout, r.lock, retry_interval=0.02)
    deleter.start()
    try:
        deleter.schedule()
        _wait_until(lambda: not path.exists())
    finally:
        deleter.close()
    assert len(layout.listings) >= 4
    said = [rec.message for rec in caplog.records if "could not delete pruned checkpoints now" in rec.message]
    assert len(said) == 1, said  # one line for the kind of failure, not one per pass


# --- recovery at start ----------------------------------------------------------------------------


def test_an_interrupted_replacement_is_put_back_when_the_step_is_missing(r: Root) -> None:
    old = r.trash_dir(3, REPLACED)
    (old / "metadata.json").write_text("{}")
    restored = recover_interrupted_replacements(r.layout, r.lock)
    assert restored == [3]
    target = r.at.step_dir(3)
    assert (target / "metadata.json").read_text() == "{}"
    assert r.layout.trash_entries() == []
    assert [c.locked for c in r.ops.calls_of("replace")] == [True]


def test_an_interrupted_replacement_is_relabelled_pruned_when_the_step_exists(r: Root) -> None:
    old = r.trash_dir(3, REPLACED)
    new = r.at.step_dir(3)
    new.mkdir()
    (new / "new").write_text("new copy")
    assert recover_interrupted_replacements(r.layout, r.lock) == []
    assert (new / "new").read_text() == "new copy"
    (entry,) = r.layout.trash_entries()
    assert parse_trash_name(entry.name) == (3, PRUNED)
    assert not old.exists()
    assert all(c.locked for c in r.ops.calls_of("replace"))
    # Now an ordinary pruned entry: the next pass deletes it.
    assert r.deleter.run_pass().removed == [entry]


def test_recovery_leaves_other_trash_alone(r: Root) -> None:
    pruned = r.trash_dir(1, PRUNED)
    abandoned = r.trash_dir(2, ABANDONED)
    stranger = r.at.trash / "not-ours"
    stranger.mkdir()
    assert recover_interrupted_replacements(r.layout, r.lock) == []
    assert pruned.is_dir() and abandoned.is_dir() and stranger.is_dir()
    assert r.ops.calls == []


def test_two_interrupted_replacements_of_one_step_put_back_one(r: Root) -> None:
    r.trash_dir(6, REPLACED)
    r.trash_dir(6, REPLACED)
    assert recover_interrupted_replacements(r.layout, r.lock) == [6]
    assert r.at.step_dir(6).is_dir()
    (entry,) = r.layout.trash_entries()
    assert parse_trash_name(entry.name) == (6, PRUNED)


def test_abandoned_staging_is_collected_into_the_trash(r: Root) -> None:
    r.at.staging.mkdir()
    interrupted = r.at.staging / "step_12.0123456789ab"
    _fill(interrupted, 2)
    odd = r.at.staging / "leftover"
    odd.mkdir()
    moved = collect_abandoned_staging(r.layout, r.lock)
    assert r.layout.staging_entries() == []
    assert sorted(paths(moved)) == r.at.trash_entries()
    reasons = sorted(parse_trash_name(p.name) for p in moved)  # type: ignore[type-var]
    assert reasons == [(0, ABANDONED), (12, ABANDONED)]
    assert [c.locked for c in r.ops.calls_of("replace")] == [True, True]
    assert sorted(paths(r.deleter.run_pass().removed)) == sorted(paths(moved))


def test_collecting_nothing_is_fine(r: Root) -> None:
    assert collect_abandoned_staging(r.layout, r.lock) == []
    assert not r.at.trash.exists()
