"""The real CheckpointManager on the emulated NFS: the failures of the NFS prune review.

Every test here runs real processes on a real FUSE mount; faults come only from
the filesystem's NFS semantics and from other processes holding files open.
Removal attempts and waits are counted through the ``FileOps`` seam
(``CountingFileOps``), never timed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import toy
from safeckpt import CheckpointManager, Retention, read_record
from safeckpt._root.removal import RETRY_WAITS
from safeckpt.testing import CountingFileOps, FileHolder, Linger, NFSMount

MountFactory = Callable[..., NFSMount]
PASS_SLEEP_CAP = sum(RETRY_WAITS)  # 0.75 s: what one cleanup pass may sleep, however many removals fail
BLOCKED_WARNING = "could not delete pruned checkpoint"


def assert_cleanup_passes_are_bounded(ops: CountingFileOps) -> None:
    """Invariant 5 and the review's cap: a pass sleeps only the shared waits, at most 0.75 s."""
    for cleanup in ops.training_passes():
        assert cleanup.thread == "safeckpt-deleter", cleanup
        assert sum(cleanup.sleeps) <= PASS_SLEEP_CAP + 1e-9, cleanup
        assert cleanup.sleeps == list(RETRY_WAITS[: len(cleanup.sleeps)]), cleanup
        if cleanup.result is not None:  # each attempt ends its entry or precedes one shared wait
            entries = len(cleanup.result.removed) + len(cleanup.result.remaining)
            assert cleanup.rmtrees == entries + len(cleanup.sleeps), cleanup
    assert ops.training_rmtrees == 0 and ops.training_sleeps == []  # training never removes nor waits


# --- helpers ----------------------------------------------------------------------------------


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("safeckpt") and r.levelno >= logging.WARNING
    ]


def committed_steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_"))


def trash(root: Path) -> list[str]:
    return sorted(os.listdir(root / ".trash")) if (root / ".trash").exists() else []


def files_of(directory: Path) -> list[Path]:
    """Every file of a checkpoint (empty when it went away meanwhile)."""
    try:
        return [p for p in directory.rglob("*") if p.is_file()]
    except FileNotFoundError:
        return []


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll until ``predicate()``; the timeout only bounds a hang, it is not what is tested."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def holder() -> Iterator[FileHolder]:
    with FileHolder() as h:
        yield h


# --- saving every step with keep_last=1 --------------------------------------------------------


@pytest.mark.fuse
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_keep_last_1_every_step_removes_all_39_old_checkpoints_without_a_warning(
    nfs_mount: MountFactory, holder: FileHolder, caplog: pytest.LogCaptureFixture, async_save: bool
) -> None:
    # As the review's field run: a reader (another process on the node) keeps each new
    # checkpoint's files open for a moment, so its removal meets .nfs files.
    nfs = nfs_mount(linger=Linger(seed=1, fast_max=0.15))
    root = nfs.path / "ckpt"
    state, ops = toy.make_state(), CountingFileOps()
    mgr = CheckpointManager(root, async_save=async_save, retention=Retention(keep_last=1), file_ops=ops)
    ops.watch(mgr)
    for step in range(1, 41):
        toy.train_step(state)
        mgr.save(step, state)
        latest = mgr.latest_step
        if latest is not None:
            with contextlib.suppress(OSError):  # pruned between the listing and the open
                holder.hold(files_of(root / f"step_{latest}"), seconds=0.1)
    ops.close(mgr)

    assert committed_steps(root) == [40]
    assert trash(root) == [] and os.listdir(root / ".staging") == []
    assert warnings_of(caplog) == []
    stats = nfs.stats()
    assert stats["silly_renames"] > 0 and stats["rmdir_enotempty"] + stats["unlink_ebusy"] > 0
    retried = [c for c in ops.passes if c.sleeps]
    assert retried, "no removal needed a retry: the scenario did not exercise the NFS path"
    assert_cleanup_passes_are_bounded(ops)


