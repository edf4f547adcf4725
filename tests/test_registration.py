"""The registration thread: a registrar costs only the registration (issue 10 item 2, issue 12).

Real managers, real DCP writes, real threads; the registrars are small real
classes that fail, hang or record what they were told.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from safeckpt import CheckpointManager, ConfigError, JsonlIndexRegistrar, Record, Retention, read_record
from safeckpt._registration.pending import register_pending, registrar_from_json
from safeckpt._registration.worker import CommitInfo, RegistrationWorker
from toy import make_state

# Generous upper bound for anything that must not hang; never a speed assertion.
_HANG = 60.0


def registration(root: Path, step: int) -> dict[str, Any]:
    record = read_record(root / f"step_{step}")
    assert record is not None and record.committed
    assert record.registration is not None, f"step {step} has no registration"
    return dict(record.registration)


def wait_for(predicate: Any, timeout: float = _HANG) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


class Raising:
    """Raises ``error`` for every registration; counts the calls."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.calls: list[int] = []

    def register(self, step: int, path: Path, record: Record) -> None:
        self.calls.append(step)
        raise self.error


class FlakyThenFine:
    """Fails the first ``failures`` calls, then registers; records every call in order."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[int] = []

    def register(self, step: int, path: Path, record: Record) -> dict[str, Any]:
        self.calls.append(step)
        if len(self.calls) <= self.failures:
            raise ConnectionError("registry is down")
        return {"id": f"v{step}"}


class Hanging:
    """Never returns from register() until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

    def register(self, step: int, path: Path, record: Record) -> None:
        self.started.set()
        self.release.wait()


class Recording:
    """Registers what ``choose`` accepts; keeps every CommitInfo it was asked about."""

    def __init__(self, choose: Any = None) -> None:
        self.choose = choose
        self.asked: list[CommitInfo] = []
        self.registered: list[int] = []
        self.closed = 0

    def should_register(self, info: CommitInfo) -> bool:
        self.asked.append(info)
        return True if self.choose is None else bool(self.choose(info))

    def register(self, step: int, path: Path, record: Record) -> None:
        self.registered.append(step)

    def close(self) -> None:
        self.closed += 1


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "error",
    [
        pytest.param(RuntimeError("registry is down"), id="RuntimeError"),
        pytest.param(CheckpointException("registry", {0: RuntimeError("boom")}), id="CheckpointException"),
    ],
)
def test_a_registrar_that_raises_costs_only_the_registration(
    root: Path, async_save: bool, error: BaseException
) -> None:
    registrar = Raising(error)
    state = make_state()
    with CheckpointManager(
        root, async_save=async_save, retention=Retention(keep_last=1), registrar=registrar
    ) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state)  # nothing the registrar raises reaches a save
        mgr.wait()
        assert mgr.latest_step == 3
    assert sorted(p.name for p in root.glob("step_*")) == ["step_3"]  # pruning went on
    outcome = registration(root, 3)
    assert outcome["status"] == "failed"
    assert outcome["error"].startswith(type(error).__name__)
    assert isinstance(outcome["time"], float)
    assert 3 in registrar.calls
    with CheckpointManager(root) as reader:
        assert reader.restore(make_state()).step == 3


def test_a_failed_registration_is_retried_first_at_the_next_commit(root: Path) -> None:
    registrar = FlakyThenFine(failures=1)
    state = make_state()
    with CheckpointManager(root, async_save=False, registrar=registrar) as mgr:
        mgr.save(1, state)
        wait_for(lambda: status(root, 1) is not None)
        assert status(root, 1) == "failed"
        mgr.save(2, state)
    assert registrar.calls == [1, 1, 2]  # the retry of step 1 comes before step 2
    for step in (1, 2):
        outcome = registration(root, step)
        assert outcome["status"] == "registered" and outcome["id"] == f"v{step}"
        assert outcome["error"] is None


def test_while_the_registry_stays_down_each_commit_retries_only_the_oldest(root: Path) -> None:
    registrar = Raising(ConnectionError("down"))
    with CheckpointManager(root, registrar=registrar) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, make_state())
    assert registrar.calls == [1, 1, 2, 1, 3]  # one retry per commit, oldest first, then the commit
    assert [registration(root, s)["status"] for s in (1, 2, 3)] == ["failed"] * 3


def test_a_manager_that_only_reads_registers_nothing(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state())
    registrar = Recording()
    with CheckpointManager(root, registrar=registrar) as reader:
        assert reader.restore(make_state()).step == 1
    assert registrar.asked == [] and registrar.registered == []
    assert read_record(root / "step_1").registration is None  # type: ignore[union-attr]


def test_failures_of_an_earlier_run_are_retried_by_the_next_one(root: Path) -> None:
    state = make_state()
    with CheckpointManager(root, registrar=Raising(RuntimeError("down"))) as mgr:
        mgr.save(1, state)
    assert registration(root, 1)["status"] == "failed"
    registrar = Recording(choose=lambda info: not info.final)
    with CheckpointManager(root, registrar=registrar) as mgr:
        mgr.save(2, state)
    assert registrar.registered == [1, 2]
    assert registration(root, 1)["status"] == "registered"


