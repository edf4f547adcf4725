"""SaveLedger: the in-flight bookkeeping of invariant 4, shared by SaveView and SafeCheckpointIO."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from safeckpt._manager.background import CANCELLED, COMMITTED, FAILED, QUEUED, WRITING, BackgroundWriter
from safeckpt._manager.ledger import Flight, SaveLedger


@dataclass(eq=False)
class Save(Flight):
    name: str

    @property
    def step(self) -> int:  # BackgroundWriter names a job by its step in its logs
        return 0


def ledger_with(*keys: str) -> tuple[SaveLedger[str, Save], list[Save]]:
    ledger: SaveLedger[str, Save] = SaveLedger()
    saves = [Save(name=f"{key}{i}") for i, key in enumerate(keys)]
    for key, save in zip(keys, saves, strict=True):
        ledger.add(key, save)
    return ledger, saves


def test_a_removal_cancels_queued_saves_which_are_then_never_written() -> None:
    ledger, (a, b, c) = ledger_with("x", "y", "x")
    removal = ledger.remove("x")
    assert removal.cancelled == (a, c) and removal.deferred == () and not removal.writing
    assert a.status == c.status == CANCELLED and a.ended
    assert ledger.in_flight() == [b] and ledger.keys() == ["y"]
    assert not ledger.start(a)  # the runner reaches it later: nothing to write
    assert a.status == CANCELLED
    assert ledger.start(b) and b.status == WRITING


def test_cancel_now_and_cancel_requested_until_start() -> None:
    ledger, (a, b, c) = ledger_with("x", "x", "y")
    assert ledger.cancel_queued("x") == [a, b]
    assert not ledger.cancel(a)  # already ended
    assert ledger.request_cancel(c) and not ledger.request_cancel(c)
    assert c.status == QUEUED and ledger.in_flight() == [c]  # asked, not done: the runner decides
    ledger.withdraw_cancel(c)
    assert ledger.start(c)  # withdrawn: written
    d = Save(name="d")
    ledger.add("z", d)
    ledger.request_cancel(d)
    assert not ledger.start(d) and d.status == CANCELLED and ledger.in_flight() == [c]
    e = Save(name="e")
    ledger.add("z", e)
    assert not ledger.start(e, cancel=True) and e.status == CANCELLED  # the agreed decision wins
    assert not ledger.request_cancel(c)  # being written: too late to ask


def test_a_removal_reaching_a_save_being_written_is_deferred_until_its_write_ends() -> None:
    ledger, (a, b) = ledger_with("x", "x")
    assert ledger.start(a)
    removal = ledger.remove("x")
    assert removal.cancelled == (b,) and removal.deferred == (a,) and removal.writing
    assert a.status == WRITING and not a.ended and a.remove_after  # never removed during its write
    assert ledger.in_flight("x") == [a]
    again = ledger.remove("x")  # a second removal: still deferred, counted once
    assert again.deferred == () and again.writing
    assert ledger.finish(a, COMMITTED)
    assert a.remove_after and ledger.in_flight() == []  # the runner removes the file now
    after = ledger.remove("x")
    assert not after.writing and after.deferred == ()  # nothing in flight: the caller removes it


def test_the_first_terminal_state_wins() -> None:
    ledger, (a,) = ledger_with("x")
    assert ledger.start(a)
    first = OSError("disk full")
    assert ledger.finish(a, FAILED, first)
    assert not ledger.finish(a, COMMITTED)
    assert not ledger.finish(a, FAILED, OSError("cleanup failed too"))
    assert a.status == FAILED and a.error is first
    assert not ledger.start(a) and not ledger.cancel(a) and a.status == FAILED
    with pytest.raises(ValueError, match="terminal"):
        ledger.finish(a, WRITING)


def test_wait_for_a_key_waits_for_its_saves_in_flight_only(tmp_path: Path) -> None:
    gate, entered = threading.Event(), threading.Event()
    ledger: SaveLedger[Path, Save] = SaveLedger()

    def persist(save: Save) -> None:
        if not ledger.start(save):
            return
        if save.name == "slow":
            entered.set()
            assert gate.wait(30)
        ledger.finish(save, COMMITTED)

    writer = BackgroundWriter(persist, name="test-ledger-writer")
    slow, queued, other = Save(name="slow"), Save(name="queued"), Save(name="other")
    try:
        for key, save in ((tmp_path / "a", slow), (tmp_path / "a", queued), (tmp_path / "b", other)):
            ledger.add(key, save)
            writer.submit(save)
        assert entered.wait(30)
        assert ledger.wait(tmp_path / "c", timeout=0)  # nothing in flight there
        assert not ledger.wait(tmp_path / "a", timeout=0.05)  # being written
        assert not ledger.wait(tmp_path / "b", timeout=0.05)  # queued behind it
        gate.set()
        assert ledger.wait(tmp_path / "a", timeout=30)
        assert slow.done.is_set() and queued.done.is_set() and slow.status == queued.status == COMMITTED
        assert ledger.wait(tmp_path / "b")
        assert ledger.in_flight() == []
    finally:
        gate.set()
        writer.close()