# --- a .nfs file that lingers 4 s --------------------------------------------------------------


@pytest.mark.fuse
def test_a_nfs_file_lingering_4s_leaves_nothing_after_close_and_passes_stay_bounded(
    nfs_mount: MountFactory, holder: FileHolder, caplog: pytest.LogCaptureFixture
) -> None:
    nfs = nfs_mount(linger=Linger.constant(0.02))
    root = nfs.path / "ckpt"
    state, ops = toy.make_state(), CountingFileOps()
    mgr = CheckpointManager(
        root, async_save=False, retention=Retention(keep_last=1), retry_interval=0.2, file_ops=ops
    )
    ops.watch(mgr)
    mgr.save(1, state)
    hold = holder.hold(files_of(root / "step_1"))
    mgr.save(2, state)  # step_1 goes to the trash; its removal meets the .nfs files
    wait_for(lambda: any(c.refused for c in ops.training_passes()), "a refused pass")
    nfs.configure(linger=Linger.constant(4.0))  # the server keeps these .nfs files 4 s
    hold.release()
    wait_for(lambda: nfs.stats()["lingering"] > 0, "the close to reach the filesystem")
    nfs.configure(linger=Linger.constant(0.02))
    passes_before = len(ops.training_passes())
    wait_for(lambda: len(ops.training_passes()) >= passes_before + 2, "two passes during the linger")
    toy.train_step(state)
    mgr.save(3, state)
    assert nfs.stats()["lingering"] > 0  # still kept when close() starts draining
    ops.close(mgr)

    assert committed_steps(root) == [3]
    assert trash(root) == []  # the drain budget outlasted the 4 s
    assert 4.0 in nfs.stats()["lingers"]
    refused = [c for c in ops.training_passes() if c.refused]
    assert len(refused) >= 2
    assert_cleanup_passes_are_bounded(ops)
    assert sum(BLOCKED_WARNING in w for w in warnings_of(caplog)) == 1  # warned once, not per pass


# --- ten held checkpoints ---------------------------------------------------------------------


@pytest.mark.fuse
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_ten_checkpoints_held_open_never_block_training_and_go_once_closed(
    nfs_mount: MountFactory,
    holder: FileHolder,
    caplog: pytest.LogCaptureFixture,
    async_save: bool,
) -> None:
    nfs = nfs_mount(linger=Linger(seed=2, fast_max=0.05))
    root = nfs.path / "ckpt"
    state = toy.make_state()
    with CheckpointManager(root, async_save=False) as first:  # keeps everything
        for step in range(1, 11):
            toy.train_step(state)
            first.save(step, state)
    hold = holder.hold([f for step in range(1, 11) for f in files_of(root / f"step_{step}")])

    ops = CountingFileOps()
    mgr = CheckpointManager(
        root, async_save=async_save, retention=Retention(keep_last=1), retry_interval=0.2, file_ops=ops
    )
    ops.watch(mgr)
    toy.train_step(state)
    mgr.save(11, state)  # prunes steps 1..10, whose files stay open
    wait_for(
        lambda: any(c.refused == 10 for c in ops.training_passes()),
        "a pass that all ten held checkpoints refused",
    )
    for step in range(12, 16):  # training goes on while the deleter keeps failing
        toy.train_step(state)
        mgr.save(step, state)
    mgr.wait()
    wait_for(lambda: len(ops.training_passes()) >= 4, "the deleter to retry in later passes")
    assert len(trash(root)) >= 10  # retried, not given up on, not lost
    held_passes = [c for c in ops.training_passes() if c.refused >= 10]
    assert all(c.sleeps == list(RETRY_WAITS) for c in held_passes)  # 0.75 s, not 10 x 0.75 s

    hold.release()
    wait_for(lambda: trash(root) == [], "the deleter to remove them once the files closed")
    ops.close(mgr)

    assert committed_steps(root) == [15]
    assert_cleanup_passes_are_bounded(ops)
    warned = [w for w in warnings_of(caplog) if BLOCKED_WARNING in w]
    assert len(warned) == 10  # once per checkpoint, however many passes it failed
    recovered = [r for r in caplog.records if "after earlier failures" in r.getMessage()]
    assert len(recovered) == 10


