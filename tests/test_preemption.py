"""Preemption: real signals sent to real training processes (one process, and two gloo ranks of
which only one is signalled), a second signal during the emergency save, resuming after each,
and the handlers themselves (install, chain, restore). The demo's SIGTERM: test_demo.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import preempt_worker
from forkserver import context
from safeckpt import CheckpointManager, ConfigError, SaveSchedule, read_record
from safeckpt._manager.preemption import PreemptionHandlers
from safeckpt._ops.maintenance import verify

LONG_RUN = 3000  # steps: far more than a test waits for, so the signal always lands mid-run


# --- helpers: launch ranks, wait for progress, collect reports -----------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(ws: int, root: Path, results: Path, **kwargs: Any) -> list[Any]:
    results.mkdir(parents=True, exist_ok=True)
    for old in [*results.glob("rank*.json"), *results.glob("progress*")]:
        old.unlink()
    ctx = context()
    port = free_port()
    procs = [
        ctx.Process(target=preempt_worker.main, args=(rank, ws, port, str(root), str(results), kwargs))
        for rank in range(ws)
    ]
    for proc in procs:
        proc.start()
    return procs


def wait_for(predicate: Any, procs: list[Any], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if any(p.exitcode is not None for p in procs):
            raise AssertionError(f"a rank exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def progress(results: Path, rank: int) -> int:
    try:
        return int((results / f"progress{rank}").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def finish(procs: list[Any], results: Path) -> list[dict[str, Any]]:
    """Each rank's result (with its exit code), in rank order; fails if one did not finish."""
    for proc in procs:
        proc.join(timeout=240)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    out = []
    for rank, proc in enumerate(procs):
        path = results / f"rank{rank}.json"
        report = json.loads(path.read_text()) if path.exists() else {"ok": None}
        assert report["ok"], f"rank {rank} (exit {proc.exitcode}): {report.get('traceback') or report}"
        out.append({**report["result"], "exitcode": proc.exitcode})
    return out


def latest(root: Path) -> int:
    return int(os.readlink(root / "latest").removeprefix("step_"))


def check_resume(root: Path, results: Path, ws: int, stopped: int) -> None:
    """A relaunch continues at the saved step, with the saved extra and metrics on every rank."""
    resumed = finish(start(ws, root, results, total=stopped + 3, signals=[signal.SIGTERM]), results)
    for r in resumed:
        assert r["exitcode"] == 0 and not r["preempted"]
        assert r["start"] == stopped and r["count"] == stopped, "the state continues where it stopped"
        assert r["extra"] == {"tokens_seen": stopped * 100}
        assert r["metrics"] == {"loss": pytest.approx(1.0 / stopped)}
        assert r["last"] == stopped + 3
    assert latest(root) == stopped + 3


def check_stop_step_committed(root: Path, stopped: int, world_size: int = 1) -> None:
    assert latest(root) == stopped, "the newest checkpoint is the step the run stopped at"
    record = read_record(root / f"step_{stopped}")
    assert record is not None and record.committed and record.world_size == world_size
    assert verify(root, stopped) == {stopped: []}
    assert list((root / ".staging").iterdir()) == []


# --- real processes --------------------------------------------------------------------------


def test_sigterm_mid_run_saves_the_stop_step_and_resume_continues_there(tmp_path: Path) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    procs = start(
        1, root, results, total=LONG_RUN, signals=[signal.SIGTERM, signal.SIGUSR1], app_handler=True
    )
    wait_for(lambda: progress(results, 0) >= 5, procs, "step 5")
    os.kill(procs[0].pid, signal.SIGTERM)
    (out,) = finish(procs, results)
    assert out["exitcode"] == 128 + signal.SIGTERM
    assert out["preempted"] and out["signal"] == signal.SIGTERM
    stopped = out["stopped"]
    assert stopped is not None and 5 <= stopped < LONG_RUN
    assert out["chained"] == [signal.SIGTERM], "the application's own handler was called too"
    assert out["handler_restored"], "close() put the application's handler back"
    check_stop_step_committed(root, stopped)
    check_resume(root, results, 1, stopped)


@pytest.mark.distributed
def test_only_rank_1_signalled_both_ranks_stop_at_the_same_committed_step(tmp_path: Path) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    procs = start(2, root, results, total=LONG_RUN, signals=[signal.SIGTERM, signal.SIGUSR1])
    wait_for(lambda: progress(results, 1) >= 5, procs, "rank 1 at step 5")
    os.kill(procs[1].pid, signal.SIGUSR1)
    out = finish(procs, results)
    assert [o["exitcode"] for o in out] == [128 + signal.SIGUSR1] * 2, "rank 0 stopped too"
    assert [o["signal"] for o in out] == [signal.SIGUSR1] * 2
    assert out[0]["stopped"] == out[1]["stopped"] is not None
    stopped = out[0]["stopped"]
    check_stop_step_committed(root, stopped, world_size=2)
    check_resume(root, results, 2, stopped)


