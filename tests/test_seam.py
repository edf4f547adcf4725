"""Nothing above the storage seam touches a root's files itself: every name and byte goes through a Store.

The layers below the seam (``_fs``, ``_storage``, ``_posix``, ``_util``) are the
local implementation; the test helpers in ``safeckpt.testing`` build filesystems.
Every other module may reach a root only through :class:`safeckpt._store.base.Store`,
so a second store (object storage) needs no change above it. A handful of modules
write files that are not a root's, each named below with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "safeckpt"

BELOW_THE_SEAM = ("_fs/", "_storage/", "_posix/", "_util/", "testing/")

NOT_A_ROOT = {
    # the user's registration index file (a JSON-lines log outside any root)
    "_registration/registrar.py",
    # stdout's replacement when the reader of a pipe went away
    "cli/common.py",
    # the demo's exported weights file, where the user asked for it
    "cli/demo_run.py",
    # the Trainer's own checkpoint-N folder (an import) and the temporary folder its resume reads
    "hf/trainer.py",
    "hf/trainer_state.py",
}

OS_CALLS = {
    "access", "chmod", "chown", "close", "fdatasync", "fstat", "fsync", "ftruncate", "link", "listdir",
    "lseek", "lstat", "makedirs", "mkdir", "open", "posix_fadvise", "posix_fallocate", "pread", "pwrite",
    "read", "readlink", "remove", "removedirs", "rename", "renames", "replace", "rmdir", "scandir",
    "sendfile", "stat", "statvfs", "symlink", "truncate", "unlink", "utime", "walk", "write",
}  # fmt: skip
OS_PATH_CALLS = {
    "exists", "getmtime", "getsize", "isdir", "isfile", "islink", "ismount", "lexists", "realpath",
}  # fmt: skip
PATH_METHODS = {
    "chmod", "exists", "glob", "hardlink_to", "is_dir", "is_file", "is_mount", "is_symlink", "iterdir",
    "lchmod", "lstat", "mkdir", "read_bytes", "read_text", "readlink", "rename", "rglob", "rmdir",
    "samefile", "stat", "symlink_to", "touch", "unlink", "write_bytes", "write_text",
}  # fmt: skip
FILE_MODES = {"r", "rb", "w", "wb", "a", "ab", "x", "xb", "r+", "r+b", "rb+", "w+b", "wb+"}


def file_io_in(source: str) -> list[str]:
    """``line: call`` for each call in ``source`` that reaches a file without a store."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in ("os", "shutil", "os.path"):
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names]
        if isinstance(node, ast.Import) and any(a.name == "shutil" for a in node.names):
            found.append(f"{node.lineno}: import shutil")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "open":
            found.append(f"{node.lineno}: open()")
        if not isinstance(func, ast.Attribute):
            continue
        owner = func.value
        if isinstance(owner, ast.Name) and owner.id == "os" and func.attr in OS_CALLS:
            found.append(f"{node.lineno}: os.{func.attr}()")
        elif isinstance(owner, ast.Name) and owner.id == "shutil":
            found.append(f"{node.lineno}: shutil.{func.attr}()")
        elif (
            isinstance(owner, ast.Attribute)
            and isinstance(owner.value, ast.Name)
            and (owner.value.id, owner.attr) == ("os", "path")
            and func.attr in OS_PATH_CALLS
        ):
            found.append(f"{node.lineno}: os.path.{func.attr}()")
        elif func.attr in PATH_METHODS:
            found.append(f"{node.lineno}: .{func.attr}()")
        elif func.attr == "replace" and len(node.args) == 1 and not node.keywords:
            # Path.replace(target); str.replace takes two, dataclasses.replace keywords
            if not (isinstance(owner, ast.Name) and owner.id == "dataclasses"):
                found.append(f"{node.lineno}: .replace()")
        elif func.attr == "open" and any(
            isinstance(a, ast.Constant) and a.value in FILE_MODES
            for a in [*node.args, *(k.value for k in node.keywords)]
        ):
            found.append(f"{node.lineno}: .open(mode)")
    return found


def modules_above_the_seam() -> list[str]:
    names = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
    return [n for n in names if not n.startswith(BELOW_THE_SEAM)]


@pytest.mark.parametrize("module", modules_above_the_seam())
def test_no_module_above_the_seam_touches_a_file_itself(module: str) -> None:
    found = file_io_in((PACKAGE / module).read_text())
    if module in NOT_A_ROOT:
        assert found, f"{module} no longer writes files itself: take it off NOT_A_ROOT"
    else:
        assert found == [], f"{module} reaches files without its store: {found}"


@pytest.mark.parametrize(
    "snippet",
    [
        "os.unlink(path)",
        "os.path.isdir(path)",
        "shutil.rmtree(path)",
        "from os import replace",
        "import shutil",
        "open(path, 'rb')",
        "path.iterdir()",
        "path.replace(other)",
        "path.open('wb')",
        "(root / 'latest').readlink()",
    ],
)
def test_the_scan_finds_each_way_of_reaching_a_file(snippet: str) -> None:
    assert file_io_in(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    ["dataclasses.replace(record, pinned=True)", "name.replace('.', '%2E')", "session.open()", "os.getpid()"],
)
def test_the_scan_leaves_alone_what_touches_no_file(snippet: str) -> None:
    assert file_io_in(snippet) == [], snippet
