"""The cyclic garbage collector is paused while a save or a restore runs, and runs again after."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import safeckpt
from safeckpt import CheckpointManager
from safeckpt._dcp import io as dcp_io
from safeckpt._manager import resumer as resume
from safeckpt._util.gc_pause import collector_paused


@pytest.fixture(autouse=True)
def collector_on() -> Any:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_pauses_nest_and_the_collector_runs_again_after_the_last() -> None:
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "the inner pause ended the outer one"
    assert gc.isenabled()


def test_a_collector_switched_off_by_the_user_stays_off() -> None:
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_it_runs_again_after_an_exception() -> None:
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_overlapping_pauses_on_two_threads() -> None:
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with collector_paused():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(10)
    with collector_paused():
        pass
    assert not gc.isenabled(), "this thread's pause ended while the other's went on"
    release.set()
    thread.join()
    assert gc.isenabled()


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[bool]:
    seen: list[bool] = []
    real = getattr(module, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


@pytest.mark.parametrize("async_save", [False, True])
def test_save_restore_and_load_run_with_the_collector_paused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    state = {"layers": {i: torch.randn(16) for i in range(50)}}
    captured = _spy(monkeypatch, safeckpt._manager.saver, "capture")
    saved = _spy(monkeypatch, dcp_io, "save")
    loaded = _spy(monkeypatch, dcp_io, "load_flat")
    checked = _spy(monkeypatch, resume, "check_own_files")  # before the load: the record's parse
    with CheckpointManager(tmp_path / "run", async_save=async_save) as mgr:
        mgr.save(1, state)
        mgr.wait()
        assert gc.isenabled()
        target = {"layers": {i: torch.zeros(16) for i in range(50)}}
        mgr.restore(target)
        assert gc.isenabled()
        assert all(torch.equal(target["layers"][i], state["layers"][i]) for i in range(50))
        mgr.load()
    assert gc.isenabled()
    assert captured == [False]
    # A background save's write runs beside training: the collector stays on for it.
    assert saved == [async_save]
    assert loaded == [False, False]
    assert checked == [False]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_child_forked_during_a_pause_collects_again() -> None:
    with collector_paused():
        pid = os.fork()
        if pid == 0:
            os._exit(0 if gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
        assert not gc.isenabled()
    assert os.waitstatus_to_exitcode(status) == 0