# --- amending a record that another process has open ---------------------------------------------

POLLER = r"""
import errno, json, os, sys, time
path, stop, out = sys.argv[1:4]
seen = {"old": 0, "new": 0, "torn": 0, "missing": 0, "stale": 0}
while not os.path.exists(stop):
    try:
        with open(path, "rb") as f:
            raw = f.read()
            time.sleep(0.002)  # keep it open a moment, so replacements meet an open file
    except FileNotFoundError:
        seen["missing"] += 1
        continue
    except OSError as e:  # ESTALE: the open met a replacement; NFS readers open again
        if e.errno != errno.ESTALE:
            raise
        seen["stale"] += 1
        continue
    try:
        record = json.loads(raw)
        seen["new" if record["pinned"] else "old"] += record["step"] == 1 and record["status"] == "committed"
    except (ValueError, KeyError, TypeError):
        seen["torn"] += 1
with open(out, "w") as f:
    json.dump(seen, f)
"""


@pytest.mark.fuse
def test_amending_a_record_that_another_process_has_open_is_atomic(
    nfs_mount: MountFactory, holder: FileHolder, tmp_path: Path
) -> None:
    nfs = nfs_mount(linger=Linger.constant(0.05))
    root = nfs.path / "ckpt"
    record = root / "step_1" / "metadata.json"
    state = toy.make_state()
    mgr = CheckpointManager(root, async_save=False)
    mgr.save(1, state)
    mgr.save(2, state)
    original = record.read_bytes()
    hold = holder.hold([record])  # the old record stays open in another process
    stop, out = tmp_path / "stop", tmp_path / "seen.json"
    poller = subprocess.Popen([sys.executable, "-c", POLLER, str(record), str(stop), str(out)])
    try:
        for _ in range(15):
            mgr.pin(1)
            mgr.unpin(1)
        mgr.pin(1)
        # Each replacement of a record open elsewhere (the holder's, the poller's) left a .nfs
        # copy; the holder's is the original record, which it can still read.
        copies = []
        for name in os.listdir(root / "step_1"):
            with contextlib.suppress(FileNotFoundError):  # the poller's copies go as it closes them
                if name.startswith(".nfs"):
                    copies.append((nfs.backing / "ckpt" / "step_1" / name).read_bytes())
        assert original in copies
    finally:
        stop.touch()
        poller.wait(timeout=60)
    seen = json.loads(out.read_text())
    assert seen["torn"] == 0 and seen["missing"] == 0, seen
    assert seen["old"] + seen["new"] > 0, seen

    rec = read_record(root / "step_1")
    assert rec is not None and rec.pinned and rec.committed
    assert [c.pinned for c in mgr.checkpoints() if c.step == 1] == [True]
    hold.release()
    mgr.close()
    assert nfs.wait_idle(timeout=30)
    assert not [p for p in os.listdir(root / "step_1") if p.startswith(".nfs")]
    fresh = toy.make_state(seed=99)
    with CheckpointManager(root, async_save=False) as again:
        assert again.restore(fresh, step=1).step == 1


# --- resuming over NFS leftovers ------------------------------------------------------------------


