"""Two tiers (``local_dir=``): saves commit to a local directory, uploads make them durable in the
root (a directory, or an ``s3://`` prefix on the moto server), restore takes the nearest good copy."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import safeckpt
from safeckpt import CheckpointManager, Retention
from safeckpt._format.catalog import scan
from safeckpt._ops.upload import upload_local
from safeckpt._store.loc import as_root
from safeckpt.cli import main
from safeckpt.cli.ls import listing
from safeckpt.errors import ConfigError, SaveFailedError

pytestmark = pytest.mark.timeout(300)

WORKER = Path(__file__).parent / "support" / "tier_worker.py"


@pytest.fixture(params=["posix", "s3"])
def durable(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The durable tier: a shared-filesystem directory, or a prefix on the S3 server."""
    if request.param == "posix":
        return str(tmp_path / "durable")
    bucket = request.getfixturevalue("s3_bucket")
    return str(bucket.url("run"))


@pytest.fixture
def s3_env() -> dict[str, str]:
    """The environment of a worker process: this test's, with the ``AWS_*`` of its bucket if any."""
    return dict(os.environ)


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1 << 16,), float(step))}


def _committed(root: str | Path) -> dict[int, Any]:
    return {e.step: e.record for e in scan(as_root(root)).entries if e.committed}


@pytest.mark.parametrize("async_save", [True, False])
def test_each_save_commits_locally_then_is_uploaded_and_committed_in_the_root(
    durable: str, tmp_path: Path, async_save: bool
) -> None:
    local = tmp_path / "local"
    with CheckpointManager(
        durable,
        local_dir=local,
        async_save=async_save,
        retention=Retention(keep_last=3),
        local_retention=Retention(keep_last=2),
    ) as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step))
        mgr.wait(durable=True)
    here, there = _committed(local), _committed(durable)
    assert sorted(here) == [4, 5] and sorted(there) == [3, 4, 5]  # each tier its own retention
    for step in (4, 5):
        # the same bytes in both tiers; each record says where the other copy is
        assert there[step].checksums == here[step].checksums and there[step].files == here[step].files
        assert there[step].uploaded.source == str(local / f"step_{step}")
        assert here[step].uploaded.to.endswith(f"step_{step}")
    assert [there[s].seq for s in (3, 4, 5)] == sorted(there[s].seq for s in (3, 4, 5))  # commit order
    # The durable tier alone is a whole root: a job without local_dir resumes from it.
    restored = _state(0)
    with CheckpointManager(durable) as mgr:
        assert mgr.restore(restored).step == 5
    assert torch.equal(restored["w"], _state(5)["w"])


