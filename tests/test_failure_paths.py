"""Failure paths that end cleanly (issue 10): one writer per root, free readers, one terminal state
per save, errors every rank agrees on, no raw errors.

Real processes share real roots here (a second writer, an evaluation reader, an owner SIGKILLed
mid-save), real gloo ranks disagree, and faults enter through the FileOps seam only.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import failure_worker
import safeckpt.errors
from failure_worker import filled
from faults import MUTATIONS, FaultyFileOps
from forkserver import context
from safeckpt import (
    CheckpointError,
    CheckpointManager,
    ConfigError,
    ManagerClosedError,
    Retention,
    SaveFailedError,
    load,
    read_record,
)
from safeckpt._fs.fileops import FileOps
from safeckpt._ops.maintenance import verify
from safeckpt._root.ownership import Owner, read_owner
from safeckpt._util.processes import process_start as _process_start
from safeckpt.errors import RootInUseError

# --- helpers -------------------------------------------------------------------------------------


def start(target: Callable[..., Any], *args: Any) -> Any:
    proc = context().Process(target=target, args=args)
    proc.start()
    return proc


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, what: str = "the condition") -> Any:
    """Poll ``predicate`` until it is truthy; a generous bound on a hang, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"{what} did not happen within {timeout} s")


def log_lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def staging(root: Path) -> list[Path]:
    try:
        return sorted((root / ".staging").iterdir())
    except FileNotFoundError:
        return []


def steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*"))


def fresh() -> dict[str, Any]:
    return filled(0)


def is_train_state(step: int) -> Callable[[tuple[Path, ...]], bool]:
    return lambda paths: any(
        p.name.startswith("train_state") and p.parent.name.startswith(f"step_{step}.") for p in paths
    )


def staging_to_trash(paths: tuple[Path, ...]) -> bool:
    return len(paths) == 2 and paths[0].parent.name == ".staging" and paths[1].parent.name == ".trash"


def prune_rename(step: int) -> Callable[[tuple[Path, ...]], bool]:
    return lambda paths: (
        len(paths) == 2 and paths[0].name == f"step_{step}" and paths[1].parent.name == ".trash"
    )


def touching_private_dirs(ops: FaultyFileOps) -> list[Any]:
    private = {".staging", ".trash"}
    return [c for c in ops.calls if any(private & set(p.parts) for p in c.paths)]


# --- one writer per root, free readers -----------------------------------------------------------


def test_a_second_writer_gets_root_in_use_and_leaves_the_first_ones_saves_alone(
    root: Path, tmp_path: Path
) -> None:
    log = tmp_path / "writer.log"
    steps = 12
    writer = start(failure_worker.writer_job, str(root), str(log), steps, 0.25)
    try:
        wait_for(lambda: staging(root), what="the first writer's save in .staging")
        ops = FaultyFileOps()
        with pytest.raises(RootInUseError, match=f"pid {writer.pid} on ") as info:
            CheckpointManager(root, lock_timeout=0.5, file_ops=ops)  # refused before it restores
        assert info.value.owner["pid"] == writer.pid
        assert "one writer at a time" in str(info.value)
        assert [c for c in ops.calls if c.op in MUTATIONS] == [], "the second job wrote nothing"
        writer.join(120)
    finally:
        writer.kill()
    assert writer.exitcode == 0, log_lines(log)
    assert log_lines(log) == ["started"] + [f"committed {s}" for s in range(1, steps + 1)] + ["closed"]
    assert steps_on_disk(root) == list(range(1, steps + 1))
    assert staging(root) == [] and list((root / ".trash").iterdir()) == []


