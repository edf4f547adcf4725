"""Invariant 7: every write of a record, every move of ``latest``, of a step directory or of the
trash, and every removal attempt holds the root's sidecar lock, in the thread that makes it; no
retry wait does.

A real CheckpointManager (sync and async) runs saves with retention (so it prunes), pins and
unpins (amends), replaces a step, registers each commit, recovers leftovers of an interrupted
run, and drains the trash at close. A ``LockRecordingFileOps`` records, for every call through
the filesystem seam, whether the calling thread held the lock.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from faults import MUTATIONS, Call, LockRecordingFileOps
from safeckpt import CheckpointManager, Retention, SaveFailedError
from safeckpt._format.layout import LATEST_NAME, RECORD_NAME, STAGING_NAME, TRASH_NAME, parse_step_dirname
from safeckpt._format.record import Record


class Registrar:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def register(self, step: int, path: Path, record: Record) -> dict[str, Any]:
        self.steps.append(step)
        return {"id": f"model-{step}"}


def what(call: Call, root: Path) -> set[str]:
    """Which of the root's guarded things a call touches: record, latest, step, trash."""
    touched = set()
    for path in call.paths:
        try:
            parts = path.relative_to(root).parts
        except ValueError:
            continue
        if not parts:
            continue
        name = path.name
        if name == RECORD_NAME or name.startswith(f".{RECORD_NAME}.tmp."):
            touched.add("record")
        if len(parts) == 1 and (name == LATEST_NAME or name.startswith(f".{LATEST_NAME}.tmp.")):
            touched.add("latest")
        if parse_step_dirname(parts[0]) is not None:
            touched.add("step")
        if parts[0] == TRASH_NAME:
            touched.add("trash")
    return touched


def guarded(ops: LockRecordingFileOps) -> list[tuple[Call, set[str]]]:
    return [(c, what(c, ops.root)) for c in ops.calls_of(*MUTATIONS) if what(c, ops.root)]


def run_training(root: Path, ops: LockRecordingFileOps, async_save: bool) -> Registrar:
    registrar = Registrar()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim, "epoch": 0}
    with CheckpointManager(
        root,
        async_save=async_save,
        retention=Retention(keep_last=2, keep_best=1, metric="loss"),
        registrar=registrar,
        file_ops=ops,
        retry_interval=0.01,
        drain_timeout=30,
    ) as mgr:
        for step in range(1, 7):
            model(torch.randn(3, 4)).sum().backward()
            optim.step()
            state["epoch"] = step
            mgr.save(step, state, metrics={"loss": 1.0 / step if step != 2 else 0.0})
            if step == 3:
                mgr.wait()
                mgr.pin(3)  # an amend; step 3 then outlives keep_last
        mgr.wait()
        mgr.save(6, state, metrics={"loss": 0.5})  # the same step again: an atomic replacement
        mgr.wait()
        mgr.unpin(3)  # an amend, then a prune of step 3
        mgr.pin(6)
        mgr.wait()
        assert sorted(c.step for c in mgr.checkpoints()) == [2, 5, 6]
    return registrar


def plant_leftovers(root: Path) -> None:
    """What an interrupted run leaves: a staging dir, a pruned and a half-replaced trash entry."""
    for rel in (
        f"{STAGING_NAME}/step_9.0123456789ab",
        f"{TRASH_NAME}/step_8.pruned.0123456789ab",
        f"{TRASH_NAME}/step_7.replaced.0123456789ab",
    ):
        (root / rel).mkdir(parents=True)
        (root / rel / "__0_0.distcp").write_bytes(b"x")


def in_trash_from(thread: str) -> Callable[[tuple[Path, ...]], bool]:
    """A fault filter: a path in the trash, in a call from ``thread``."""

    def match(paths: tuple[Path, ...]) -> bool:
        return threading.current_thread().name == thread and any(TRASH_NAME in p.parts for p in paths)

    return match


MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
RENAMES = [pytest.param(False, id="exchange"), pytest.param(True, id="two-renames")]


@pytest.mark.parametrize("two_renames", RENAMES)
@pytest.mark.parametrize("async_save", MODES)
def test_every_guarded_change_holds_the_sidecar_lock(root: Path, async_save: bool, two_renames: bool) -> None:
    root.mkdir()
    plant_leftovers(root)
    ops = LockRecordingFileOps(root)
    if two_renames:  # a filesystem without RENAME_EXCHANGE (NFS, FUSE)
        ops.fail("exchange", errno.EINVAL, times=None)
    # Removals that NFS refuses: the background deleter never gets one through (each of its passes
    # makes a fifth and last attempt, and tries other entries once its waits are spent), so
    # close() drains them all; the drain's first pass is refused too, so it pauses and passes again.
    ops.fail("rmtree", errno.ENOTEMPTY, times=None, match=in_trash_from("safeckpt-deleter"))
    ops.fail("rmtree", errno.ENOTEMPTY, times=6, match=in_trash_from("MainThread"))
    registrar = run_training(root, ops, async_save)

    calls = guarded(ops)
    unlocked = [
        (c.op, [str(p.relative_to(root)) for p in c.paths], c.thread) for c, _ in calls if not c.locked
    ]
    assert unlocked == [], "changed without holding the sidecar lock"
    waits = ops.calls_of("sleep")
    assert {c.thread for c in waits} == {"safeckpt-deleter", "MainThread"}, "the faults missed a removal"
    assert len([c for c in waits if c.thread == "MainThread"]) > 4, "the drain did not pause between passes"
    assert not [c for c in waits if c.locked], "a wait held the sidecar lock"

    # The run did exercise every kind of guarded change (else the checks above prove little).
    kinds = {(c.op, kind) for c, touched in calls for kind in touched}
    expected = {
        ("write_file", "record"),  # records: commit, pin, unpin, registration
        ("replace", "record"),
        ("symlink", "latest"),  # latest moved
        ("replace", "latest"),
        ("replace", "step"),  # commit renames into place; prune and recovery move step dirs
        ("replace", "trash"),  # pruned into the trash, recovery relabels and puts back
        ("rmtree", "trash"),  # the deleter
    }
    expected.add(("replace", "step") if two_renames else ("exchange", "step"))
    assert expected <= kinds, expected - kinds
    threads = {c.thread for c, _ in calls}
    assert "safeckpt-deleter" in threads
    if async_save:
        assert "safeckpt-writer" in threads
    assert sorted(set(registrar.steps)) == [1, 2, 3, 4, 5, 6]
    assert not (root / TRASH_NAME).exists() or list((root / TRASH_NAME).iterdir()) == []


def test_the_recorder_sees_a_change_made_without_the_lock(root: Path) -> None:
    # The check above can fail: a rename of a step directory outside the lock is reported.
    root.mkdir()
    (root / "step_1").mkdir()
    ops = LockRecordingFileOps(root)
    ops.replace(root / "step_1", root / TRASH_NAME)
    with ops.lock:  # type: ignore[union-attr]
        ops.replace(root / TRASH_NAME, root / "step_1")
    assert [(c.op, c.locked) for c, _ in guarded(ops)] == [("replace", False), ("replace", True)]


@pytest.mark.parametrize("async_save", MODES)
def test_discarding_a_failed_save_holds_the_sidecar_lock(root: Path, async_save: bool) -> None:
    ops = LockRecordingFileOps(root)
    ops.fail("write_file", errno.EIO, match="train_state")
    with CheckpointManager(root, async_save=async_save, file_ops=ops) as mgr, pytest.raises(SaveFailedError):
        mgr.save(1, {"w": torch.ones(2)})
        mgr.wait()
    removals = ops.calls_of("rmtree")
    assert removals, "the failed save's staging directory was not removed"
    assert all(c.locked for c in removals)