def test_a_hanging_registrar_never_holds_up_saves_and_close_is_bounded(root: Path) -> None:
    registrar = Hanging()
    state = make_state()
    mgr = CheckpointManager(
        root, async_save=True, queue_depth=1, registrar=registrar, registration_timeout=1.0
    )
    try:
        for step in range(1, 6):  # the third async save used to block forever
            mgr.save(step, state)
        mgr.wait()
        assert registrar.started.wait(_HANG)
        assert mgr.latest_step == 5
        started = time.monotonic()
        mgr.close()
        assert time.monotonic() - started < 1.0 + 30  # registration_timeout + a generous margin
    finally:
        registrar.release.set()
    for step in range(1, 6):
        outcome = registration(root, step)
        assert outcome["status"] == "unfinished", (step, outcome)
        assert "registration_timeout=1" in outcome["error"]
    time.sleep(0.2)  # the released thread must not write past close()
    assert registration(root, 1)["status"] == "unfinished"


def test_a_prunable_checkpoint_is_skipped_quietly_when_gone(root: Path) -> None:
    registrar = Hanging()
    mgr = CheckpointManager(
        root,
        async_save=False,
        retention=Retention(keep_last=1),
        registrar=registrar,
        registration_timeout=0.5,
    )
    try:
        mgr.save(1, make_state())
        assert registrar.started.wait(_HANG)  # step 1 is registering
        time.sleep(0.6)  # past registration_timeout: its registration protects it no longer
        mgr.save(2, make_state())  # prunes step 1 meanwhile
        assert not (root / "step_1").exists()
    finally:
        registrar.release.set()
        mgr.close()
    assert registration(root, 2)["status"] == "registered"


def test_which_commits_a_registrar_wants_and_the_final_one(root: Path) -> None:
    registrar = Recording(choose=lambda info: info.final)
    retention = Retention(keep_best=2, metric="loss")
    with CheckpointManager(root, async_save=False, retention=retention, registrar=registrar) as mgr:
        for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0), (4, 0.5)):
            mgr.save(step, make_state(), metrics={"loss": loss})
    commits = [i for i in registrar.asked if not i.final]
    assert [(i.step, i.is_best) for i in commits] == [(1, True), (2, True), (3, False), (4, True)]
    assert all(i.root == root.absolute() and i.path == root.absolute() / f"step_{i.step}" for i in commits)
    final = [i for i in registrar.asked if i.final]
    assert [i.step for i in final] == [4]
    assert registrar.registered == [4]
    assert registrar.closed == 1
    assert [registration(root, s)["status"] for s in (2, 4)] == ["skipped", "registered"]


def test_default_registrar_is_told_every_commit_once(root: Path, tmp_path: Path) -> None:
    index = tmp_path / "index.jsonl"
    with CheckpointManager(root, registrar=JsonlIndexRegistrar(index)) as mgr:
        for step in (1, 2):
            mgr.save(step, make_state())
    assert len(index.read_text().splitlines()) == 2  # no second line for the final checkpoint
    outcome = registration(root, 2)
    assert outcome["registrar"] == {"kind": "jsonl", "index_path": str(index)}


def test_register_pending_rebuilds_the_registrar_and_registers_failures(root: Path, tmp_path: Path) -> None:
    index = tmp_path / "index.jsonl"
    index.mkdir()  # appending to a directory fails: the registry is "down"
    with CheckpointManager(root, registrar=JsonlIndexRegistrar(index)) as mgr:
        for step in (1, 2):
            mgr.save(step, make_state())
    assert [registration(root, s)["status"] for s in (1, 2)] == ["failed", "failed"]
    index.rmdir()
    assert register_pending(root) == [(1, "registered"), (2, "registered")]
    assert [registration(root, s)["status"] for s in (1, 2)] == ["registered", "registered"]
    assert register_pending(root) == []  # nothing left to do
    assert register_pending(root, step=1) == [(1, "registered")]  # an explicit step is done again
    assert len(index.read_text().splitlines()) == 3


def test_register_pending_with_a_registrar_takes_unregistered_ones(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state())
    assert register_pending(root) == []  # no registrar known, none given
    registrar = Recording()
    assert register_pending(root, registrar) == [(1, "registered")]
    assert registrar.asked[0].final  # step 1 is what latest names


def test_registrar_from_json_rejects_unknown_kinds() -> None:
    with pytest.raises(ConfigError, match="kind"):
        registrar_from_json({"kind": "nope"})
    rebuilt = registrar_from_json({"kind": "jsonl", "index_path": "/x/i.jsonl"})
    assert isinstance(rebuilt, JsonlIndexRegistrar) and rebuilt.index_path == Path("/x/i.jsonl")


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "60", True, None])
def test_registration_timeout_must_be_a_positive_number(root: Path, value: Any) -> None:
    with pytest.raises(ConfigError, match="registration_timeout"):
        CheckpointManager(root, registration_timeout=value)


def test_worker_close_without_work_returns_and_closes_the_registrar(root: Path) -> None:
    from safeckpt._fs.lock import SidecarLock
    from stores import root as root_loc

    root.mkdir()
    registrar = Recording()
    worker = RegistrationWorker(registrar, SidecarLock(root / ".lock"), root_loc(root), timeout=5.0)
    worker.close()
    worker.close()
    assert registrar.closed == 1


def status(root: Path, step: int) -> str | None:
    record = read_record(root / f"step_{step}")
    return None if record is None or record.registration is None else record.registration["status"]