def test_an_evaluation_reader_restoring_in_a_loop_costs_the_writer_nothing(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "writer.log"
    steps = 30
    writer = start(failure_worker.writer_job, str(root), str(log), steps, 0.02, 3)
    restored: list[int | None] = []
    ops = FaultyFileOps()

    def evaluate() -> None:
        state = fresh()
        with CheckpointManager(root, file_ops=ops, read_only=True) as reader:
            result = reader.restore(state)
        restored.append(result.step)
        if result:  # whatever it loaded is whole: every value is the step's
            assert torch.equal(state["w"], torch.full((256,), float(result.step)))
            assert state["step_count"] == result.step

    try:
        wait_for(lambda: "started" in log_lines(log), what="the writer's start")
        while writer.is_alive() and len(restored) < 2000:
            evaluate()
        writer.join(120)
    finally:
        writer.kill()
    during = len(restored)
    evaluate()  # and once the writer is done
    assert writer.exitcode == 0, log_lines(log)
    assert log_lines(log) == ["started"] + [f"committed {s}" for s in range(1, steps + 1)] + ["closed"]
    seen = [s for s in restored if s is not None]
    assert seen == sorted(seen), "a reader never goes back: it never sees a broken newest checkpoint"
    assert during >= 2 and seen[-1] == steps
    assert touching_private_dirs(ops) == [], "a reader collects nothing"
    assert not [r for r in caplog.records if "cannot be loaded" in r.getMessage()]
    assert steps_on_disk(root) == [steps - 2, steps - 1, steps]


def test_a_dead_owner_is_taken_over_with_a_warning(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reached = tmp_path / "reached"
    owner = start(failure_worker.owner_that_hangs, str(root), str(reached))
    try:
        wait_for(reached.exists, what="the owner's hang in the save of step 2")
        record = read_owner(root)
        assert record is not None and record.pid == owner.pid and record.writing
    finally:
        owner.kill()
        owner.join(30)  # reaped: its pid is gone
    assert owner.exitcode == -9
    assert staging(root), "the killed save left its staging directory"
    with (
        caplog.at_level(logging.WARNING, logger="safeckpt"),
        CheckpointManager(root, async_save=False, lock_timeout=5) as mgr,
    ):
        mgr.save(3, filled(3))
        mine = read_owner(root)
        assert mine is not None and mine.pid == os.getpid() and mine.writing
    takeovers = [r.getMessage() for r in caplog.records if "dead owner" in r.getMessage()]
    assert len(takeovers) == 1 and f"pid {owner.pid} " in takeovers[0]
    assert steps_on_disk(root) == [1, 3]
    assert staging(root) == []
    assert read_owner(root) is None, "close() gave the root up"


def test_an_owner_killed_but_not_yet_reaped_is_dead(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A SIGKILLed process whose parent has not waited for it yet (a zombie) still answers kill(0);
    it can write nothing, so its root is taken over, not waited for."""
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, filled(1))
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        record = Owner(
            host=socket.gethostname(),
            pid=sleeper.pid,
            token="a-killed-job",
            started=time.time(),
            heartbeat=time.time(),
            writing=True,
            pid_start=_process_start(sleeper.pid),
        )
        (root / ".owner").write_text(json.dumps(record.to_json()))
        sleeper.kill()
        wait_for(lambda: Path(f"/proc/{sleeper.pid}/stat").read_text().split(")")[-1].split()[0] == "Z")
        with CheckpointManager(root, async_save=False, lock_timeout=2) as mgr:
            mgr.save(2, filled(2))
        assert any("dead owner" in r.getMessage() for r in caplog.records)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert steps_on_disk(root) == [1, 2]


@pytest.fixture
def read_only_view(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(source, view): ``view`` is a read-only bind mount of ``source``."""
    source, view = tmp_path / "ckpt", tmp_path / "ro"
    source.mkdir()
    view.mkdir()
    done = subprocess.run(["mount", "--bind", str(source), str(view)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root and mount rights): {done.stderr.strip()}")
    try:
        done = subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {done.stderr.strip()}")
        yield source, view
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False)


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(root.rglob("*"))
    }


def test_restore_from_a_read_only_root(read_only_view: tuple[Path, Path]) -> None:
    source, view = read_only_view
    with CheckpointManager(source, async_save=False) as mgr:
        mgr.save(1, filled(1))
        mgr.save(2, filled(2))
    with pytest.raises(OSError) as info:
        (view / "probe").touch()
    assert info.value.errno == errno.EROFS
    before = tree(source)
    state = fresh()
    with CheckpointManager(view) as mgr:
        assert mgr.restore(state).step == 2
        assert torch.equal(state["w"], torch.full((256,), 2.0)) and state["step_count"] == 2
        assert mgr.latest_step == 2 and [s.step for s in mgr.checkpoints()] == [1, 2]
        older = fresh()
        assert mgr.restore(older, step=1).step == 1 and older["step_count"] == 1
    assert load(view)["step_count"] == 2
    assert tree(source) == before, "a reader writes nothing"


def test_verify_during_pruning_never_reports_a_healthy_root_broken(root: Path) -> None:
    stop = threading.Event()
    reports: list[dict[int, list[str]]] = []
    errors: list[BaseException] = []

    def verifier() -> None:
        while not stop.is_set():
            try:
                reports.append(verify(root))
            except BaseException as e:  # anything at all is a false alarm
                errors.append(e)

    with CheckpointManager(root, retention=Retention(keep_last=1)) as mgr:
        mgr.save(0, filled(0))
        mgr.wait()
        thread = threading.Thread(target=verifier, name="verifier")
        thread.start()
        try:
            for step in range(1, 41):
                mgr.save(step, filled(step))
            mgr.wait()
            wait_for(lambda: len(reports) >= 5, what="five verify runs")
        finally:
            stop.set()
            thread.join(60)
    assert errors == []
    alarms = [report for report in reports if any(report.values())]
    assert alarms == [], f"false alarms in {len(alarms)} of {len(reports)} runs: {alarms[:3]}"
    assert steps_on_disk(root) == [40]


# --- every save ends, in one terminal state --------------------------------------------------------


class SlowStateful:
    """A Stateful whose state_dict() takes 0.3 s (a data loader gathering its workers' state)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        time.sleep(0.3)
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def test_close_racing_a_save_from_another_thread_orders_them_or_refuses_the_save(tmp_path: Path) -> None:
    outcomes = []
    for i in range(8):
        root = tmp_path / f"ckpt{i}"
        mgr = CheckpointManager(root, async_save=i % 2 == 0)
        result: dict[str, Any] = {}
        entered = threading.Event()

        def saver(
            mgr: CheckpointManager = mgr, result: dict[str, Any] = result, entered: Any = entered
        ) -> None:
            entered.set()
            try:
                mgr.save(1, {"w": torch.ones(8), "loader": SlowStateful(1)})
                result["outcome"] = "returned"
            except ManagerClosedError:
                result["outcome"] = "refused"
            except BaseException as e:  # reported by the assertion below
                result["outcome"] = e

        thread = threading.Thread(target=saver)
        thread.start()
        entered.wait(10)
        if i < 6:
            time.sleep(0.1)  # close() comes while state_dict() runs (most rounds)
        mgr.close()
        committed = (root / "step_1").is_dir() and read_record(root / "step_1") is not None
        thread.join(30)
        assert not thread.is_alive()
        outcome = result.get("outcome")
        if outcome == "returned":
            assert committed, f"round {i}: save() returned, but step 1 was not committed by close()"
        else:
            assert outcome == "refused", f"round {i}: {outcome!r}"
            assert not (root / "step_1").exists()
        outcomes.append(outcome)
    assert "returned" in outcomes


@pytest.mark.parametrize("ending", ["sync", "wait", "close"])
def test_a_failed_save_whose_cleanup_fails_too_is_reported_and_ends(root: Path, ending: str) -> None:
    ops = FaultyFileOps()
    ops.fail("write_file", errno.ENOSPC, match=is_train_state(2))
    cleanup = ops.fail("replace", errno.EIO, match=staging_to_trash)
    keep = Retention(keep_last=1)
    mgr = CheckpointManager(root, async_save=ending != "sync", retention=keep, file_ops=ops)
    mgr.save(1, filled(1))
    mgr.wait()
    if ending == "sync":
        with pytest.raises(SaveFailedError, match="step 2"):
            mgr.save(2, filled(2))
    else:
        mgr.save(2, filled(2))
        with pytest.raises(SaveFailedError, match="step 2"):
            if ending == "wait":
                mgr.wait()
            else:
                mgr.close()
    assert cleanup.fired == 1, "the cleanup of the failed save failed as well"
    if ending == "close":  # close() cleaned up before raising: the root is free for the next writer
        with CheckpointManager(root, async_save=False, retention=keep, lock_timeout=2) as again:
            again.save(3, filled(3))
    else:
        assert [s.step for s in mgr.checkpoints()] == [1], "step 2 is neither in flight nor kept"
        mgr.save(3, filled(3))
        mgr.wait()
        mgr.close()  # nothing left to raise
    assert steps_on_disk(root) == [3]


class GateOps(FileOps):
    """Holds the first matching write, rename or symlink until ``release`` is set."""

    def __init__(self) -> None:
        self.match: Callable[[str, Path], bool] | None = None
        self.reached, self.release = threading.Event(), threading.Event()

    def _gate(self, op: str, path: Path) -> None:
        match = self.match
        if match is not None and match(op, path):
            self.match = None
            self.reached.set()
            assert self.release.wait(60), "the test never opened the gate"

    def write_file(self, path: Path, data: bytes) -> None:
        self._gate("write_file", path)
        super().write_file(path, data)

    def replace(self, src: Path, dst: Path) -> None:
        self._gate("replace", dst)
        super().replace(src, dst)

    def symlink(self, target: str, link: Path) -> None:
        self._gate("symlink", link)
        super().symlink(target, link)


GATES: dict[str, Callable[[str, Path], bool]] = {
    # before the commit: the pin lands in the job
    "writing": lambda op, p: op == "write_file" and p.name.startswith("train_state"),
    # inside the commit, under the sidecar lock: the record is being written
    "record": lambda op, p: op == "write_file" and p.name.startswith(".metadata.json.tmp"),
    # renamed into place, `latest` not yet moved
    "latest": lambda op, p: op == "symlink",
}


@pytest.mark.parametrize("where", list(GATES))
def test_a_pin_racing_the_commit_of_its_step_keeps_the_pin(root: Path, where: str) -> None:
    ops = GateOps()
    with CheckpointManager(root, retention=Retention(keep_last=1), file_ops=ops) as mgr:
        mgr.save(1, filled(1))
        mgr.wait()
        ops.match = GATES[where]
        mgr.save(2, filled(2))
        assert ops.reached.wait(30)
        errors: list[BaseException] = []

        def pin() -> None:
            try:
                mgr.pin(2)
            except BaseException as e:  # asserted below
                errors.append(e)

        pinner = threading.Thread(target=pin)
        pinner.start()
        pinner.join(0.3)  # let it reach the view or the lock the commit holds
        ops.release.set()
        pinner.join(30)
        mgr.wait()
        assert errors == []
        for step in (3, 4):
            mgr.save(step, filled(step))
            mgr.wait()
        statuses = {s.step: s for s in mgr.checkpoints()}
        assert statuses[2].pinned and "pinned" in " ".join(statuses[2].kept_because)
    record = read_record(root / "step_2")
    assert record is not None and record.pinned
    assert steps_on_disk(root) == [2, 4]


def test_a_background_failure_surfacing_at_save_takes_the_new_step_and_names_both(root: Path) -> None:
    ops = FaultyFileOps()
    ops.fail("write_file", errno.ENOSPC, match=is_train_state(2))
    with CheckpointManager(root, file_ops=ops) as mgr:
        mgr.save(1, filled(1))
        mgr.wait()
        mgr.save(2, filled(2))
        wait_for(lambda: all(s.step != 2 for s in mgr.checkpoints()), what="the failure of step 2")
        with pytest.raises(SaveFailedError) as info:
            mgr.save(3, filled(3))
        message = str(info.value)
        assert info.value.step == 2
        assert "step 2" in message and "save(step=3)" in message and "taken" in message
        mgr.wait()  # raised once: nothing more to raise
        assert mgr.latest_step == 3
    state = fresh()
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state).step == 3
    assert state["step_count"] == 3 and steps_on_disk(root) == [1, 3]


# --- ranks that agree ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(scenario: str, root: Path, results: Path, ws: int = 2) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``ws`` gloo ranks; each rank's result, in rank order."""
    results.mkdir(parents=True, exist_ok=True)
    for old in results.glob("rank*.json"):
        old.unlink()
    port = free_port()
    procs = [
        start(failure_worker.main, scenario, rank, ws, port, str(root), str(results)) for rank in range(ws)
    ]
    for proc in procs:
        proc.join(180)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    out = []
    for rank in range(ws):
        path = results / f"rank{rank}.json"
        report = json.loads(path.read_text()) if path.exists() else {"exitcode": procs[rank].exitcode}
        assert report.get("ok"), f"rank {rank} failed: {report.get('traceback') or report}"
        out.append(report["result"])
    return out


@pytest.mark.distributed
def test_mismatched_calls_raise_on_every_rank_naming_each_call(tmp_path: Path) -> None:
    out = launch("mismatched_calls", tmp_path / "ckpt", tmp_path / "results")
    errors = [o["error"] for o in out]
    assert all(e is not None and e["type"] == "RankAgreementError" for e in errors), errors
    assert errors[0]["message"] == errors[1]["message"]
    assert errors[0]["failures"] == {"0": "in save(3)", "1": "in close()"}
    assert "rank 0: in save(3)" in errors[0]["message"] and "rank 1: in close()" in errors[0]["message"]
    assert all(o["seconds"] < 30 for o in out), "within seconds, not at the 60 s timeout"


@pytest.mark.distributed
def test_a_damaged_rank1_file_falls_back_on_both_ranks_or_raises_the_same_error(tmp_path: Path) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    assert [o["latest"] for o in launch("save_two_steps", root, results)] == [2, 2]
    damaged = root / "step_2" / "train_state.rank1.safetensors"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    out = launch("restore_past_damage", root, results)
    for rank, o in enumerate(out):
        # each rank fell back to step 1 and loaded its own train state from it
        assert o["auto"] == {"step": 1, "seconds": o["auto"]["seconds"], "w": 1.0, "step_count": 10 + rank}
        assert o["auto"]["seconds"] < 30
    explicit = [o["explicit"] for o in out]
    assert all(e["error"] is not None for e in explicit), explicit
    assert explicit[0]["error"] == explicit[1]["error"], "the same error on every rank"
    error = explicit[0]["error"]
    assert error["rank"] == 1 and "train_state.rank1.safetensors" in error["message"]
    assert all(e["seconds"] < 30 for e in explicit)
    assert issubclass(getattr(safeckpt.errors, error["type"]), CheckpointError)
    # auto-resume moved the damaged step aside, and every rank's view says so
    assert [o["latest"] for o in out] == [1, 1]
    assert not (root / "step_2").exists()
    assert [p.name[:7] for p in (root / ".damaged").iterdir()] == ["step_2."]


@pytest.mark.distributed
def test_latest_step_and_checkpoints_answer_the_same_on_every_rank(tmp_path: Path) -> None:
    out = launch("shared_view", tmp_path / "ckpt", tmp_path / "results")
    assert out[0] == out[1]
    view = out[1]
    assert view["after_saves"]["latest"] == 4
    assert [c[0] for c in view["after_saves"]["checkpoints"]] == [1, 3, 4]
    assert view["after_saves"]["checkpoints"][0][2] is True  # pinned, on rank 1 too
    assert [c[0] for c in view["after_unpin"]["checkpoints"]] == [3, 4]
    assert view["reopened"]["latest"] == 4 and [c[0] for c in view["reopened"]["checkpoints"]] == [3, 4]


# --- no raw errors ------------------------------------------------------------------------------


def test_a_root_that_is_a_file_is_a_config_error(root: Path) -> None:
    root.write_text("not a directory")
    with pytest.raises(ConfigError, match="is a file"):
        CheckpointManager(root)


@pytest.mark.parametrize(
    "setting",
    [
        {"retry_interval": 0},
        {"retry_interval": -1},
        {"timeout": 0},
        {"lock_timeout": -1},
        {"drain_timeout": -1},
    ],
    ids=lambda s: "{}={}".format(*next(iter(s.items()))),
)
def test_bad_timeouts_are_config_errors(root: Path, setting: dict[str, float]) -> None:
    name = next(iter(setting))
    with pytest.raises(ConfigError, match=name):
        CheckpointManager(root, **setting)
    assert not (root / ".owner").exists()


class PruneRaises(FileOps):
    """The rename of a pruned checkpoint into the trash raises something that is not an OSError."""

    def replace(self, src: Path, dst: Path) -> None:
        if src.name.startswith("step_") and dst.parent.name == ".trash":
            raise RuntimeError("injected: the pruning rename broke")
        super().replace(src, dst)


@pytest.mark.parametrize("fault", ["prune-oserror", "prune-runtimeerror", "pin-refresh"])
def test_a_sync_save_whose_bookkeeping_fails_after_the_commit_does_not_raise(
    root: Path, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    ops: FileOps = FileOps()
    if fault == "prune-oserror":
        ops = FaultyFileOps()
        ops.fail("replace", errno.EIO, match=prune_rename(1), times=None)
    elif fault == "prune-runtimeerror":
        ops = PruneRaises()
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=1), file_ops=ops) as mgr:
        mgr.save(1, filled(1))
        if fault == "pin-refresh":  # the pinned checkpoint's record cannot be re-read before pruning
            mgr.pin(1)
            (root / "step_1" / "metadata.json").unlink()
            (root / "step_1" / "metadata.json").mkdir()
        with caplog.at_level(logging.WARNING, logger="safeckpt"):
            mgr.save(2, filled(2))  # committed: whatever pruning then hits, it does not raise
        assert mgr.latest_step == 2
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings
    record = read_record(root / "step_2")
    assert record is not None and record.committed
    assert os.readlink(root / "latest") == "step_2"


class _DrainExplodes(FileOps):
    """Deleting from the trash raises something that is not an OSError (a bug, say)."""

    def rmtree(self, path: Path) -> None:
        raise RuntimeError("the deleter broke")


def _fds_under(path: Path) -> list[str]:
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(str(path)):
            found.append(target)
    return found


def test_close_stops_its_threads_and_releases_the_lock_even_when_the_drain_raises(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    state = {"w": torch.zeros(8)}
    # Threads alive before (the process-wide S3 transfer pool an earlier test started) are not this
    # manager's to stop.
    before = set(threading.enumerate())
    mgr = CheckpointManager(
        root, async_save=True, retention=Retention(keep_last=1), file_ops=_DrainExplodes()
    )
    for step in (1, 2, 3):
        state["w"].fill_(step)
        mgr.save(step, state)
    mgr.wait()
    with pytest.raises(RuntimeError, match="the deleter broke"):
        mgr.close()
    alive = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("safeckpt-")]
    assert alive == [], alive
    assert _fds_under(root) == []
    assert read_owner(root) is None  # the root is free for the next writer
    mgr.close()  # idempotent
    with CheckpointManager(root) as again:
        assert again.restore({"w": torch.zeros(8)}).step == 3


def test_close_leaves_the_groups_to_the_exit_hook_while_the_writer_thread_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second Ctrl-C can end close()'s join with the writer still inside DCP on its group."""
    from safeckpt._dist.participants import Participants
    from safeckpt._manager.background import BackgroundWriter

    released: list[bool] = []
    monkeypatch.setattr(Participants, "release", lambda self: released.append(True))
    mgr = CheckpointManager(tmp_path / "ckpt", async_save=True)
    mgr.save(1, {"w": torch.zeros(4)})
    monkeypatch.setattr(BackgroundWriter, "alive", property(lambda self: True))
    mgr.close()
    assert released == []
    monkeypatch.undo()
    idle = CheckpointManager(tmp_path / "other", async_save=True)
    monkeypatch.setattr(Participants, "release", lambda self: released.append(True))
    idle.close()
    assert released == [True]


def test_a_file_the_staging_listing_misses_is_found_by_name_and_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A directory listing can lag another client's new file (NFS): the commit looks each file the
    # ranks wrote up by name before it calls one missing, so the record lists every file.
    from safeckpt._manager import committer

    real = committer.list_files
    monkeypatch.setattr(
        committer, "list_files", lambda d: {k: v for k, v in real(d).items() if not k.endswith(".distcp")}
    )
    state = {"w": torch.arange(8.0)}
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as mgr:
        mgr.save(1, state)
    record = json.loads((tmp_path / "ckpt" / "step_1" / "metadata.json").read_text())
    data = next((tmp_path / "ckpt" / "step_1").glob("*.distcp"))
    assert record["files"][data.name] == data.stat().st_size
    target = {"w": torch.zeros(8)}
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(target).step == 1
    assert torch.equal(target["w"], state["w"])
