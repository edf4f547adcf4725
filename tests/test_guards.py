"""Guarantees the code guards twice (issue 38, item 10): each guard alone is tested here, so
removing either copy of a guard fails a test, not only removing both.

* retention never removes the checkpoint ``latest`` names: the view's prune plan protects
  the view's ``latest``, and the removal re-reads ``latest`` on disk; the two differ when
  moving ``latest`` failed after a commit;
* every rank raises when one rank fails (``Participants.agree``) on open, pin and restore,
  not only on save;
* ``close()`` empties the trash; ``latest`` moves only after the commit rename; a
  checkpoint with a save in flight is not pruned; a checkpoint without a record is
  confined to its directory like one with a record.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import guard_worker
from faults import FaultyFileOps
from forkserver import context
from safeckpt import (
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    Retention,
    SaveFailedError,
    UnsafeCheckpointError,
    UnsupportedStateError,
    read_record,
)
from safeckpt._dcp.io import load, save
from safeckpt._dcp.safe_metadata import forget_parsed, read_metadata


def filled(step: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(step)), "step_count": step}


def steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*"))


def pointer(root: Path) -> str:
    return os.readlink(root / "latest")


def latest_swap(paths: tuple[Path, ...]) -> bool:
    """The rename that moves ``latest`` (its temp sibling onto it)."""
    return len(paths) == 2 and paths[1].name == "latest"


def restored_step(root: Path) -> tuple[int | None, float]:
    state = filled(0)
    with CheckpointManager(root) as mgr:
        step = mgr.restore(state).step
    return step, float(state["w"][0])


# --- retention never removes what `latest` names ------------------------------------------------------


def test_the_newest_checkpoint_is_kept_when_it_is_not_the_best(root: Path) -> None:
    """keep_best=1 keeps step 1 (loss 0.1); step 2 (loss 0.9) is what `latest` names: it stays."""
    with CheckpointManager(root, async_save=False, retention=Retention(keep_best=1, metric="loss")) as mgr:
        mgr.save(1, filled(1), metrics={"loss": 0.1})
        mgr.save(2, filled(2), metrics={"loss": 0.9})
        assert mgr.latest_step == 2
        assert [s.step for s in mgr.checkpoints()] == [1, 2]
    assert steps_on_disk(root) == [1, 2]
    assert pointer(root) == "step_2" and (root / "step_2" / "metadata.json").is_file()
    assert restored_step(root) == (2, 2.0)


def test_the_prune_plan_alone_keeps_the_newest_when_latest_on_disk_lags(root: Path) -> None:
    """Moving `latest` to step 2 fails: on disk it still names step 1, so the removal's re-check of
    `latest` would let step 2 go. Only the view's plan (its `latest` is step 2) keeps it."""
    ops = FaultyFileOps()
    with CheckpointManager(
        root, async_save=False, retention=Retention(keep_best=1, metric="loss"), file_ops=ops
    ) as mgr:
        mgr.save(1, filled(1), metrics={"loss": 0.1})
        ops.fail("replace", errno.EIO, match=latest_swap)
        mgr.save(2, filled(2), metrics={"loss": 0.9})  # committed; only `latest` lags (a warning)
        assert pointer(root) == "step_1"
        assert mgr.latest_step == 2
        assert steps_on_disk(root) == [1, 2], "step 2, the newest commit, was pruned"
    assert restored_step(root) == (2, 2.0)


def test_the_removal_alone_keeps_what_latest_on_disk_names(root: Path) -> None:
    """Moving `latest` to step 2 fails: the view's `latest` is step 2, so its plan drops step 1
    (keep_last=1). Only the removal's re-check of `latest` on disk keeps the step it names."""
    ops = FaultyFileOps()
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=1), file_ops=ops) as mgr:
        mgr.save(1, filled(1))
        ops.fail("replace", errno.EIO, match=latest_swap)
        mgr.save(2, filled(2))
        assert pointer(root) == "step_1"
        assert steps_on_disk(root) == [1, 2], "the checkpoint `latest` names was pruned"
        assert not list((root / ".trash").iterdir())
        mgr.save(3, filled(3))  # `latest` moves again: now both older ones go
        assert pointer(root) == "step_3"
    assert steps_on_disk(root) == [3]


