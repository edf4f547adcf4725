"""Async saves: staging, queue semantics, cancellation, failures, and the top-k race."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from safeckpt import CheckpointManager, Retention, SaveFailedError, read_record
from safeckpt._fs.fileops import FileOps
from safeckpt._ops.maintenance import verify
from toy import make_state, same_weights, train_step, weights

Match = Callable[[Path], bool]


def is_train_state(step: int) -> Match:
    return lambda p: p.name.startswith("train_state") and p.parent.name.startswith(f"step_{step}.")


def is_record(step: int) -> Match:
    return lambda p: p.name.startswith(".metadata.json.tmp") and p.parent.name.startswith(f"step_{step}.")


class GatedOps(FileOps):
    """Holds the writer at chosen writes until the test opens the gate; logs every operation."""

    def __init__(self) -> None:
        self.gates: list[tuple[Match, threading.Event, threading.Event]] = []
        self.log: list[tuple[str, str]] = []
        self.fail: dict[str, OSError] = {}
        self._lock = threading.Lock()

    def gate(self, match: Match) -> tuple[threading.Event, threading.Event]:
        """(reached, release): ``reached`` is set when the writer waits there."""
        reached, release = threading.Event(), threading.Event()
        self.gates.append((match, reached, release))
        return reached, release

    def _note(self, op: str, path: Path) -> None:
        with self._lock:
            self.log.append((op, str(path)))

    def write_file(self, path: Path, data: bytes) -> None:
        self._note("write_file", path)
        for match, reached, release in self.gates:
            if match(path):
                reached.set()
                assert release.wait(60), "the test never opened the gate"
        for marker, error in self.fail.items():
            if marker in str(path):
                raise error
        super().write_file(path, data)

    def replace(self, src: Path, dst: Path) -> None:
        self._note("replace", src)
        super().replace(src, dst)

    def rmtree(self, path: Path) -> None:
        self._note("rmtree", path)
        super().rmtree(path)


def test_save_returns_before_the_write_and_commits_later(root: Path) -> None:
    ops = GatedOps()
    reached, release = ops.gate(is_train_state(1))
    with CheckpointManager(root, file_ops=ops) as mgr:
        mgr.save(1, make_state())
        assert reached.wait(30)
        assert mgr.latest_step is None and not (root / "step_1").exists()
        assert [c.status for c in mgr.checkpoints()] == ["writing"]
        release.set()
        mgr.wait()
        assert mgr.latest_step == 1
    assert os.readlink(root / "latest") == "step_1"


def test_state_is_captured_at_save_time(root: Path) -> None:
    ops = GatedOps()
    _, release = ops.gate(is_train_state(1))
    state = make_state()
    train_step(state)
    before = weights(state)
    with CheckpointManager(root, file_ops=ops) as mgr:
        mgr.save(1, state)
        with torch.no_grad():
            for p in state["model"].parameters():
                p.fill_(42.0)  # the next optimizer step, say, while the write is still pending
        release.set()
        mgr.wait()
    fresh = make_state(seed=3)
    with CheckpointManager(root) as mgr:
        mgr.restore(fresh)
    assert same_weights(weights(fresh), before)


def test_staging_buffers_are_reused_and_reallocated_on_shape_change(root: Path) -> None:
    state = make_state()
    with CheckpointManager(root) as mgr:
        slot = mgr._pool.slots[0]  # type: ignore[union-attr]
        mgr.save(1, state)
        allocated = slot.allocations
        assert allocated > 0
        for step in (2, 3, 4):
            train_step(state)
            mgr.save(step, state)
        assert slot.allocations == allocated
        mgr.flush()
        state["model"][3] = torch.nn.Linear(32, 3)  # structure changes after flush
        state["model"].zero_grad(set_to_none=True)
        state["optim"] = torch.optim.AdamW(state["model"].parameters())
        mgr.save(5, state)
        mgr.wait()
        assert slot.allocations > allocated
    fresh = make_state()
    fresh["model"][3] = torch.nn.Linear(32, 3)
    fresh["optim"] = torch.optim.AdamW(fresh["model"].parameters())
    with CheckpointManager(root) as mgr:
        assert mgr.restore(fresh).step == 5
    assert same_weights(weights(fresh), weights(state))


def _call_in_thread(fn: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_save_waits_for_the_staging_slot_not_the_whole_write(root: Path) -> None:
    ops = GatedOps()
    _, release_record = ops.gate(is_record(1))  # commit of step 1 held: its data is on disk
    state = make_state()
    with CheckpointManager(root, file_ops=ops, queue_depth=1) as mgr:
        mgr.save(1, state)
        second = _call_in_thread(lambda: mgr.save(2, state))
        second.join(timeout=30)
        assert not second.is_alive(), "save() waited for the previous commit, not for the slot"
        assert mgr.latest_step is None
        release_record.set()
        mgr.wait()
        assert mgr.latest_step == 2


def test_save_waits_while_the_previous_data_is_being_written(root: Path) -> None:
    ops = GatedOps()
    reached, release = ops.gate(is_train_state(1))  # step 1's data write held: its slot is busy
    state = make_state()
    with CheckpointManager(root, file_ops=ops, queue_depth=1) as mgr:
        mgr.save(1, state)
        assert reached.wait(30)
        second = _call_in_thread(lambda: mgr.save(2, state))
        second.join(timeout=0.5)
        assert second.is_alive(), "with one slot, save() must wait for the slot"
        release.set()
        second.join(timeout=30)
        assert not second.is_alive()
        mgr.wait()


def touched(ops: GatedOps, step: int) -> list[tuple[str, str]]:
    return [(op, p) for op, p in ops.log if f"/step_{step}." in p or p.endswith(f"/step_{step}")]


def test_queued_save_out_of_retention_is_cancelled_and_never_written(root: Path) -> None:
    ops = GatedOps()
    reached, release = ops.gate(is_train_state(1))
    state = make_state()
    with CheckpointManager(root, file_ops=ops, queue_depth=4, retention=Retention(keep_last=1)) as mgr:
        mgr.save(1, state)
        assert reached.wait(30)
        for step in (2, 3, 4):
            mgr.save(step, state)
        statuses = {c.step: c.status for c in mgr.checkpoints()}
        assert statuses == {1: "writing", 2: "queued", 3: "queued", 4: "queued"}
        release.set()
        mgr.wait()
    assert touched(ops, 2) == [] and touched(ops, 3) == []
    assert not (root / "step_2").exists() and not (root / "step_3").exists()
    assert sorted(p.name for p in root.glob("step_*")) == ["step_4"]


def test_checkpoint_being_written_is_removed_only_after_its_write(root: Path) -> None:
    ops = GatedOps()
    reached, release = ops.gate(is_train_state(1))
    state = make_state()
    with CheckpointManager(root, file_ops=ops, queue_depth=4, retention=Retention(keep_last=1)) as mgr:
        mgr.save(1, state)
        assert reached.wait(30)
        mgr.save(2, state)  # step 1 now falls out of retention while it is being written
        assert not (root / "step_1").exists() and not list((root / ".trash").glob("step_1.*"))
        release.set()
        mgr.wait()
    ops_on_1 = touched(ops, 1)
    committed_at = next(i for i, (op, p) in enumerate(ops_on_1) if op == "replace" and ".staging" in p)
    trashed_at = next(i for i, (op, p) in enumerate(ops_on_1) if op == "replace" and p.endswith("/step_1"))
    assert committed_at < trashed_at
    assert sorted(p.name for p in root.glob("step_*")) == ["step_2"]


@pytest.fixture(
    params=[
        pytest.param((errno.ENOSPC, "No space left on device"), id="ENOSPC"),
        pytest.param((errno.EIO, "Input/output error"), id="EIO"),
        pytest.param((errno.EACCES, "Permission denied"), id="EACCES"),
    ]
)
def one_failure(request: pytest.FixtureRequest) -> Iterator[GatedOps]:
    """The write of step 2 fails with a disk-full, an I/O or a permission error."""
    ops = GatedOps()
    ops.fail["/step_2."] = OSError(*request.param)
    yield ops


def _assert_only_step_1(root: Path) -> None:
    assert os.readlink(root / "latest") == "step_1"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1"]
    assert list((root / ".staging").iterdir()) == []


def test_failed_background_write_surfaces_once_at_wait(root: Path, one_failure: GatedOps) -> None:
    state = make_state()
    with CheckpointManager(root, file_ops=one_failure) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        with pytest.raises(SaveFailedError, match=r"step 2 failed: rank 0: \w*Error: \[Errno") as info:
            mgr.wait()
        assert isinstance(info.value.cause, OSError)
        assert info.value.cause.errno == one_failure.fail["/step_2."].errno
        assert info.value.__cause__ is info.value.cause
        assert info.value.step == 2
        _assert_only_step_1(root)
        mgr.wait()  # raised once, then cleared
        mgr.save(3, state)
        mgr.wait()
        assert mgr.latest_step == 3


def test_failed_background_write_surfaces_at_next_save(root: Path, one_failure: GatedOps) -> None:
    state = make_state()
    with CheckpointManager(root, file_ops=one_failure) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        mgr._writer.wait_idle()  # type: ignore[union-attr]
        _assert_only_step_1(root)
        with pytest.raises(SaveFailedError, match="step 2") as info:
            mgr.save(3, state)
        # the failure of step 2 is raised once; the new save was taken all the same
        assert "save(step=3)" in str(info.value) and "taken" in str(info.value)
        mgr.wait()
        assert mgr.latest_step == 3
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1", "step_3"]


def test_failed_background_write_surfaces_at_close(root: Path, one_failure: GatedOps) -> None:
    state = make_state()
    mgr = CheckpointManager(root, file_ops=one_failure)
    mgr.save(1, state)
    mgr.save(2, state)
    with pytest.raises(SaveFailedError, match="step 2"):
        mgr.close()
    _assert_only_step_1(root)
    mgr.close()  # idempotent, and the error is not raised twice


class _Broken:
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("dataloader worker died")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_state_dict_that_raises_fails_the_save_cleanly(root: Path) -> None:
    state = make_state()
    with CheckpointManager(root) as mgr:
        mgr.save(1, state)
        state["loader"] = _Broken()
        with pytest.raises(SaveFailedError, match="dataloader worker died"):
            mgr.save(2, state)
        mgr.wait()
        del state["loader"]
        mgr.save(3, state)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1", "step_3"]


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs: DCP's own writes fail with ENOSPC."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_real_enospc_from_dcp_leaves_previous_checkpoints(tiny_disk: Path) -> None:
    root = tiny_disk / "ckpt"
    small = {"w": torch.ones(1000)}
    with CheckpointManager(root) as mgr:
        mgr.save(1, small)
        mgr.wait()
        mgr.save(2, {"w": torch.ones(1_000_000)})  # 4 MB does not fit
        with pytest.raises(SaveFailedError, match=r"step 2 failed: .*free space where the root is"):
            mgr.wait()
        mgr.save(3, small)
        mgr.wait()
        assert mgr.latest_step == 3
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1", "step_3"]
    assert list((root / ".staging").iterdir()) == []


class SlowWriteOps(GatedOps):
    """Every data write sleeps a little: saves come faster than the writer."""

    def write_file(self, path: Path, data: bytes) -> None:
        if path.name.startswith("train_state"):
            threading.Event().wait(0.002)
        super().write_file(path, data)


def race(root: Path, iterations: int) -> None:
    """The reference issue: top-k by an improving metric, saves faster than the writer."""
    ops = SlowWriteOps()
    state = {"w": torch.zeros(64)}
    retention = Retention(keep_best=2, metric="val_loss", mode="min")
    with CheckpointManager(root, file_ops=ops, queue_depth=3, retention=retention) as mgr:
        for step in range(1, iterations + 1):
            state["w"].fill_(float(step))
            mgr.save(step, state, metrics={"val_loss": 1.0 / step})
        mgr.wait()
        cancelled = {s for s in range(1, iterations + 1) if not touched(ops, s)}
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_{iterations - 1}", f"step_{iterations}"]
    assert cancelled, "saves came faster than the writer, so some must have been cancelled"
    for step in cancelled:  # a cancelled checkpoint never reaches the disk
        assert not any(".staging/step_" + str(step) + "." in p for _, p in ops.log)
    staging_removals = [p for op, p in ops.log if op == "rmtree" and ".staging" in p]
    assert staging_removals == [], "nothing being written is ever removed"
    for step in (iterations - 1, iterations):
        assert verify(root, step) == {step: []}
        fresh = {"w": torch.zeros(64)}
        with CheckpointManager(root) as mgr:
            assert mgr.restore(fresh, step=step).step == step
        assert torch.equal(fresh["w"], torch.full((64,), float(step)))
    assert list((root / ".trash").iterdir()) == []
    record = read_record(root / f"step_{iterations}")
    assert record is not None and record.metrics == {"val_loss": 1.0 / iterations}


def test_async_topk_race_is_closed(root: Path) -> None:
    race(root, iterations=200)


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(20))
def test_async_topk_race_is_closed_repeatedly(tmp_path: Path, attempt: int) -> None:
    race(tmp_path / f"ckpt{attempt}", iterations=300)


@pytest.mark.parametrize("depth", [1, 3])
def test_staging_memory_is_one_copy_per_slot_not_per_save(root: Path, depth: int) -> None:
    state = {"w": torch.ones(1 << 20), "b": torch.ones(1000, dtype=torch.float64)}
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    with CheckpointManager(root, queue_depth=depth) as mgr:
        pool = mgr._pool  # type: ignore[union-attr]
        for step in range(1, 9):
            mgr.save(step, state)
            assert pool.nbytes <= depth * state_bytes
        mgr.wait()
        assert sum(slot.allocations for slot in pool.slots) <= depth * len(state)
    sync_root = root.parent / "sync"
    with CheckpointManager(sync_root, async_save=False) as mgr:
        assert mgr._pool is None  # sync saves write straight from the live tensors
        mgr.save(1, state)


def test_exit_without_close_still_commits_queued_saves(root: Path) -> None:
    script = f"""
import torch, time
from pathlib import Path
from safeckpt import CheckpointManager
from safeckpt._fs.fileops import FileOps

class Slow(FileOps):
    def write_file(self, path, data):
        if path.name.startswith("train_state"):
            time.sleep(0.5)
        super().write_file(path, data)

mgr = CheckpointManager({str(root)!r}, file_ops=Slow())
mgr.save(1, {{"w": torch.ones(10)}})
# no close(): the interpreter exits while the write is still pending
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "without close()" in done.stderr
    assert os.readlink(root / "latest") == "step_1"
