"""Atomic writes, the ``latest`` pointer (symlink and small-file forms), and directory replacement."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from faults import FaultyFileOps
from safeckpt._fs.atomic import atomic_write, read_pointer, replace_dir, swap_pointer
from safeckpt._fs.fileops import FileOps


@pytest.fixture
def ops() -> FaultyFileOps:
    return FaultyFileOps()


@pytest.fixture
def d(root: Path) -> Path:
    root.mkdir()
    return root


def names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# --- atomic_write --------------------------------------------------------------------------------


def test_atomic_write_creates_and_replaces(d: Path, ops: FaultyFileOps) -> None:
    target = d / "f.json"
    atomic_write(target, b"one", ops)
    atomic_write(target, b"two!", ops)
    assert target.read_bytes() == b"two!"
    assert names(d) == ["f.json"]
    ops_seen = [(c.op, c.paths[-1].name if c.paths else None) for c in ops.calls]
    tmp = ops.calls[0].paths[0].name
    assert tmp.startswith(".f.json.tmp.")
    assert ops_seen[:3] == [("write_file", tmp), ("replace", "f.json"), ("fsync_dir", d.name)]
    assert ops.calls[1].paths == (d / tmp, target)


@pytest.mark.parametrize(
    "op,partial",
    [
        pytest.param("write_file", True, id="torn-write"),
        pytest.param("write_file", False, id="write-fails"),
        pytest.param("replace", False, id="replace-fails"),
    ],
)
def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temp(
    d: Path, ops: FaultyFileOps, op: str, partial: bool
) -> None:
    target = d / "f.json"
    atomic_write(target, b"old contents", ops)
    ops.fail(op, errno.EIO, partial=partial)
    with pytest.raises(OSError, match="Input/output error"):
        atomic_write(target, b"new contents, longer than the old", ops)
    assert target.read_bytes() == b"old contents"
    assert names(d) == ["f.json"]


# --- the latest pointer ------------------------------------------------------------------------------


def test_swap_pointer_makes_and_moves_a_symlink(d: Path, ops: FaultyFileOps) -> None:
    latest = d / "latest"
    swap_pointer(latest, "step_3", ops)
    assert latest.is_symlink() and os.readlink(latest) == "step_3"
    swap_pointer(latest, "step_4", ops)
    assert os.readlink(latest) == "step_4"
    assert read_pointer(latest) == "step_4"
    assert names(d) == ["latest"]
    assert [c.op for c in ops.calls[-3:]] == ["symlink", "replace", "fsync_dir"]


NO_SYMLINKS = [
    pytest.param(errno.EPERM, id="EPERM"),
    pytest.param(errno.ENOSYS, id="ENOSYS"),
    pytest.param(errno.EOPNOTSUPP, id="EOPNOTSUPP"),
    pytest.param(errno.EINVAL, id="EINVAL"),
]


@pytest.mark.parametrize("err", NO_SYMLINKS)
def test_swap_pointer_falls_back_to_a_small_file(d: Path, ops: FaultyFileOps, err: int) -> None:
    latest = d / "latest"
    ops.fail("symlink", err, times=None)
    swap_pointer(latest, "step_3", ops)
    assert not latest.is_symlink() and latest.read_text() == "step_3\n"
    assert read_pointer(latest) == "step_3"
    swap_pointer(latest, "step_10", ops)
    assert read_pointer(latest) == "step_10"
    assert names(d) == ["latest"]
    assert [c.op for c in ops.calls[-4:]] == ["symlink", "write_file", "replace", "fsync_dir"]


def test_swap_pointer_switches_between_the_two_forms(d: Path, ops: FaultyFileOps) -> None:
    latest = d / "latest"
    swap_pointer(latest, "step_1", ops)
    ops.fail("symlink", errno.EPERM)
    swap_pointer(latest, "step_2", ops)  # a symlink replaced by a file (not written through)
    assert not latest.is_symlink() and read_pointer(latest) == "step_2"
    swap_pointer(latest, "step_3", ops)  # and back
    assert latest.is_symlink() and read_pointer(latest) == "step_3"
    assert names(d) == ["latest"]


@pytest.mark.parametrize("err", [errno.EACCES, errno.ENOSPC, errno.EEXIST])
def test_a_real_symlink_error_is_raised_and_the_pointer_stays(d: Path, ops: FaultyFileOps, err: int) -> None:
    latest = d / "latest"
    swap_pointer(latest, "step_1", ops)
    ops.fail("symlink", err)
    with pytest.raises(OSError) as info:
        swap_pointer(latest, "step_2", ops)
    assert info.value.errno == err
    assert read_pointer(latest) == "step_1"
    assert names(d) == ["latest"]


def test_a_failed_pointer_replace_leaves_no_temp_link(d: Path, ops: FaultyFileOps) -> None:
    latest = d / "latest"
    swap_pointer(latest, "step_1", ops)
    ops.fail("replace", errno.EIO)
    with pytest.raises(OSError):
        swap_pointer(latest, "step_2", ops)
    assert read_pointer(latest) == "step_1"
    assert names(d) == ["latest"]


POINTERS = [
    pytest.param(lambda p: os.symlink("step_7", p), "step_7", id="symlink"),
    pytest.param(lambda p: os.symlink("step_8", p), "step_8", id="dangling-symlink-still-names"),
    pytest.param(lambda p: p.write_text("step_9\n"), "step_9", id="file"),
    pytest.param(lambda p: p.write_text("  step_9 \n\n"), "step_9", id="file-with-whitespace"),
    pytest.param(lambda p: p.write_text(""), None, id="empty-file"),
    pytest.param(lambda p: p.write_text(" \n"), None, id="blank-file"),
    pytest.param(lambda p: p.write_bytes(b"\xff\xfe\x00\x81"), None, id="binary-garbage"),
    pytest.param(lambda p: p.mkdir(), None, id="a-directory"),
    pytest.param(lambda p: None, None, id="missing"),
]


@pytest.mark.parametrize("make,expected", POINTERS)
def test_read_pointer(d: Path, make: object, expected: str | None) -> None:
    latest = d / "latest"
    make(latest)  # type: ignore[operator]
    assert read_pointer(latest) == expected


def test_read_pointer_returns_text_garbage_as_is(d: Path) -> None:
    # The caller parses the name (parse_step_dirname), so text that is not a step comes back verbatim.
    (d / "latest").write_text("not a step\n")
    assert read_pointer(d / "latest") == "not a step"


# --- replace_dir ---------------------------------------------------------------------------------


def make_dir(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    (path / "which").write_text(content)
    (path / "data.bin").write_bytes(content.encode() * 10)
    return path


class Paths:
    def __init__(self, d: Path) -> None:
        (d / ".trash").mkdir()
        self.src = make_dir(d / ".staging" / "step_5.0123456789ab", "new")
        self.dst = d / "step_5"
        self.displaced = d / ".trash" / "step_5.replaced.aaaaaaaaaaaa"
        self.retired = d / ".trash" / "step_5.pruned.bbbbbbbbbbbb"

    def replace(self, ops: FileOps) -> bool:
        return replace_dir(self.src, self.dst, self.displaced, self.retired, ops)


def exchange_supported(d: Path) -> bool:
    (d / "xa").mkdir()
    (d / "xb").mkdir()
    try:
        FileOps().exchange(d / "xa", d / "xb")
        return True
    except OSError:
        return False
    finally:
        (d / "xa").rmdir()
        (d / "xb").rmdir()


def test_replace_dir_into_a_free_name(d: Path, ops: FaultyFileOps) -> None:
    p = Paths(d)
    assert p.replace(ops) is False
    assert (p.dst / "which").read_text() == "new"
    assert not p.src.exists() and names(d / ".trash") == []
    assert [c.op for c in ops.calls] == ["replace", "fsync_dir"]


def test_replace_dir_with_rename_exchange(d: Path, ops: FaultyFileOps) -> None:
    if not exchange_supported(d):
        pytest.skip("this filesystem has no renameat2(RENAME_EXCHANGE)")
    p = Paths(d)
    make_dir(p.dst, "old")
    assert p.replace(ops) is True
    assert (p.dst / "which").read_text() == "new"
    assert (p.retired / "which").read_text() == "old"
    assert not p.src.exists() and not p.displaced.exists()
    mutations = [(c.op, c.paths) for c in ops.calls if c.op != "fsync_dir"]
    # One atomic swap: at no instant is step_5 missing; the old copy then leaves the staging name.
    assert mutations == [("exchange", (p.src, p.dst)), ("replace", (p.src, p.retired))]


@pytest.mark.parametrize(
    "err",
    [
        pytest.param(errno.EINVAL, id="EINVAL"),
        pytest.param(errno.ENOSYS, id="ENOSYS"),
        pytest.param(errno.ENOTSUP, id="ENOTSUP"),
        # a FUSE filesystem that drops the flag turns the exchange into a failing plain rename
        pytest.param(errno.ENOTEMPTY, id="ENOTEMPTY"),
    ],
)
def test_replace_dir_falls_back_to_two_renames(d: Path, ops: FaultyFileOps, err: int) -> None:
    p = Paths(d)
    make_dir(p.dst, "old")
    ops.fail("exchange", err)
    assert p.replace(ops) is True
    assert (p.dst / "which").read_text() == "new"
    assert (p.retired / "which").read_text() == "old"
    assert not p.src.exists() and not p.displaced.exists()
    mutations = [(c.op, c.paths) for c in ops.calls if c.op != "fsync_dir"]
    assert mutations == [
        ("exchange", (p.src, p.dst)),
        ("replace", (p.dst, p.displaced)),
        ("replace", (p.src, p.dst)),
        ("replace", (p.displaced, p.retired)),
    ]
    # The displaced name is made durable before the new copy takes the step's name.
    ops_order = [c.op for c in ops.calls]
    assert ops_order[ops_order.index("replace") + 1] == "fsync_dir"


def test_a_real_exchange_error_is_raised_and_nothing_moves(d: Path, ops: FaultyFileOps) -> None:
    p = Paths(d)
    make_dir(p.dst, "old")
    ops.fail("exchange", errno.EACCES)
    with pytest.raises(PermissionError):
        p.replace(ops)
    assert (p.dst / "which").read_text() == "old"
    assert (p.src / "which").read_text() == "new"
    assert names(d / ".trash") == []


def test_a_failed_second_rename_puts_the_old_copy_back(d: Path, ops: FaultyFileOps) -> None:
    p = Paths(d)
    make_dir(p.dst, "old")
    ops.fail("exchange", errno.EINVAL)
    ops.fail("replace", errno.EIO, match=lambda paths: paths == (p.src, p.dst))
    with pytest.raises(OSError, match="Input/output error"):
        p.replace(ops)
    assert (p.dst / "which").read_text() == "old"
    assert (p.src / "which").read_text() == "new"
    assert names(d / ".trash") == []
