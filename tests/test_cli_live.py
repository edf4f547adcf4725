"""``safeckpt verify`` and ``ls`` on a root a job is writing: a healthy root never fails.

A real job (another process) saves in a loop with ``keep_last=1``, so every commit moves
``latest`` and prunes the previous step, while this process runs the commands over and
over through ``main()`` (in-process, so many runs fit in a few seconds).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from safeckpt.cli import main

JOB = r"""
import sys
from pathlib import Path
import torch
from safeckpt import CheckpointManager, Retention

root, stop = Path(sys.argv[1]), Path(sys.argv[2])
state = {"w": torch.zeros(64)}
with CheckpointManager(root, async_save=False, save_rng=False, retention=Retention(keep_last=1)) as mgr:
    step = 0
    while not stop.exists():
        step += 1
        state["w"] += 1
        mgr.save(step, state, metrics={"loss": 1.0 / step})
print(step)
"""

SECONDS = 3.0


@pytest.fixture
def fast_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory in memory (/dev/shm) where there is one: with no disk flush to wait for, the job
    commits every few milliseconds, and a reader meets many more commits mid-scan."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="safeckpt-live-", dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_verify_and_ls_never_fail_on_a_root_a_job_is_writing(
    fast_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, stop = fast_dir / "ckpt", fast_dir / "stop"
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, str(root), str(stop)], stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120  # a bound on a hang (the job imports torch), not a timing
        while not (root / "latest").exists():
            assert job.poll() is None, f"the job exited early with {job.returncode}"
            assert time.monotonic() < deadline, "the job never committed a checkpoint"
            time.sleep(0.02)
        runs, failures = 0, []
        end = time.monotonic() + SECONDS
        while time.monotonic() < end:
            runs += 1
            code = main(["verify", str(root), "--json"])
            verified = json.loads(capsys.readouterr().out)
            if code != 0 or not verified["ok"]:
                failures.append(("verify", code, verified))
            assert main(["ls", str(root), "--json"]) == 0
            listed = json.loads(capsys.readouterr().out)
            if listed["latest"] is None or any(c["status"] != "committed" for c in listed["checkpoints"]):
                failures.append(("ls", 0, listed))
    finally:
        stop.touch()
        out, _ = job.communicate(timeout=120)
    assert job.returncode == 0
    saves = int(out.strip())
    assert saves > runs / 4, f"the job saved {saves} times while the commands ran {runs} times"
    assert not failures, f"{len(failures)} of {runs} runs failed; the first: {failures[0]}"


def test_a_listing_that_lags_a_commit_and_its_pruning_still_shows_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The race above, made certain: the listing was taken before step 2's commit, and by the time
    its records are read step 1 is pruned. Every rescan meets the same (a writer faster than a scan),
    so what settles the catalog is the pointer's step, read by name."""
    import torch

    from safeckpt import CheckpointManager, Retention
    from safeckpt._format.layout import Layout

    root = tmp_path / "ckpt"
    with CheckpointManager(root, async_save=False, save_rng=False, retention=Retention(keep_last=1)) as mgr:
        mgr.save(1, {"w": torch.zeros(4)})
        mgr.save(2, {"w": torch.ones(4)})
    assert not (root / "step_1").exists()
    monkeypatch.setattr(Layout, "committed_dirs", lambda self: [(1, self.step_dir(1))])

    assert main(["ls", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["latest"] == 2
    assert [c["step"] for c in listed["checkpoints"]] == [2]
    assert main(["verify", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
