"""A kill -9 at any S3 request of a run leaves a prefix from which auto-resume loads the newest
commit, and the next writer collects what the killed one left (real processes, a real S3 server)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import safeckpt

WORKER = Path(__file__).parent / "support" / "s3_crash_worker.py"
RECORD = "metadata.json"

pytestmark = pytest.mark.timeout(900)


def _run(root: str, kill_at: int, log: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(WORKER), root, str(kill_at), str(log)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _committed(log: Path) -> int:
    lines = log.read_text().split() if log.exists() else []
    return int(lines[-1]) if lines else 0


def test_kill_at_every_50th_s3_request_resumes_the_newest_commit(s3_bucket, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _kill_and_resume(s3_bucket, tmp_path, stride=50)  # spread over the run; the slow variant takes each


@pytest.mark.slow
def test_kill_at_every_s3_request_resumes_the_newest_commit(s3_bucket, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _kill_and_resume(s3_bucket, tmp_path, stride=1)


def _kill_and_resume(s3_bucket, tmp_path: Path, *, stride: int) -> None:  # type: ignore[no-untyped-def]
    whole = _run(s3_bucket.url("count"), 0, tmp_path / "count.log")
    assert whole.returncode == 0, whole.stderr
    total = int(whole.stdout.split()[-1])
    assert total > 20
    client = s3_bucket.client()
    for kill_at in range(1, total + 1, stride):
        root, log = s3_bucket.url(f"k{kill_at}"), tmp_path / f"k{kill_at}.log"
        killed = _run(root, kill_at, log)
        assert killed.returncode == -9, (kill_at, killed.stderr)
        known = _committed(log)
        state = {"w": torch.zeros(1 << 12), "step": -1}
        with safeckpt.CheckpointManager(root) as mgr:  # the next writer: takes the root, collects
            restored = mgr.restore(state).step or 0
            # Never older than what the killed process saw committed; one newer if it died after
            # the commit PUT but before logging it.
            assert restored in (known, known + 1), (kill_at, known, restored)
            if restored:  # else nothing was committed: the state is left as it was
                assert state["step"] == restored and bool((state["w"] == float(restored)).all())
            mgr.save(restored + 10, state)  # and the prefix takes saves again
            mgr.flush()
        prefix = f"k{kill_at}/"
        keys = [k for k in s3_bucket.keys() if k.startswith(prefix)]  # noqa: SIM118
        parts = [k.split("/") for k in keys]
        commits = {
            p[1] for p in parts if len(p) == 3 and p[1].startswith("step_") and p[2] == "metadata.json"
        }
        areas = {p[2] for p in parts if p[1] == ".staging"}
        assert len(areas) == len(commits), (kill_at, sorted(areas), sorted(commits))  # no leftover area
        assert not [k for k in keys if "/.trash/" in k], kill_at
        uploads = client.list_multipart_uploads(Bucket=s3_bucket.name, Prefix=prefix).get("Uploads")
        assert not uploads, kill_at
