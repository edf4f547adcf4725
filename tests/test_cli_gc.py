"""``safeckpt gc``: leftovers of a dead job all removed, a live job's save in flight untouched.

The jobs are real processes running a CheckpointManager; one is held inside its save
(after its shards are written, before its train state) until the test lets it go, the
other kills itself there with SIGKILL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from notice import without_notice
from safeckpt import CheckpointManager
from safeckpt.cli import main

JOB = r"""
import os, signal, sys, time
from pathlib import Path
import torch
from safeckpt import CheckpointManager
from safeckpt._fs.fileops import FileOps

root, marker, release, how = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]

class HeldSave(FileOps):
    def write_file(self, path, data):
        if path.name.startswith("train_state") and path.parent.name.startswith("step_2."):
            marker.write_text(str(path.parent))
            if how == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            deadline = time.monotonic() + 120
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        super().write_file(path, data)

# retry_interval: the job's deleter passes only when asked (so the test sees its trash stay)
with CheckpointManager(root, async_save=False, file_ops=HeldSave(), retry_interval=3600) as mgr:
    mgr.save(1, {"w": torch.arange(1000.0)})
    mgr.save(2, {"w": torch.arange(1000.0) * 2})
"""


def run_cli(*args: Any) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "safeckpt"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "safeckpt"]
    env = {**os.environ, "COLUMNS": "250"}
    env.pop("SAFECKPT_DEBUG", None)
    return without_notice(
        subprocess.run(
            [*command, *map(str, args)], capture_output=True, text=True, env=env, timeout=180, check=False
        )
    )


def start_job(tmp_path: Path, root: Path, how: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    marker, release = tmp_path / "in-save", tmp_path / "release"
    job = subprocess.Popen([sys.executable, "-c", JOB, str(root), str(marker), str(release), how])
    deadline = time.monotonic() + 120  # a generous bound on a hang, not a timing assertion
    while not marker.exists():
        assert job.poll() is None or how == "die", f"the job exited early with {job.returncode}"
        if how == "die" and job.poll() is not None and not marker.exists():
            pytest.fail(f"the job died before its save: {job.returncode}")
        assert time.monotonic() < deadline, "the job never reached its save"
        time.sleep(0.02)
    return job, Path(marker.read_text()), release


def plant(root: Path) -> dict[Path, int]:
    """Leftovers of crashes and old versions; each path with its size."""
    planted: dict[Path, bytes] = {
        root / ".trash" / "step_0.pruned.0123456789ab" / "data.distcp": b"x" * 3000,
        root / ".trash" / "step_0.abandoned.0123456789ac" / "deep" / "part": b"y" * 500,
        root / ".latest.tmp.0123456789ab": b"",
        root / "step_1" / ".metadata.json.tmp.0123456789ab": b"{}" * 10,
        root / "step_1" / ".metadata.tmp": b"m" * 40,
        root / "step_1" / ".nfs000000000123abcd": b"n" * 700,
        root / ".fuse_hidden0000000a00000001": b"f" * 60,
    }
    for path, data in planted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    os.symlink("step_1", root / ".latest.tmp.0123456789ac")
    return {p: len(d) for p, d in planted.items()}


def items_by_path(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["path"]: item for item in data["items"]}


def test_gc_leaves_a_live_jobs_save_alone(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    job, staging, release = start_job(tmp_path, root, "hold")
    try:
        staged = sorted(p.name for p in staging.iterdir())
        planted = plant(root)
        noted, moving = root / ".damaged" / "step_0.0123456789ab", root / ".damaged" / "step_1.0123456789ab"
        for damaged in (noted, moving):
            damaged.mkdir(parents=True)
            (damaged / "__0_0.distcp").write_bytes(b"d" * 100)
        (noted / "damaged.json").write_text(
            json.dumps({"step": 0, "reason": "bad bytes", "time": 1.0, "seq": 1})
        )
        heartbeat_tmp = root / ".owner.tmp.0123456789ab"  # what a live owner's heartbeat write looks like
        heartbeat_tmp.write_text("{}")
        proc = run_cli("gc", root, "--json")
        assert proc.returncode == 0, proc.stderr
        data = json.loads(proc.stdout)
        assert data["owner_alive"] is True
        items = items_by_path(data)
        # a damaged checkpoint is no writer's business once moved aside (its note written)
        assert items[str(noted)]["action"] == "removed" and not noted.exists()
        assert items[str(moving)]["action"] == "skipped" and "moving it aside" in items[str(moving)]["reason"]
        assert items[str(heartbeat_tmp)]["action"] == "skipped" and heartbeat_tmp.exists()
        assert moving.is_dir()
        heartbeat_tmp.unlink()
        assert items[str(staging)]["action"] == "skipped" and items[str(staging)]["kind"] == "staging"
        assert sorted(p.name for p in staging.iterdir()) == staged  # untouched
        # the live writer's trash is its own deleter's business
        assert sorted(i["action"] for i in items.values() if i["kind"] == "trash") == ["skipped"] * 2
        for path in planted:
            assert path.exists() == (".trash" in path.parts), path
        assert not os.path.lexists(root / ".latest.tmp.0123456789ac")
        assert (root / "step_1" / "metadata.json").exists() and (root / ".owner").exists()

        # a second writer (an import) is refused while the job writes, and changes nothing
        weights = tmp_path / "w.safetensors"
        save_file({"w": torch.ones(3)}, str(weights))
        proc = run_cli("import", weights, "--to", root, "--step", "5", "--lock-timeout", "0.5")
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert "is being written by" in proc.stderr and not (root / "step_5").exists()
        assert sorted(p.name for p in staging.iterdir()) == staged
    finally:
        release.write_text("go")
        assert job.wait(timeout=120) == 0
    # the held save commits after gc ran, and is whole
    assert os.readlink(root / "latest") == "step_2"
    assert run_cli("verify", root).returncode == 0
    with CheckpointManager(root) as mgr:
        state = {"w": torch.zeros(1000)}
        mgr.restore(state)
    assert torch.equal(state["w"], torch.arange(1000.0) * 2)


def test_gc_removes_everything_a_dead_job_left(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    job, staging, _ = start_job(tmp_path, root, "die")
    assert job.wait(timeout=120) == -9
    assert staging.is_dir() and any(staging.iterdir())
    staging_size = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
    planted = plant(root)
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))

    assert main(["gc", str(root), "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["dry_run"] is True and dry["owner_alive"] is False
    assert {i["action"] for i in dry["items"]} == {"would remove"}
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before  # nothing changed

    assert main(["gc", str(root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {i["action"] for i in data["items"]} == {"removed"}
    kinds = sorted(i["kind"] for i in data["items"])
    assert str(staging) in items_by_path(data)
    assert kinds == ["fuse", "nfs", "staging", "temp", "temp", "temp", "temp", "trash", "trash"]
    assert data["bytes_freed"] == sum(planted.values()) + staging_size + len("step_1")
    assert not staging.exists() and not any((root / ".staging").iterdir())
    assert not any((root / ".trash").iterdir())
    for path in planted:
        assert not path.exists(), path
    # the committed checkpoint and `latest` stay
    assert os.readlink(root / "latest") == "step_1"
    assert main(["verify", str(root)]) == 0
    capsys.readouterr()

    assert main(["gc", str(root)]) == 0
    assert "nothing to collect" in capsys.readouterr().out


def test_gc_collects_staging_when_no_owner_record_says_a_writer_lives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A live writer always has an owner record: staging in a root without one is a leftover."""
    root = tmp_path / "ckpt"
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.zeros(4)})
    assert not (root / ".owner").exists()  # close() gave the root up
    leftover = root / ".staging" / "step_2.0123456789ab"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"x" * 1000)

    assert main(["gc", str(root), "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["owner_alive"] is None
    assert items_by_path(dry)[str(leftover)]["action"] == "would remove" and leftover.is_dir()

    assert main(["gc", str(root), "--json"]) == 0
    item = items_by_path(json.loads(capsys.readouterr().out))[str(leftover)]
    assert (item["kind"], item["action"], item["size"]) == ("staging", "removed", 1000)
    assert not leftover.exists() and not any((root / ".trash").iterdir())
    assert main(["verify", str(root)]) == 0


def test_gc_table_and_missing_root(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.zeros(4)})
    (root / ".trash" / "step_0.pruned.0123456789ab").mkdir(parents=True)
    (root / ".trash" / "step_0.pruned.0123456789ab" / "f").write_bytes(b"z" * 2048)
    proc = run_cli("gc", root, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "step_0.pruned.0123456789ab" in proc.stdout and "would free 2.0 KiB" in proc.stdout
    assert (root / ".trash" / "step_0.pruned.0123456789ab" / "f").exists()

    proc = run_cli("gc", tmp_path / "nope")
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr and not proc.stdout


@pytest.mark.fuse
def test_gc_skips_nfs_files_still_in_use(nfs_mount: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from safeckpt.testing import FileHolder

    nfs = nfs_mount(linger=0.0)
    root = nfs.path / "ckpt"
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.zeros(4)})
    victim = root / "step_1" / "stray"
    victim.write_bytes(b"s" * 100)
    with FileHolder() as holder:
        hold = holder.hold([str(victim)], seconds=60)
        victim.unlink()  # open elsewhere: the client keeps it as a hidden .nfs file
        hidden = [p for p in (root / "step_1").iterdir() if p.name.startswith((".nfs", ".fuse_hidden"))]
        assert len(hidden) == 1
        assert main(["gc", str(root), "--json", "--drain-timeout", "0"]) == 0
        item = items_by_path(json.loads(capsys.readouterr().out))[str(hidden[0])]
        assert item["kind"] in ("nfs", "fuse") and item["action"] == "skipped"
        assert "in use" in item["reason"]
        assert hidden[0].exists()
        hold.release()
    deadline = time.monotonic() + 60  # FUSE's release is asynchronous; a bound on a hang
    while True:
        assert main(["gc", str(root), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        if not hidden[0].exists():
            break
        assert time.monotonic() < deadline, data
        time.sleep(0.05)
    assert main(["verify", str(root)]) == 0


def test_gc_reports_the_bytes_of_an_unfinished_upload_it_removes(
    s3_bucket: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 52: the parts of a multipart upload a killed save left are in no listing of objects,
    # and gc reported the staging directory it removed as "0 B".
    from safeckpt._objstore.spread import shard

    root = s3_bucket.url("run")
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.zeros(4)})
    client = s3_bucket.client()
    key = f"run/.staging/step_2.0123456789ab/{shard('__0_0.distcp')}/__0_0.distcp"
    upload = client.create_multipart_upload(Bucket=s3_bucket.name, Key=key)
    for number, size in ((1, 2000), (2, 48)):
        client.upload_part(
            Bucket=s3_bucket.name, Key=key, UploadId=upload["UploadId"], PartNumber=number, Body=b"p" * size
        )
    assert main(["gc", root, "--dry-run"]) == 0
    assert "would free 2.0 KiB" in capsys.readouterr().out
    assert main(["gc", root, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    [item] = [i for i in report["items"] if i["kind"] == "staging"]
    assert (item["size"], item["action"]) == (2048, "removed") and report["bytes_freed"] == 2048
    assert not client.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads")
