"""``safeckpt register``: a failed registration retried with the registrar its record names, new
registrations with --registrar, and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from safeckpt import CheckpointManager, read_record
from safeckpt._registration.registrar import JsonlIndexRegistrar
from safeckpt.cli import main


def run_cli(*args: Any) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "safeckpt"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "safeckpt"]
    env = {k: v for k, v in os.environ.items() if k != "SAFECKPT_DEBUG"}
    return subprocess.run(
        [*command, *map(str, args)], capture_output=True, text=True, env=env, timeout=180, check=False
    )


def status(root: Path, step: int) -> str | None:
    registration = read_record(root / f"step_{step}").registration
    return None if registration is None else registration["status"]


def test_register_retries_a_failed_registration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, index = tmp_path / "ckpt", tmp_path / "index.jsonl"
    index.mkdir()  # appending to a directory fails: the registration fails, the save does not
    with CheckpointManager(root, async_save=False, registrar=JsonlIndexRegistrar(index)) as mgr:
        mgr.save(1, {"w": torch.zeros(2)})
    assert status(root, 1) == "failed"

    assert main(["register", str(root)]) == 1  # still failing
    assert "step 1: failed" in capsys.readouterr().out
    index.rmdir()
    proc = run_cli("register", root, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["schema_version"] == 1 and data["ok"] is True
    assert data["results"] == [{"step": 1, "status": "registered"}]
    assert status(root, 1) == "registered"
    assert json.loads(index.read_text())["step"] == 1

    assert main(["register", str(root)]) == 0
    assert "nothing to register" in capsys.readouterr().out


def committed_root(tmp_path: Path) -> tuple[Path, Path, str]:
    root, index = tmp_path / "ckpt", tmp_path / "index.jsonl"
    with CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.zeros(2)}, metrics={"loss": 1.0 / step})
    return root, index, json.dumps({"kind": "jsonl", "index_path": str(index)})


def test_register_a_step_with_a_registrar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, index, registrar = committed_root(tmp_path)
    for step in (2, 1, 2):
        assert main(["register", str(root), "--step", str(step), "--registrar", registrar, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["results"] == [{"step": step, "status": "registered"}]
    assert [json.loads(line)["step"] for line in index.read_text().splitlines()] == [2, 1, 2]
    assert status(root, 1) == status(root, 2) == "registered"


def test_register_with_a_registrar_adds_every_missing_registration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, index, registrar = committed_root(tmp_path)
    assert main(["register", str(root), "--registrar", registrar, "--json"]) == 0
    assert [r["step"] for r in json.loads(capsys.readouterr().out)["results"]] == [1, 2]
    assert [json.loads(line)["step"] for line in index.read_text().splitlines()] == [1, 2]


def test_register_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.zeros(2)})
    assert main(["register", str(root), "--step", "15"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no committed checkpoint of step 15" in err

    assert main(["register", str(root), "--registrar", "{not json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--registrar must be a registrar's JSON" in err

    assert main(["register", str(root), "--registrar", '{"kind": "nope"}']) == 2
    assert "cannot rebuild a registrar of kind 'nope'" in capsys.readouterr().err

    assert main(["register", str(root), "--step", "1"]) == 1  # its record names no registrar
    assert "step 1: no registrar (its record names no registrar; pass --registrar)" in capsys.readouterr().out
