"""Start-up of the ``safeckpt`` command: help, a usage error and ``ls`` import no torch.

Not timed (a loaded machine would make that flaky): the real command runs in a
subprocess with ``PYTHONPROFILEIMPORTTIME=1``, and the test reads which modules
it imported. ``benchmarks/bench_startup.py`` gives the times.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import safeckpt
from safeckpt import CheckpointManager
from safeckpt.cli.parser import EXPORT_DTYPES, EXPORT_FORMATS, EXPORT_SHARD_SIZE, Runs, build_parser

# torch and what only tensors need; rich too, where nothing is printed with it
TENSORS = ("torch", "numpy", "safetensors")
HEAVY = (*TENSORS, "rich")


def command() -> list[str]:
    """The console script when it is installed (as a user runs it), else ``python -m safeckpt``."""
    script = Path(sys.executable).parent / "safeckpt"
    return [str(script)] if script.exists() else [sys.executable, "-m", "safeckpt"]


def run(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``safeckpt args``; return the process and the top-level packages it imported."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "COLUMNS": "80"}
    env.pop("SAFECKPT_DEBUG", None)
    proc = subprocess.run([*command(), *args], capture_output=True, text=True, env=env, timeout=120)
    # "import time: self [us] | cumulative | imported package", one line per module imported
    imported = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "safeckpt" in imported, proc.stderr[-2000:]  # what is read is the command's import log
    return proc, imported


def errors(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local root with one committed checkpoint."""
    root = tmp_path_factory.mktemp("startup") / "ckpt"
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(7, {"model": nn.Linear(4, 2), "ema": torch.zeros(3)}, metrics={"loss": 0.5})
    return root


@pytest.mark.parametrize("args", [["--help"], ["ls", "--help"], ["export", "--help"], ["demo", "--help"]])
def test_help_imports_no_torch_nor_rich(args: list[str]) -> None:
    proc, imported = run(*args)
    assert proc.returncode == 0, errors(proc)
    assert "usage: safeckpt" in proc.stdout
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


@pytest.mark.parametrize(
    "args",
    [["lss"], ["ls"], ["verify", "ROOT", "--step", "x"], ["export", "ROOT", "--to", "o", "--dtype", "f8"]],
)
def test_a_bad_argument_is_one_line_and_imports_no_torch(args: list[str]) -> None:
    proc, imported = run(*args)
    assert proc.returncode == 2
    assert len(errors(proc)) == 1 and "error:" in errors(proc)[0], errors(proc)
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


@pytest.mark.parametrize("json", [False, True], ids=["table", "json"])
def test_ls_of_a_local_root_imports_no_torch(root: Path, json: bool) -> None:
    proc, imported = run("ls", str(root), *(["--json"] if json else []))
    assert proc.returncode == 0, errors(proc)
    assert '"step": 7' in proc.stdout if json else "committed" in proc.stdout
    assert not imported & set(TENSORS), sorted(imported & set(TENSORS))


def test_import_safeckpt_imports_no_torch_until_a_heavy_name_is_used() -> None:
    code = (
        "import sys, safeckpt\n"
        "before = 'torch' in sys.modules\n"
        "names = {}\n"
        "exec('from safeckpt import *', names)\n"
        "missing = [n for n in safeckpt.__all__ if n not in names]\n"
        "print(before, 'torch' in sys.modules, missing, names['CheckpointManager'].__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True", "[]", "safeckpt._manager.manager"]
    assert set(safeckpt.__all__) <= set(dir(safeckpt))


def test_every_command_names_a_function_that_exists() -> None:
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert len(commands) == 12
    for name, parser in commands.items():
        runs = parser.get_default("func")
        assert isinstance(runs, Runs), name
        assert callable(runs.resolve()), name


def test_exports_options_agree_with_the_library() -> None:
    from safeckpt._ops.export import DEFAULT_SHARD_SIZE, DTYPES, FORMATS, SAFETENSORS

    assert EXPORT_FORMATS == FORMATS and EXPORT_FORMATS[0] == SAFETENSORS
    assert tuple(DTYPES) == EXPORT_DTYPES
    assert EXPORT_SHARD_SIZE == DEFAULT_SHARD_SIZE