def test_restore_takes_the_local_copy_and_a_damaged_one_falls_back_to_the_durable_copy(
    durable: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = tmp_path / "local"
    with CheckpointManager(durable, local_dir=local) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    restored = _state(0)
    with CheckpointManager(durable, local_dir=local) as mgr:
        got = mgr.restore(restored)
    assert got.step == 2 and Path(got.path) == local / "step_2"  # the nearest copy
    data = next((local / "step_2").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    restored = _state(0)
    with CheckpointManager(durable, local_dir=local) as mgr:  # asked for by step: the same fallback
        got = mgr.restore(restored, step=2)
    assert got.step == 2 and str(got.path).startswith(durable)
    assert torch.equal(restored["w"], _state(2)["w"])
    restored = _state(0)
    with caplog.at_level(logging.WARNING), CheckpointManager(durable, local_dir=local) as mgr:
        got = mgr.restore(restored)
    assert got.step == 2 and str(got.path).startswith(durable)  # the same step, from the durable tier
    assert torch.equal(restored["w"], _state(2)["w"])
    assert "does not match the checksum" in caplog.text
    assert not (local / "step_2").exists()  # the damaged local copy was moved aside


def test_a_new_node_with_an_empty_local_dir_resumes_from_the_durable_tier(
    durable: str, tmp_path: Path
) -> None:
    with CheckpointManager(durable, local_dir=tmp_path / "node1") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    restored = _state(0)
    with CheckpointManager(durable, local_dir=tmp_path / "node2") as mgr:
        got = mgr.restore(restored)
        assert got.step == 3 and str(got.path).startswith(durable)
        mgr.save(4, _state(4))  # and goes on saving through its own local tier
        mgr.wait(durable=True)
    assert sorted(_committed(durable)) == [1, 2, 3, 4]


def test_local_checkpoints_wait_for_their_upload_while_the_root_cannot_be_reached(
    s3_proxy: Any, s3_bucket: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, local = s3_bucket.url("down"), tmp_path / "local"
    options = {"max_attempts": 1, "connect_timeout": 5, "read_timeout": 5}  # 503s come at once
    s3_proxy.fail_next(100_000, status=503, code="SlowDown", method="PUT")
    with (
        caplog.at_level(logging.WARNING),
        CheckpointManager(
            root,
            local_dir=local,
            local_retention=Retention(keep_last=1),
            storage_options=options,
            retry_interval=0.05,
            upload_timeout=5,
        ) as mgr,
    ):
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
            mgr.wait()
        # Nothing durable yet: local retention keeps every step until its upload commits.
        assert sorted(_committed(local)) == [1, 2, 3]
        deadline = time.monotonic() + 60  # the uploader's first try, on its own thread
        while "stays on the local disk" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        s3_proxy.clear()  # the durable tier is back: the backlog catches up, in commit order
        mgr.wait(durable=True)
        assert sorted(_committed(root)) == [1, 2, 3]
        seqs = {s: r.seq for s, r in _committed(root).items()}
        assert seqs[1] < seqs[2] < seqs[3]
    assert sorted(_committed(local)) == [3]  # pruned once uploaded (at close)


POINTS = ["local_write", "before_upload", "during_upload", "durable_commit", "after_durable_commit"]


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_at_any_point_loses_no_commit_and_the_next_start_uploads_it_once(
    durable: str, tmp_path: Path, point: str, s3_env: Any
) -> None:
    _kill_and_resume(durable, tmp_path / "local", point, s3_env)


def _kill_and_resume(durable: str, local: Path, point: str, s3_env: dict[str, str]) -> None:
    argv = [sys.executable, str(WORKER), durable, str(local), point]
    done = subprocess.run(argv, env=s3_env, capture_output=True, timeout=240)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    newest = 2 if point == "local_write" else 3  # step 3 committed locally at every later point
    before = _committed(durable)
    assert max(before) == (3 if point == "after_durable_commit" else 2)
    restored = _state(0)
    with CheckpointManager(durable, local_dir=local) as mgr:  # the next start: uploads, then restores
        assert mgr.restore(restored).step == newest
    assert torch.equal(restored["w"], _state(newest)["w"])
    after = _committed(durable)
    assert max(after) == newest and after[newest].checksums == _committed(local)[newest].checksums
    if point == "after_durable_commit":  # already in the root: marked, not uploaded again
        assert after[3].seq == before[3].seq and after[3].uploaded == before[3].uploaded
    # Nothing the kill left behind stays in the root, and a node without the local copy resumes too.
    with CheckpointManager(durable) as mgr:
        assert mgr.restore(_state(0)).step == newest
    assert not scan(as_root(durable)).staging


def test_safeckpt_upload_uploads_what_a_dead_job_left_and_nothing_twice(
    durable: str, tmp_path: Path, s3_env: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    local = tmp_path / "local"
    done = subprocess.run(
        [sys.executable, str(WORKER), durable, str(local), "before_upload"], env=s3_env, timeout=240
    )
    assert done.returncode == -9
    assert 3 not in _committed(durable)
    tiers = {c["step"]: c["tiers"] for c in listing(durable, local_dir=local)["checkpoints"]}  # safeckpt ls
    assert tiers[1] == ["durable"] and tiers[2][0] == "durable"  # step 2's local copy may be pruned
    assert tiers[3] == ["local", "not uploaded"]
    cli = [sys.executable, "-m", "safeckpt", "upload", durable, "--local-dir", str(local), "--json"]
    first = subprocess.run(cli, env=s3_env, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["uploaded"] == [3]
    assert _committed(durable)[3].checksums == _committed(local)[3].checksums
    assert main(cli[3:]) == 0  # again, in this process: nothing left to upload
    assert json.loads(capsys.readouterr().out)["uploaded"] == []
    assert {c["step"]: c["tiers"] for c in listing(durable, local_dir=local)["checkpoints"]}[3] == [
        "durable",
        "local",
    ]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"local_dir": "s3://bucket/x"}, "is a URL"),
        ({"local_retention": Retention(keep_last=1)}, "pass local_dir= too"),
        ({"local_dir": "LOCAL", "local_retention": 3}, "local_retention must be"),
        ({"local_dir": "ROOT/fast"}, "one inside the other"),
    ],
)
def test_bad_tier_arguments_are_config_errors(tmp_path: Path, kwargs: dict[str, Any], words: str) -> None:
    named = {"LOCAL": str(tmp_path / "local"), "ROOT/fast": str(tmp_path / "root" / "fast")}
    kwargs = {k: named.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ConfigError, match=words):
        CheckpointManager(tmp_path / "root", **kwargs)
    assert not (tmp_path / "root" / "step_1").exists()


def test_load_without_a_manager_reads_the_durable_tier(durable: str, tmp_path: Path) -> None:
    with CheckpointManager(durable, local_dir=tmp_path / "local") as mgr:
        mgr.save(7, _state(7))
    assert torch.equal(safeckpt.load(durable)["w"], _state(7)["w"])


def test_a_stale_local_dir_never_rolls_the_root_back(durable: str, tmp_path: Path, s3_env: Any) -> None:
    """Node 1, its clock an hour ahead, commits step 3 locally and dies before its upload; node 2
    resumes from the root at step 2 and commits 3, 4 and 5 there. Node 1's step 3 is the newest by
    its clock, but the root moved on past it: never restored, never uploaded, kept aside."""
    old_node = tmp_path / "node1"
    argv = [sys.executable, str(WORKER), durable, str(old_node), "before_upload"]
    ahead = {**s3_env, "SAFECKPT_TEST_CLOCK_AHEAD": "3600"}
    assert subprocess.run(argv, env=ahead, capture_output=True, timeout=240).returncode == -9
    assert _committed(old_node)[3].time > time.time() + 3000  # what the clocks say is wrong
    with CheckpointManager(durable, local_dir=tmp_path / "node2") as mgr:  # the job went on elsewhere
        assert mgr.restore(_state(0)).step == 2
        for step in (3, 4, 5):
            mgr.save(step, _state(10 * step))
    # Back on the first node. A reader (it moves nothing) takes the root's newest commit.
    restored = _state(0)
    with CheckpointManager(durable, local_dir=old_node, read_only=True) as mgr:
        assert mgr.restore(restored).step == 5
    assert torch.equal(restored["w"], _state(50)["w"])
    # A writer sets the stale step 3 aside (with a note) and uploads nothing over the root's.
    restored = _state(0)
    with CheckpointManager(durable, local_dir=old_node) as mgr:
        assert mgr.restore(restored).step == 5
        assert 3 not in {c.step for c in mgr.checkpoints()}  # not counted either
    assert torch.equal(restored["w"], _state(50)["w"])
    assert torch.equal(safeckpt.load(durable)["w"], _state(50)["w"])
    assert torch.equal(safeckpt.load(durable, step=3)["w"], _state(30)["w"])  # node 2's step 3
    aside = list((old_node / ".damaged").glob("step_3.*"))
    assert len(aside) == 1 and json.loads((aside[0] / "damaged.json").read_text())["behind"] is True
    assert 3 not in _committed(old_node)


def test_a_local_copy_damaged_before_its_upload_is_dropped_and_the_next_ones_go_up(
    s3_proxy: Any, s3_bucket: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, local = s3_bucket.url("dropped"), tmp_path / "local"
    s3_proxy.fail_next(100_000, status=503, code="SlowDown", method="PUT")
    options = {"max_attempts": 1, "connect_timeout": 5, "read_timeout": 5}  # 503s come at once
    with (
        caplog.at_level(logging.WARNING),
        CheckpointManager(root, local_dir=local, storage_options=options, retry_interval=0.05) as mgr,
    ):
        for step in (1, 2):
            mgr.save(step, _state(step))
            mgr.wait()
        data = next((local / "step_1").glob("*.distcp"))
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
        s3_proxy.clear()
        # Step 1 cannot go up, and does not hold step 2 back; the wait says it is not durable, once.
        # (A try that was under way as the server came back may fail first: the wait says so.)
        for _ in range(3):
            with pytest.raises(SaveFailedError) as raised:
                mgr.wait(durable=True)
            if "could not be uploaded" in str(raised.value):
                break
        assert re.search(r"step\(s\) 1 could not be uploaded", str(raised.value)), raised.value
        assert "are damaged" in str(raised.value)
        mgr.wait(durable=True)
    assert sorted(_committed(root)) == [2]
    assert "step 1" in caplog.text and "cannot be uploaded" in caplog.text


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 2.5 MiB tmpfs: a local disk that fills after a few checkpoints (needs root and mount)."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2560k", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_local_disk_removes_the_oldest_uploaded_checkpoints_first(
    small_disk: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "durable"
    state = {"w": torch.zeros(1 << 17)}  # 512 KiB a checkpoint: four fit
    with (
        caplog.at_level(logging.WARNING),
        CheckpointManager(root, local_dir=small_disk / "run", local_retention=Retention(keep_last=10)) as mgr,
    ):
        for step in range(1, 9):
            state["w"].fill_(step)
            mgr.save(step, state)
            mgr.wait(durable=True)  # each one uploaded before the next: every older one may go
    assert sorted(_committed(root)) == list(range(1, 9))  # every save committed, every one durable
    kept = sorted(_committed(small_disk / "run"))
    assert kept[-1] == 8 and len(kept) < 8  # the oldest went early, the newest stay
    assert "is full" in caplog.text and "removed the uploaded step(s) 1" in caplog.text


def test_a_copy_saved_again_while_it_is_uploaded_is_dropped_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 5 is saved again while its first copy uploads, and a file of the first copy vanishes
    under the upload (it went to the trash): that copy is dropped, not counted as a failed try, and
    the second copy is the one made durable."""
    import errno
    import threading

    from safeckpt._tiers import durable as durable_module

    uploading, resaved = threading.Event(), threading.Event()
    copy = durable_module.copy_checkpoint

    def copy_once_replaced(source: Any, *args: Any, **kwargs: Any) -> Any:
        if not uploading.is_set():
            uploading.set()
            assert resaved.wait(60)
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(source))
        return copy(source, *args, **kwargs)

    monkeypatch.setattr(durable_module, "copy_checkpoint", copy_once_replaced)
    root, local = tmp_path / "durable", tmp_path / "local"
    with caplog.at_level(logging.INFO), CheckpointManager(root, local_dir=local, retry_interval=60) as mgr:
        mgr.save(5, _state(5))
        assert uploading.wait(60)
        mgr.save(5, _state(55))
        mgr.wait()  # committed locally: the copy being uploaded is no longer the local one
        resaved.set()
        mgr.wait(durable=True)  # no failed try to wait out (60 s) or to raise
    assert "failed" not in caplog.text and "changed while it was uploaded" in caplog.text
    restored = _state(0)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(restored).step == 5
    assert torch.equal(restored["w"], _state(55)["w"])


def test_a_pin_keeps_the_durable_copy_too_and_unpinning_lets_both_tiers_prune_it(
    durable: str, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    with CheckpointManager(
        durable,
        local_dir=local,
        retention=Retention(keep_last=2),
        local_retention=Retention(keep_last=1),
        async_save=False,
    ) as mgr:
        mgr.save(1, _state(1))
        mgr.wait(durable=True)
        mgr.pin(1)  # uploaded already: its durable copy is pinned as well
        for step in (2, 3):
            mgr.save(step, _state(step))
            mgr.wait(durable=True)
        assert sorted(_committed(local)) == [1, 3]
        mgr.pin(2)  # pruned locally: its durable copy alone is pinned
        mgr.save(4, _state(4))
        mgr.wait(durable=True)
        kept = _committed(durable)
        assert sorted(kept) == [1, 2, 3, 4] and kept[1].pinned and kept[2].pinned and not kept[4].pinned
        mgr.unpin(1)
        mgr.unpin(2)
        assert sorted(_committed(durable)) == [3, 4] and sorted(_committed(local)) == [4]


def test_a_pin_that_comes_while_its_step_goes_up_reaches_the_durable_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The upload read the local record before the pin; its mark afterwards pins the durable copy.
    from safeckpt._tiers import durable as durable_module

    root, local = tmp_path / "durable", tmp_path / "local"
    copy = durable_module.copy_checkpoint
    managers: list[CheckpointManager] = []

    def copy_then_pin(source: Any, record: Any, *args: Any, **kwargs: Any) -> Any:
        done = copy(source, record, *args, **kwargs)
        if record.step == 1:
            managers[0].pin(1)  # on the upload thread, between its read of the record and its commit
        return done

    monkeypatch.setattr(durable_module, "copy_checkpoint", copy_then_pin)
    keep = Retention(keep_last=1)
    with CheckpointManager(root, local_dir=local, retention=keep, async_save=False) as mgr:
        managers.append(mgr)
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
            mgr.wait(durable=True)
    kept = _committed(root)
    assert sorted(kept) == [1, 3] and kept[1].pinned


def test_a_pin_the_durable_root_refuses_pins_the_local_copy_and_says_what_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from safeckpt._tiers import durable as durable_module
    from safeckpt.errors import CheckpointError

    root, local = tmp_path / "durable", tmp_path / "local"
    real_amend = durable_module.amend_record

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EIO, "Input/output error (injected)")

    with CheckpointManager(root, local_dir=local, async_save=False) as mgr:
        mgr.save(1, _state(1))
        mgr.wait(durable=True)
        monkeypatch.setattr(durable_module, "amend_record", refused)
        said = r"step 1 is pinned in .*its durable copy in .* could not be pinned"
        with pytest.raises(CheckpointError, match=said):
            mgr.pin(1)
        assert _committed(local)[1].pinned and not _committed(root)[1].pinned
        monkeypatch.setattr(durable_module, "amend_record", real_amend)
        mgr.pin(1)  # again, once the root can be written
    assert _committed(root)[1].pinned


def test_safeckpt_upload_refuses_one_nodes_parts_and_leaves_them(tmp_path: Path) -> None:
    # A part alone (a local tier on each node's disk) cannot be committed in the root: refused with
    # a ConfigError that says what uploads it, and nothing is touched.
    root, local = tmp_path / "root", tmp_path / "local"
    with CheckpointManager(root, local_dir=local, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
        mgr.wait(durable=True)
    record_path = local / "step_1" / "metadata.json"
    record = json.loads(record_path.read_text())
    record.pop("uploaded")
    record["part"] = {"id": "step_1.0123456789ab", "node": 1, "nodes": 2}
    record_path.write_text(json.dumps(record))
    with pytest.raises(ConfigError, match=r"one node's parts of step\(s\) 1"):
        upload_local(root, local)
    assert json.loads(record_path.read_text()) == record


@pytest.mark.parametrize("other", ["another root", "the root made again"])
def test_a_local_dir_holding_another_roots_checkpoints_is_refused_and_left_as_it_is(
    request: pytest.FixtureRequest, durable: str, tmp_path: Path, other: str
) -> None:
    """Run A's steps in a local_dir are never restored, uploaded or counted by run B, whose root is
    another (or A's, removed and made again): B is refused at construction, saying what to do."""
    local = tmp_path / "local"
    first = str(tmp_path / "a") if other == "another root" else durable
    with CheckpointManager(first, local_dir=local, local_retention=Retention(keep_last=3)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    if other == "the root made again":
        _remove(request, durable)
    before = {s: r.checksums for s, r in _committed(local).items()}
    said = r"holds step\(s\) 1, 2, 3 of another root.*give this run a local_dir of its own"
    with pytest.raises(ConfigError, match=said):
        CheckpointManager(durable, local_dir=local)
    assert not _committed(durable)  # nothing of A's went up to B's root
    assert {s: r.checksums for s, r in _committed(local).items()} == before  # nor was touched
    for step in (1, 2, 3):  # once A's steps are gone, B starts fresh there
        shutil.rmtree(local / f"step_{step}")
    with CheckpointManager(durable, local_dir=local) as mgr:
        assert mgr.restore(_state(0)).step is None
        mgr.save(1, _state(11))  # not refused as "already saved"
        mgr.wait(durable=True)
    assert torch.equal(safeckpt.load(durable)["w"], _state(11)["w"])


def _remove(request: pytest.FixtureRequest, root: str) -> None:
    """Remove a root: its directory, or every object under its S3 prefix."""
    if "://" not in root:
        shutil.rmtree(root)
        return
    bucket = request.getfixturevalue("s3_bucket")
    prefix = root.removeprefix(bucket.url("")).strip("/") + "/"
    client = bucket.client()
    for key in [k for k in bucket.keys() if k.startswith(prefix)]:  # noqa: SIM118 (a listing, not a dict)
        client.delete_object(Bucket=bucket.name, Key=key)


def test_steps_whose_local_copies_are_removed_while_the_root_is_down_are_named_by_wait_durable(
    s3_proxy: Any, s3_bucket: Any, tmp_path: Path
) -> None:
    root, local = s3_bucket.url("lost"), tmp_path / "local"
    s3_proxy.fail_next(100_000, status=503, code="SlowDown", method="PUT")
    options = {"max_attempts": 1, "connect_timeout": 5, "read_timeout": 5}  # 503s come at once
    with CheckpointManager(root, local_dir=local, storage_options=options, retry_interval=0.05) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
            mgr.wait()
        shutil.rmtree(local)  # while both wait for the root
        s3_proxy.clear()
        with pytest.raises(SaveFailedError, match=r"step\(s\) 1, 2 could not be uploaded.*were removed"):
            mgr.wait(durable=True)
        mgr.wait(durable=True)  # each is named once
    assert not _committed(root)


def test_steps_whose_local_copies_are_removed_while_their_upload_waits_are_named_by_wait_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from safeckpt._tiers import durable as durable_module

    uploading, removed = threading.Event(), threading.Event()
    copy = durable_module.copy_checkpoint

    def held(*args: Any, **kwargs: Any) -> Any:  # the first upload waits until local_dir is gone
        uploading.set()
        assert removed.wait(60)
        return copy(*args, **kwargs)

    monkeypatch.setattr(durable_module, "copy_checkpoint", held)
    root, local = tmp_path / "durable", tmp_path / "local"
    with CheckpointManager(root, local_dir=local) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        mgr.wait()
        assert uploading.wait(60)
        shutil.rmtree(local)
        removed.set()
        with pytest.raises(SaveFailedError, match=r"step\(s\) 1, 2 could not be uploaded.*were removed"):
            mgr.wait(durable=True)
    assert not _committed(root)


@pytest.mark.parametrize("where", ["the directory", "a directory inside it"])
def test_a_local_dir_that_cannot_be_written_is_refused_at_construction(
    tmp_path: Path, read_only_bind: Any, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    read_only_bind(frozen)
    local = frozen if where == "the directory" else frozen / "exp1"
    refused = r"local_dir=.* cannot be written"
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError, match=refused):
        CheckpointManager(tmp_path / "durable", local_dir=local)
    assert "was removed" not in caplog.text and not caplog.records  # refused before any warning
    with CheckpointManager(tmp_path / "durable", local_dir=local, read_only=True) as mgr:
        assert mgr.restore(_state(0)).step is None  # a reader needs no write