@pytest.mark.fuse
def test_resume_with_nfs_leftovers_and_trash_restores_the_newest_and_collects_them(
    nfs_mount: MountFactory, holder: FileHolder, caplog: pytest.LogCaptureFixture
) -> None:
    nfs = nfs_mount(linger=Linger.constant(0.05))
    root = nfs.path / "ckpt"
    state = toy.make_state()
    first = CheckpointManager(root, async_save=False, retention=Retention(keep_last=2), drain_timeout=0.3)
    for step in range(1, 4):
        toy.train_step(state)
        first.save(step, state)
        if step == 1:
            held = holder.hold(files_of(root / "step_1"))  # a reader that never lets go
    saved = toy.weights(state)
    record_hold = holder.hold([root / "step_3" / "metadata.json"])
    first.pin(3)  # the replaced record of the newest checkpoint stays as a .nfs file
    first.close()  # its drain gives up on step_1: a trash entry full of .nfs files is left
    assert len(trash(root)) == 1
    # An interrupted save whose staging directory holds a .nfs file, and a directory some
    # other tool failed to remove that holds nothing but one.
    staging = root / ".staging" / "step_4.0123456789ab"
    stray = root / "step_9"
    for directory in (staging, stray):
        directory.mkdir()
        (directory / "partial").write_bytes(b"half a shard")
    stray_hold = holder.hold([staging / "partial", stray / "partial"])
    os.unlink(staging / "partial")
    os.unlink(stray / "partial")
    assert any(p.name.startswith(".nfs") for p in (root / "step_3").iterdir())
    caplog.clear()

    resumed = toy.make_state(seed=1)
    mgr = CheckpointManager(root, async_save=False, retention=Retention(keep_last=2))
    assert mgr.restore(resumed).step == 3
    assert toy.same_weights(toy.weights(resumed), saved)
    assert os.listdir(root / ".staging") == []  # the interrupted save went to the trash
    assert len(trash(root)) == 2
    for hold in (held, record_hold, stray_hold):
        hold.release()
    mgr.close()

    assert trash(root) == []  # both leftovers collected
    assert nfs.wait_idle(timeout=30)
    assert committed_steps(root) == [2, 3, 9]
    assert os.listdir(stray) == []  # not ours: neither loaded nor removed, its .nfs file gone
    assert not any(p.name.startswith(".nfs") for p in root.rglob("*"))
    assert any("step_9" in w for w in warnings_of(caplog))


# --- the root_dir fixture: one suite, both filesystems ---------------------------------------------


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_save_restore_and_prune_on_each_filesystem(root_dir: Path, async_save: bool) -> None:
    state = toy.make_state()
    with CheckpointManager(root_dir, async_save=async_save, retention=Retention(keep_last=2)) as mgr:
        for step in range(1, 6):
            toy.train_step(state)
            mgr.save(step, state)
        saved = toy.weights(state)
    assert committed_steps(root_dir) == [4, 5]
    assert trash(root_dir) == []
    fresh = toy.make_state(seed=3)
    with CheckpointManager(root_dir, async_save=async_save) as mgr:
        assert mgr.restore(fresh).step == 5
    assert toy.same_weights(toy.weights(fresh), saved)


# --- re-saving a step without RENAME_EXCHANGE -------------------------------------------------------


@pytest.mark.fuse
def test_resaving_a_step_on_nfs_replaces_it_with_two_renames_while_its_files_are_open(
    nfs_mount: MountFactory, holder: FileHolder
) -> None:
    nfs = nfs_mount(linger=Linger.constant(0.05))
    root = nfs.path / "ckpt"
    state = toy.make_state()
    mgr = CheckpointManager(root, async_save=False)
    mgr.save(1, state)
    hold = holder.hold(files_of(root / "step_1"))  # a reader still loading the old copy
    toy.train_step(state)
    mgr.save(1, state)  # no RENAME_EXCHANGE here: old copy aside, new copy in, old copy to the trash
    saved = toy.weights(state)
    fresh = toy.make_state(seed=5)
    assert mgr.restore(fresh).step == 1
    assert toy.same_weights(toy.weights(fresh), saved)
    assert not [name for name in trash(root) if ".replaced." in name]  # the replacement finished
    hold.release()
    mgr.close()
    assert trash(root) == [] and committed_steps(root) == [1]
