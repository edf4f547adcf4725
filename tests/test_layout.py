"""Names and paths inside a checkpoint root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from safeckpt._format.layout import (
    ABANDONED,
    PRUNED,
    REPLACED,
    Layout,
    parse_staging_name,
    parse_step_dirname,
    parse_trash_name,
    step_dirname,
)
from stores import root as root_loc

STEP_NAMES = [
    ("step_0", 0),
    ("step_7", 7),
    ("step_1234567890123", 1234567890123),
    ("step_012", None),
    ("step_-1", None),
    ("step_", None),
    ("step_1.tmp", None),
    ("step_1\n", None),
    ("step_1 ", None),
    (" step_1", None),
    ("Step_1", None),
    ("step_\u0661", None),  # an Arabic-Indic digit: \d would take it, a step number is ASCII
    ("latest", None),
    (".staging", None),
    ("step_5.0123456789ab", None),
]


@pytest.mark.parametrize("name,step", STEP_NAMES, ids=[repr(n) for n, _ in STEP_NAMES])
def test_parse_step_dirname(name: str, step: int | None) -> None:
    assert parse_step_dirname(name) == step


@pytest.mark.parametrize("step", [0, 1, 9, 10, 10**15])
def test_step_dirname_round_trips(step: int) -> None:
    assert parse_step_dirname(step_dirname(step)) == step


TRASH_NAMES = [
    ("step_3.pruned.0123456789ab", (3, PRUNED)),
    ("step_0.replaced.abcdefabcdef", (0, REPLACED)),
    ("step_10.abandoned.000000000000", (10, ABANDONED)),
    ("step_3.deleted.0123456789ab", None),
    ("step_3.pruned.0123456789a", None),
    ("step_3.pruned.0123456789ABC", None),
    ("step_3.pruned.0123456789AB", None),
    ("step_3.pruned.0123456789ab\n", None),
    ("step_3.pruned.0123456789ab.x", None),
    ("step_03.pruned.0123456789ab", None),
    (".nfs000000000123", None),
]


@pytest.mark.parametrize("name,parsed", TRASH_NAMES, ids=[repr(n) for n, _ in TRASH_NAMES])
def test_parse_trash_name(name: str, parsed: tuple[int, str] | None) -> None:
    assert parse_trash_name(name) == parsed


STAGING_NAMES = [
    ("step_4.0123456789ab", 4),
    ("step_4.0123456789a", None),
    ("step_4.0123456789ab\n", None),
    ("step_4", None),
    ("step_4.pruned.0123456789ab", None),
]


@pytest.mark.parametrize("name,step", STAGING_NAMES, ids=[repr(n) for n, _ in STAGING_NAMES])
def test_parse_staging_name(name: str, step: int | None) -> None:
    assert parse_staging_name(name) == step


def test_paths_of_a_root(root: Path) -> None:
    layout = Layout(root_loc(root))
    assert layout.staging.where == root / ".staging"
    assert layout.trash.where == root / ".trash"
    assert layout.damaged.where == root / ".damaged"
    assert layout.latest_path.where == root / "latest"
    assert layout.step_dir(12).where == root / "step_12"
    root.mkdir()
    lock = layout.store.lock(timeout=5)
    try:
        with lock:
            assert (root / ".lock").is_file()  # the sidecar lock of a local root
    finally:
        lock.close()


def test_new_names_parse_back_and_are_unique(root: Path) -> None:
    layout = Layout(root_loc(root))
    staging = layout.staging_dir(8, "0123456789ab")
    assert staging.parent == layout.staging and parse_staging_name(staging.name) == 8
    with pytest.raises(ValueError, match="12 hex digits"):
        layout.staging_dir(8, "../escape")
    for reason in (PRUNED, REPLACED, ABANDONED):
        trash = {layout.new_trash_path(8, reason) for _ in range(100)}
        assert len(trash) == 100
        assert all(p.parent == layout.trash and parse_trash_name(p.name) == (8, reason) for p in trash)


def test_committed_dirs_sorts_numerically_and_lists_only_step_directories(root: Path) -> None:
    layout = Layout(root_loc(root))
    for step in (10, 9, 100, 0):
        layout.step_dir(step).where.mkdir(parents=True)
    (root / "step_5").write_text("a file, not a checkpoint")
    os.symlink("step_9", root / "step_6")  # a symlink to a directory is not a checkpoint
    for name in ("step_07", "latest_dir", "step_11.0123456789ab"):
        (root / name).mkdir()
    (root / ".staging" / "step_12.0123456789ab").mkdir(parents=True)
    (root / ".trash" / "step_13.pruned.0123456789ab").mkdir(parents=True)
    found = [(s, d.where) for s, d in layout.committed_dirs()]
    assert found == [(s, root / f"step_{s}") for s in (0, 9, 10, 100)]


def test_listings_of_a_missing_root_are_empty(root: Path) -> None:
    layout = Layout(root_loc(root))
    assert layout.committed_dirs() == []
    assert layout.staging_entries() == []
    assert layout.trash_entries() == []


def test_staging_and_trash_entries_are_sorted_and_complete(root: Path) -> None:
    layout = Layout(root_loc(root))
    names = ["step_2.pruned.bbbbbbbbbbbb", "step_1.replaced.aaaaaaaaaaaa", "stranger"]
    for name in names:
        (root / ".trash" / name).mkdir(parents=True)
    (root / ".staging" / "step_3.cccccccccccc").mkdir(parents=True)
    assert layout.trash_entries() == [layout.trash / n for n in sorted(names)]
    assert layout.staging_entries() == [layout.staging / "step_3.cccccccccccc"]