@pytest.mark.distributed
def test_time_based_answers_are_rank_0s(tmp_path: Path) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    out = finish(start(2, root, results, scenario="clock"), results)
    assert [o["answers"] for o in out] == [[True, True, True]] * 2


def test_a_second_sigterm_during_the_emergency_save_corrupts_nothing(tmp_path: Path) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    procs = start(1, root, results, total=LONG_RUN, signals=[signal.SIGTERM], slow_emergency=True)
    wait_for(lambda: progress(results, 0) >= 5, procs, "step 5")
    os.kill(procs[0].pid, signal.SIGTERM)
    wait_for(lambda: (results / "saving").exists(), procs, "the emergency save to start writing")
    # While the emergency save is mid-write; with SIGTERM's default action put back too early,
    # this one would kill the process.
    os.kill(procs[0].pid, signal.SIGTERM)
    (results / "second-sent").write_text("")
    (out,) = finish(procs, results)
    assert out["exitcode"] == 128 + signal.SIGTERM, "it exited as preempted, after the save"
    assert out["handler_restored"], "close() put the default action back"
    stopped = out["stopped"]
    check_stop_step_committed(root, stopped)
    check_resume(root, results, 1, stopped)


# --- in this process: the handlers and should_save ------------------------------------------------


@pytest.fixture
def usr1() -> Any:
    """SIGUSR1 ignored by default here, and put back as it was after the test."""
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    yield signal.SIGUSR1
    signal.signal(signal.SIGUSR1, previous)


def test_preemption_is_off_by_default(root: Path) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    with CheckpointManager(root) as mgr:
        assert {s: signal.getsignal(s) for s in before} == before
        assert not mgr.should_save(1) and not mgr.preempted


def test_a_signal_makes_the_next_should_save_true_once(root: Path, usr1: int) -> None:
    signals = [usr1, usr1]  # named twice: installed once
    with CheckpointManager(root, schedule=SaveSchedule(every=10), preemption_signals=signals) as mgr:
        assert signal.getsignal(usr1) != signal.SIG_IGN
        assert not mgr.should_save(1)
        os.kill(os.getpid(), usr1)
        assert not mgr.preempted, "decided by should_save, the same way on every rank"
        assert mgr.should_save(2) and mgr.preempted and mgr.preemption_signal == usr1
        assert not mgr.should_save(3), "once per signal"
        assert mgr.should_save(10) and mgr.preempted
    assert signal.getsignal(usr1) == signal.SIG_IGN, "close() put the previous handler back"


def test_handlers_chain_python_handlers_only() -> None:
    calls: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        handlers = PreemptionHandlers([signal.SIGUSR1, signal.SIGINT])
        handlers.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handlers.take() == signal.SIGUSR1 and calls == [signal.SIGUSR1]
        # Python's default SIGINT handler is not chained: it would raise KeyboardInterrupt mid-save
        os.kill(os.getpid(), signal.SIGINT)
        assert handlers.take() == signal.SIGINT and handlers.take() is None
        handlers.restore()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == [signal.SIGUSR1] * 2 and handlers.take() is None
    finally:
        signal.signal(signal.SIGUSR1, previous)
        signal.signal(signal.SIGINT, old_int)


def test_restore_leaves_a_handler_installed_after_ours_which_then_acts_as_the_one_before(
    usr1: int,
) -> None:
    calls: list[str] = []
    signal.signal(usr1, lambda signum, frame: calls.append("before"))
    handlers = PreemptionHandlers([usr1])
    handlers.install()
    ours = signal.getsignal(usr1)

    def theirs(signum: int, frame: Any) -> None:  # installed after ours, and chains to it
        calls.append("theirs")
        ours(signum, frame)  # type: ignore[operator]

    signal.signal(usr1, theirs)
    handlers.restore()
    assert signal.getsignal(usr1) is theirs
    os.kill(os.getpid(), usr1)
    assert calls == ["theirs", "before"]
    assert handlers.take() is None, "a closed manager's handler records nothing"


@pytest.mark.parametrize("value", [signal.SIGKILL, "SIGTERM", 10_000], ids=["sigkill", "name", "number"])
def test_signals_that_cannot_announce_a_preemption_are_refused(root: Path, value: Any) -> None:
    with pytest.raises(ConfigError, match="preemption_signals"):
        CheckpointManager(root, preemption_signals=[value])
    assert not root.exists()


def test_handlers_need_the_main_thread(root: Path) -> None:
    errors: list[BaseException] = []

    def create() -> None:
        try:
            CheckpointManager(root, preemption_signals=[signal.SIGTERM])
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=create)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], ConfigError) and "main thread" in str(errors[0])
