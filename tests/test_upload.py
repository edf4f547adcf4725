"""``safeckpt upload`` (``safeckpt._ops.upload``) keeps the job's retention of the root (issue 52).

A job with two tiers is killed after a local commit, before its upload; ``safeckpt upload`` then
does what the job's next start would: it records the job's retention in the root and prunes the
root by it (before: it recorded "no retention limit" and pruned nothing, so a later plain
``safeckpt prune`` kept everything).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from safeckpt._format.catalog import scan
from safeckpt._ops.upload import upload_local
from safeckpt._store.loc import as_root
from safeckpt.cli import main

pytestmark = pytest.mark.timeout(300)

# Saves steps 1..4 with two tiers, each upload waited for, and dies before step 4's upload.
JOB = r"""
import os, signal, sys
import torch
from safeckpt import CheckpointManager, Retention
from safeckpt._tiers import uploads

real_upload = uploads.Uploader._upload

def upload(self, local):
    if local.record.step == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_upload(self, local)

uploads.Uploader._upload = upload
root, local = sys.argv[1], sys.argv[2]
with CheckpointManager(
    root, local_dir=local, retention=Retention(keep_last=2), local_retention=Retention(keep_last=4)
) as mgr:
    for step in (1, 2, 3, 4):
        mgr.save(step, {"w": torch.full((64,), float(step))})
        mgr.wait(durable=True)
"""


def _steps(root: Path) -> list[int]:
    return sorted(scan(as_root(root)).committed)


def _killed_before_the_last_upload(tmp_path: Path) -> tuple[Path, Path]:
    root, local = tmp_path / "root", tmp_path / "local"
    done = subprocess.run(
        [sys.executable, "-c", JOB, str(root), str(local)], capture_output=True, timeout=240
    )
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    assert _steps(root) == [2, 3] and _steps(local) == [1, 2, 3, 4]
    return root, local


def _set_recorded_retention(root: Path, retention: dict[str, Any] | None) -> None:
    for step in _steps(root):
        path = root / f"step_{step}" / "metadata.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "retention": retention}))


def test_upload_records_and_applies_the_jobs_retention_so_a_plain_prune_keeps_to_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, local = _killed_before_the_last_upload(tmp_path)
    report = upload_local(root, local)
    assert report.uploaded == (4,)
    # The root: step 4 recorded with the job's rules and pruned by them, as the job would have.
    assert _steps(root) == [3, 4]
    record = scan(as_root(root)).committed[4].record
    assert record is not None and record.retention is not None and record.retention["keep_last"] == 2
    assert _steps(local) == [1, 2, 3, 4]  # the local tier: marked, nothing removed
    # A later plain prune (the job's recorded rules) keeps to them, and has nothing to remove.
    assert main(["prune", str(root), "--json"]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert result["kept"] == [3, 4] and result["removed"] == []
    assert (result["retention"], result["retention_source"]) == ("last 2 or pinned", "recorded")


def test_upload_into_a_root_whose_records_name_no_retention_leaves_a_plain_prune_asking_for_rules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, local = _killed_before_the_last_upload(tmp_path)
    _set_recorded_retention(root, None)  # as early versions wrote records
    upload_local(root, local)
    assert _steps(root) == [2, 3, 4]  # unknown rules remove nothing
    record = scan(as_root(root)).committed[4].record
    assert record is not None and record.retention is not None
    assert record.retention["custom_policy"] == "unknown"  # not "no retention limit"
    assert main(["prune", str(root)]) != 0
    assert "no retention to prune" in capsys.readouterr().err
    assert _steps(root) == [2, 3, 4]


def test_upload_records_a_custom_policy_as_the_job_did_and_removes_nothing_by_it(tmp_path: Path) -> None:
    root, local = _killed_before_the_last_upload(tmp_path)
    custom = {"custom_policy": "KeepFridays", "reason": "Friday checkpoints"}
    _set_recorded_retention(root, custom)
    upload_local(root, local)
    assert _steps(root) == [2, 3, 4]  # a policy this process cannot rebuild removes nothing
    record = scan(as_root(root)).committed[4].record
    assert record is not None and record.retention == custom
