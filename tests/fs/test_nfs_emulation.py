"""The NFS-semantics test filesystem itself: silly renames, linger, EBUSY, cleanup."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from safeckpt._fs.fileops import FileOps
from safeckpt.testing import (
    FileHolder,
    Linger,
    NFSConfig,
    NFSMount,
    NFSMountError,
    hold_open,
    is_mounted,
    mount_nfs,
    nfsfs,
)

MountFactory = Callable[..., NFSMount]


def nfs_names(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith(".nfs"))


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll until ``predicate()``; the timeout only bounds a hang, it is not what is tested."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# --- the linger distribution (no mount needed) ----------------------------------------


def test_linger_draws_are_seeded_and_have_the_configured_shape() -> None:
    linger = Linger(seed=7, fast_max=0.4, slow_prob=1 / 300, slow=4.0)
    draws = linger.sample(30_000)
    assert draws == Linger(seed=7, fast_max=0.4, slow_prob=1 / 300, slow=4.0).sample(30_000)
    assert draws != Linger(seed=8, fast_max=0.4, slow_prob=1 / 300, slow=4.0).sample(30_000)
    slow = [d for d in draws if d == 4.0]
    fast = [d for d in draws if d != 4.0]
    assert all(0.0 <= d <= 0.4 for d in fast)
    assert 60 <= len(slow) <= 140  # 100 expected; the binomial spread is about 10
    assert 0.15 < sum(fast) / len(fast) < 0.25  # uniform on [0, 0.4]
    assert linger.sample(5) == draws[:5]  # a stream: the first draws do not depend on how many


@pytest.mark.parametrize(
    ("linger", "expected"),
    [
        pytest.param(Linger.constant(4.0), [4.0] * 5, id="constant"),
        pytest.param(Linger(), [0.0] * 5, id="none"),
        pytest.param(Linger(seed=3, fast_max=0.1, slow_prob=1.0, slow=2.5), [2.5] * 5, id="all-slow"),
    ],
)
def test_linger_special_cases(linger: Linger, expected: list[float]) -> None:
    assert linger.sample(5) == expected


@pytest.mark.parametrize(
    "kwargs",
    [dict(fast_min=0.5, fast_max=0.1), dict(slow_prob=1.5), dict(slow=-1.0)],
    ids=["min-above-max", "prob-above-1", "negative-slow"],
)
def test_linger_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="Linger"):
        Linger(**kwargs)


def test_config_round_trips_through_json() -> None:
    config = NFSConfig(linger=Linger.field_like(seed=5), ebusy_rmdir_next=2, ebusy_rmdir_prob=0.1, seed=9)
    assert NFSConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    assert config.updated({"ebusy_rmdir_next": 0}).ebusy_rmdir_next == 0
    with pytest.raises(ValueError, match="ebusy_rmdir_prob"):
        config.updated({"ebusy_rmdir_prob": 2})


# --- silly rename -----------------------------------------------------------------------


@pytest.mark.fuse
def test_an_unlinked_open_file_becomes_nfs_and_blocks_rmdir_until_close_and_linger(
    nfs_mount: MountFactory,
) -> None:
    nfs = nfs_mount(linger=Linger.constant(3.0))
    d = nfs.path / "step_1"
    d.mkdir()
    (d / "shard").write_bytes(b"tensor bytes")
    with hold_open([d / "shard"]) as hold:
        os.unlink(d / "shard")
        [silly] = nfs_names(d)
        assert (d / silly).read_bytes() == b"tensor bytes"  # the open file lives on under its new name
        with pytest.raises(OSError) as rmdir:
            os.rmdir(d)
        assert rmdir.value.errno == errno.ENOTEMPTY
        with pytest.raises(OSError) as rmtree:
            shutil.rmtree(d)
        assert rmtree.value.errno == errno.EBUSY  # as Linux's NFS client: a silly-renamed file in use
        hold.release()
    # Closed, but the server keeps it for its linger: still listed, rmdir still refused.
    wait_for(lambda: nfs.stats()["lingering"] == 1, "the close to reach the filesystem")
    assert nfs_names(d) == [silly]
    with pytest.raises(OSError) as lingering:
        os.rmdir(d)
    assert lingering.value.errno == errno.ENOTEMPTY
    with pytest.raises(OSError) as unlink:
        os.unlink(d / silly)
    assert unlink.value.errno == errno.ENOENT  # its removal is in flight, yet it is listed
    assert os.path.isdir(d)
    assert nfs.wait_idle(timeout=30)
    assert nfs_names(d) == []
    os.rmdir(d)
    stats = nfs.stats()
    assert (stats["silly_renames"], stats["reaped"], stats["lingers"]) == (1, 1, [3.0])
    assert stats["rmdir_enotempty"] == 2
    assert not list(nfs.backing.rglob(".fuse_hidden*"))  # libfuse's names never reach the backing store


@pytest.mark.fuse
def test_a_closed_file_leaves_nothing_behind(nfs_mount: MountFactory) -> None:
    nfs = nfs_mount(linger=Linger.constant(3.0))
    d = nfs.path / "d"
    d.mkdir()
    (d / "f").write_bytes(b"x")
    with hold_open([d / "f"]):
        pass
    assert nfs.wait_idle(timeout=30)  # the asynchronous release has reached the filesystem
    os.unlink(d / "f")
    os.rmdir(d)
    assert nfs.stats()["silly_renames"] == 0


@pytest.mark.fuse
def test_replacing_a_file_open_elsewhere_leaves_the_old_one_as_nfs(nfs_mount: MountFactory) -> None:
    nfs = nfs_mount(linger=Linger.constant(0.2))
    d = nfs.path / "step_3"
    d.mkdir()
    (d / "metadata.json").write_text('{"pinned": false}')
    (d / ".metadata.json.tmp").write_text('{"pinned": true}')
    with hold_open([d / "metadata.json"]):
        os.replace(d / ".metadata.json.tmp", d / "metadata.json")
        assert (d / "metadata.json").read_text() == '{"pinned": true}'
        [silly] = nfs_names(d)
        assert (nfs.backing / "step_3" / silly).read_text() == '{"pinned": false}'
    assert nfs.wait_idle(timeout=30)
    assert sorted(os.listdir(d)) == ["metadata.json"]


@pytest.mark.fuse
def test_a_nfs_file_follows_its_directory_when_that_is_renamed(nfs_mount: MountFactory) -> None:
    nfs = nfs_mount(linger=Linger.constant(0.2))
    step, trash = nfs.path / "step_5", nfs.path / ".trash"
    step.mkdir()
    trash.mkdir()
    (step / "shard").write_bytes(b"x")
    with FileHolder() as holder:
        holder.hold([step / "shard"])
        os.unlink(step / "shard")
        os.rename(step, trash / "step_5.pruned.0123456789ab")
        assert len(nfs_names(trash / "step_5.pruned.0123456789ab")) == 1
    assert nfs.wait_idle(timeout=30)
    os.rmdir(trash / "step_5.pruned.0123456789ab")


@pytest.mark.fuse
def test_the_linger_draws_follow_the_seeded_stream(nfs_mount: MountFactory) -> None:
    linger = Linger(seed=11, fast_max=0.05, slow_prob=0.3, slow=0.2)
    nfs = nfs_mount(linger=linger)
    d = nfs.path / "d"
    d.mkdir()
    for i in range(6):
        (d / f"f{i}").write_bytes(b"x")
        with hold_open([d / f"f{i}"]):
            os.unlink(d / f"f{i}")
        wait_for(lambda i=i: len(nfs.stats()["lingers"]) == i + 1, "the close to reach the filesystem")
    assert nfs.stats()["lingers"] == linger.sample(6)
    nfs.configure(linger=Linger.constant(0.01))  # at run time; the stream restarts
    (d / "g").write_bytes(b"x")
    with hold_open([d / "g"]):
        os.unlink(d / "g")
    assert nfs.wait_idle(timeout=30)
    assert nfs.stats()["lingers"][-1] == 0.01


# --- EBUSY, rename flags ----------------------------------------------------------------


@pytest.mark.fuse
def test_ebusy_is_injected_into_rmdir_at_mount_time_and_at_run_time(nfs_mount: MountFactory) -> None:
    nfs = nfs_mount(ebusy_rmdir_next=2)

    def rmdir_errno(name: str) -> int:
        (nfs.path / name).mkdir(exist_ok=True)
        try:
            os.rmdir(nfs.path / name)
        except OSError as e:
            return e.errno or -1
        return 0

    assert [rmdir_errno("a") for _ in range(3)] == [errno.EBUSY, errno.EBUSY, 0]
    nfs.configure(ebusy_rmdir_next=1)
    assert [rmdir_errno("b") for _ in range(2)] == [errno.EBUSY, 0]
    nfs.configure(ebusy_rmdir_prob=1.0)
    assert [rmdir_errno("c") for _ in range(3)] == [errno.EBUSY] * 3
    nfs.configure(ebusy_rmdir_prob=0.5, seed=4)
    outcomes = [rmdir_errno("d") for _ in range(40)]
    assert 0 < outcomes.count(errno.EBUSY) < 40
    nfs.configure(ebusy_rmdir_prob=0.0)
    assert rmdir_errno("e") == 0
    assert nfs.stats()["ebusy_injected"] == 2 + 1 + 3 + outcomes.count(errno.EBUSY)
    with pytest.raises(ValueError, match="ebusy_rmdir_prob"):
        nfs.configure(ebusy_rmdir_prob=3.0)


@pytest.mark.fuse
def test_there_is_no_rename_exchange_as_on_nfs(nfs_mount: MountFactory) -> None:
    nfs = nfs_mount()
    (nfs.path / "a").mkdir()
    (nfs.path / "b").mkdir()
    with pytest.raises(OSError) as exchange:
        FileOps().exchange(nfs.path / "a", nfs.path / "b")
    assert exchange.value.errno == errno.EINVAL
    assert sorted(os.listdir(nfs.path)) == ["a", "b"]


# --- mounting and unmounting --------------------------------------------------------------


@pytest.mark.fuse
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "file-held-open"])
def test_the_mount_is_cleaned_up_when_the_body_raises(tmp_path: Path, busy: bool) -> None:
    mnt = tmp_path / "mnt"
    holder = FileHolder()
    try:
        with pytest.raises(RuntimeError, match="the body failed"), mount_nfs(tmp_path / "b", mnt) as nfs:
            assert is_mounted(mnt) and os.path.ismount(mnt)
            (nfs.path / "f").write_bytes(b"x")
            if busy:  # a plain unmount is refused: the lazy one must take over
                holder.hold([nfs.path / "f"])
            process = nfs.process
            raise RuntimeError("the body failed")
    finally:
        holder.close()
    assert not is_mounted(mnt)
    assert process.returncode is not None
    assert (tmp_path / "b" / "f").read_bytes() == b"x"


@pytest.mark.fuse
def test_mounting_over_a_mount_point_says_so(nfs_mount: MountFactory) -> None:
    nfs = nfs_mount()
    with pytest.raises(NFSMountError, match="already a mount point"), mount_nfs(nfs.backing, nfs.path):
        pass
    assert is_mounted(nfs.path)


@pytest.mark.fuse
def test_the_filesystem_unmounts_itself_when_its_parent_goes_away(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "m").mkdir()
    process = subprocess.Popen(
        [sys.executable, nfsfs.__file__, str(tmp_path / "b"), str(tmp_path / "m")],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: os.path.ismount(tmp_path / "m"), "the mount")
        assert process.stdin is not None
        process.stdin.close()  # what a killed test run does to its filesystem
        assert process.wait(timeout=30) == 0
        assert not is_mounted(tmp_path / "m")
    finally:
        if is_mounted(tmp_path / "m"):
            subprocess.run(["fusermount3", "-u", "-z", str(tmp_path / "m")], check=False)
        process.kill()
        process.wait()


def test_the_root_dir_fixture_gives_a_fresh_root_on_each_filesystem(root_dir: Path) -> None:
    assert not root_dir.exists()
    assert root_dir.parent.is_dir()
    root_dir.mkdir()
    (root_dir / "x").write_bytes(b"x")
    assert os.listdir(root_dir) == ["x"]