# --- every rank raises when one fails: open, pin, restore ------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(scenario: str, tmp_path: Path, ws: int = 2) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``ws`` gloo ranks; each rank's report, in rank order."""
    results = tmp_path / "results"
    results.mkdir(parents=True, exist_ok=True)
    port = free_port()
    args = (str(tmp_path / "ckpt"), str(results))
    procs = [
        context().Process(target=guard_worker.main, args=(scenario, rank, ws, port, *args))
        for rank in range(ws)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 60
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    reports = []
    for rank in range(ws):
        path = results / f"rank{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {"exitcode": procs[rank].exitcode})
    return reports


def results_of(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for rank, report in enumerate(reports):
        assert report.get("ok"), f"rank {rank} failed: {report.get('traceback') or report}"
    return [report["result"] for report in reports]


def same_error_everywhere(
    attempts: list[dict[str, Any]], kind: type, failing_rank: int | None = None
) -> dict[str, Any]:
    """Every rank raised the same error (of ``failing_rank``, when given) within seconds, not at the
    rank timeout."""
    errors = [a["error"] for a in attempts]
    assert all(e is not None for e in errors), f"a rank that did not fail itself returned: {errors}"
    assert all(e == errors[0] for e in errors), f"the ranks raised different errors: {errors}"
    assert errors[0]["type"] == kind.__name__, errors[0]
    if failing_rank is not None:
        assert errors[0]["rank"] == failing_rank, errors[0]
    seconds = [a["seconds"] for a in attempts]
    assert max(seconds) < guard_worker.TIMEOUT / 2, f"a rank waited for the timeout: {seconds}"
    return errors[0]


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_root_only_rank_0_cannot_open_raises_on_every_rank(tmp_path: Path) -> None:
    out = results_of(launch("open_fails_on_rank0", tmp_path))
    error = same_error_everywhere([o["open"] for o in out], ConfigError, failing_rank=0)
    assert "is a file, not a directory" in error["message"]


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_pin_only_rank_0_refuses_raises_on_every_rank_and_the_ranks_stay_in_step(tmp_path: Path) -> None:
    out = results_of(launch("pin_fails_on_rank0", tmp_path))
    error = same_error_everywhere([o["pin"] for o in out], CheckpointNotFoundError, failing_rank=0)
    assert "no checkpoint of step 7" in error["message"]
    assert [o["after"]["error"] for o in out] == [None, None]
    assert steps_on_disk(tmp_path / "ckpt") == [1]


@pytest.fixture(scope="module")
def restore_mismatch(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch("restore_mismatch_on_rank1", tmp_path_factory.mktemp("restore_mismatch"))


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_restore_only_rank_1_cannot_match_raises_on_every_rank_within_seconds(
    restore_mismatch: list[dict[str, Any]],
) -> None:
    """Rank 0 must not go on into DCP's collective load (where it would wait for rank 1 until the
    timeout): both ranks raise rank 1's error, and nothing of either state changed."""
    out = results_of(restore_mismatch)
    for call in ("auto", "explicit"):
        error = same_error_everywhere([o[call] for o in out], UnsupportedStateError)
        assert "'extra'" in error["message"]
    assert [o["untouched"] for o in out] == [True, True]
    assert [o["after"]["error"] for o in out] == [None, None]
    assert [o["restored"] for o in out] == [[1.0, 1], [1.0, 1]]
    assert [o["close"]["error"] for o in out] == [None, None]


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_restore_only_rank_1_cannot_match_names_rank_1(restore_mismatch: list[dict[str, Any]]) -> None:
    for call in ("auto", "explicit"):
        error = same_error_everywhere([o[call] for o in results_of(restore_mismatch)], UnsupportedStateError)
        assert error["rank"] == 1, error


# --- close() empties the trash ------------------------------------------------------------------------


def test_close_drains_the_trash_past_what_a_background_pass_gives_up_on(root: Path) -> None:
    """Deleting the pruned step 1 fails with ENOTEMPTY (a .nfs file) more often than one pass
    retries; the background deleter gives up on it, and close() keeps trying until it is gone."""
    ops = FaultyFileOps()  # its sleeps do not sleep: the retries cost no time
    ops.fail("rmtree", errno.ENOTEMPTY, times=12, match="step_1.pruned")
    mgr = CheckpointManager(
        root, async_save=False, retention=Retention(keep_last=1), file_ops=ops, retry_interval=60
    )
    mgr.save(1, filled(1))
    mgr.save(2, filled(2))
    assert steps_on_disk(root) == [2]
    assert [p.name.split(".")[:2] for p in (root / ".trash").iterdir()] == [["step_1", "pruned"]]
    mgr.close()
    assert list((root / ".trash").iterdir()) == [], "close() left a pruned checkpoint in the trash"
    assert ops.count("rmtree") == 13  # 12 failures, then the removal


# --- `latest` moves only after the commit rename -------------------------------------------------------


class PointerWitness(FaultyFileOps):
    """Records, at each move of ``latest``, whether the step it names is committed on disk then."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, bool]] = []

    def replace(self, src: Path, dst: Path) -> None:
        if dst.name == "latest":
            name = os.readlink(src)
            try:
                record = read_record(dst.parent / name)
            except Exception:
                record = None
            self.seen.append((name, record is not None and record.committed))
        super().replace(src, dst)


def commit_rename(step: int) -> Callable[[tuple[Path, ...]], bool]:
    """The rename of a save's staging directory to ``step_<step>``: its commit."""
    return lambda paths: (
        len(paths) == 2 and paths[0].parent.name == ".staging" and paths[1].name == f"step_{step}"
    )


def test_latest_moves_only_after_the_commit_rename(root: Path) -> None:
    ops = PointerWitness()
    with CheckpointManager(root, async_save=False, file_ops=ops) as mgr:
        mgr.save(1, filled(1))
        assert ops.seen == [("step_1", True)], "latest moved before its checkpoint was in place"
        # The commit rename of step 2 fails: step 2 is not committed, and latest must not name it.
        ops.fail("replace", errno.EIO, match=commit_rename(2))
        with pytest.raises(SaveFailedError):
            mgr.save(2, filled(2))
        assert pointer(root) == "step_1" and ops.seen == [("step_1", True)]
        assert mgr.latest_step == 1
    assert steps_on_disk(root) == [1]
    assert restored_step(root) == (1, 1.0)


# --- a checkpoint with a save in flight is not pruned --------------------------------------------------


def train_state_of(step: int) -> Callable[[tuple[Path, ...]], bool]:
    """The write of a train-state file of a save of ``step``."""
    return lambda paths: (
        paths[0].name.startswith("train_state") and paths[0].parent.name.startswith(f"step_{step}.")
    )


class HoldStep3(FaultyFileOps):
    """The train-state write of step 3 announces itself in ``reached`` and waits for ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.reached, self.release = threading.Event(), threading.Event()

    def write_file(self, path: Path, data: bytes) -> None:
        if train_state_of(3)((path,)):
            self.reached.set()
            assert self.release.wait(30), "the test never released the write of step 3"
        super().write_file(path, data)


def test_a_checkpoint_being_saved_again_is_not_pruned_while_that_save_is_in_flight(root: Path) -> None:
    """A rollback re-save of step 1 is queued behind the write of step 3. The commit of step 3
    prunes by keep_last=2, which drops step 1, but step 1 has a save in flight: it stays, and
    when that save fails the committed step 1 is still there, whole."""
    ops = HoldStep3()
    with CheckpointManager(root, retention=Retention(keep_last=2), queue_depth=2, file_ops=ops) as mgr:
        mgr.save(1, filled(1))
        mgr.save(2, filled(2))
        mgr.wait()
        ops.fail("write_file", errno.ENOSPC, times=None, match=train_state_of(1))  # the re-save of step 1
        mgr.save(3, filled(3))
        assert ops.reached.wait(30)  # step 3 is being written
        mgr.save(1, filled(10), overwrite=True)  # queued behind it
        ops.release.set()
        with pytest.raises(SaveFailedError, match="No space left"):
            mgr.wait()
        assert steps_on_disk(root) == [1, 2, 3], "step 1 was pruned while its save was in flight"
        assert read_record(root / "step_1").committed
        state = filled(0)
        assert mgr.restore(state, step=1).step == 1 and float(state["w"][0]) == 1.0


# --- checkpoints without a record are confined to their directory too ------------------------------------


def plain_dcp_checkpoint(directory: Path, tmp_path: Path, how: str) -> Path:
    """A DCP checkpoint without a safeckpt record whose tensor data comes from a file outside it
    (``outside.bin``, which holds 7s where the checkpoint holds 1s): through ``.metadata``
    naming it (relative or absolute), or through a data file that is a symlink to it."""
    save({"w": torch.ones(64)}, directory, None)
    assert not (directory / "metadata.json").exists()
    metadata = read_metadata(directory)
    (data_name,) = {info.relative_path for info in metadata.storage_data.values()}
    outside = tmp_path / "outside.bin"
    save({"w": torch.full((64,), 7.0)}, tmp_path / "other", None)
    shutil.copyfile(tmp_path / "other" / data_name, outside)
    if how == "symlink":
        (directory / data_name).unlink()
        (directory / data_name).symlink_to(outside)
    else:
        relative = "../outside.bin" if how == "relative" else str(outside)
        for index, info in list(metadata.storage_data.items()):
            metadata.storage_data[index] = type(info)(relative, info.offset, info.length)
        buffer = io.BytesIO()
        pickle.dump(metadata, buffer)
        (directory / ".metadata").write_bytes(buffer.getvalue())
    forget_parsed()
    return directory


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_a_checkpoint_without_a_record_reads_nothing_outside_itself(tmp_path: Path, how: str) -> None:
    directory = plain_dcp_checkpoint(tmp_path / "plain", tmp_path, how)
    target = {"w": torch.zeros(64)}
    with pytest.raises(UnsafeCheckpointError):
        load(target, directory, None)
    assert torch.equal(target["w"], torch.zeros(64)), "bytes from outside the checkpoint were loaded"
