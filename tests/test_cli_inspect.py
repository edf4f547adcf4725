"""``safeckpt inspect``: record, files, tensors from ``.metadata`` and the train state's JSON;
what auto-resume would take when no step is given; one-line errors for a bad root or step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import safeckpt
from notice import without_notice
from safeckpt import CheckpointManager
from safeckpt.cli import main


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": [1, 2]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


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


@pytest.fixture
def ckpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("COLUMNS", "250")
    root = tmp_path / "ckpt"
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optim = torch.optim.AdamW(model.parameters())
    counter = Counter()
    state = {"model": model, "optim": optim, "counter": counter, "epoch": 3}
    with CheckpointManager(root, async_save=False) as mgr:
        for step in (10, 20):
            model(torch.randn(3, 4)).sum().backward()
            optim.step()
            counter.n = step
            mgr.save(step, state, metrics={"loss": step / 100}, extra={"run": "a"})
    return root


def test_inspect_json_of_what_resume_would_take(ckpt: Path) -> None:
    proc = run_cli("inspect", ckpt, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["schema_version"] == 1
    assert data["step"] == 20 and data["chosen_by"] == "latest" and data["latest"] is True
    assert data["path"] == str(ckpt / "step_20")
    assert data["status"] == "committed" and data["problems"] == []
    assert data["kept_because"] == ["latest", "no retention limit"]
    assert data["record"]["metrics"] == {"loss": 0.2} and data["record"]["extra"] == {"run": "a"}
    files = {f["name"]: f for f in data["files"]}
    assert ".metadata" in files and "train_state.rank0.safetensors" in files
    assert all(f["size"] == f["recorded_size"] for f in files.values() if f["recorded_size"] is not None)
    assert data["size"] == sum(f["size"] for f in files.values())
    tensors = {t["fqn"]: t for t in data["tensors"]}
    weight = tensors["model.weight"]
    assert weight["kind"] == "tensor" and weight["dtype"] == "float32" and weight["shape"] == [2, 4]
    assert weight["bytes"] == 32 and weight["sharded"] is False
    assert weight["chunks"] == [{"offsets": [0, 0], "sizes": [2, 4], "file": weight["chunks"][0]["file"]}]
    assert weight["chunks"][0]["file"] in files
    assert tensors["model.bias"]["shape"] == [2]
    assert any(fqn.startswith("optim.state.") for fqn in tensors)
    entries = data["train_state"]["train_state.rank0.safetensors"]["entries"]
    assert entries["epoch"] == 3
    assert entries["counter"] == {"stateful": {"n": 20, "history": [1, 2]}}
    assert entries["model"] == {
        "module": {"weight": {"__tensor__": "model.weight"}, "bias": {"__tensor__": "model.bias"}}
    }
    assert entries["optim"]["optimizer"]["param_groups"][0]["lr"] == 1e-3
    assert "torch" in data["train_state"]["train_state.rank0.safetensors"]["rng"]


def test_inspect_shows_tuples_int_keys_and_dtypes_as_plain_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = {
        "shape": (3, 4),
        "by_epoch": {1: "a", 2: ("b", 3)},
        "dtype": torch.bfloat16,
        "mine": safeckpt.per_rank({"pos": (5, torch.zeros(2, dtype=torch.int64))}),
    }
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, state)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["train_state"]["train_state.rank0.safetensors"]["entries"]
    assert entries["shape"] == [3, 4]
    assert entries["by_epoch"] == {"1": "a", "2": ["b", 3]}
    assert entries["dtype"] == "torch.bfloat16"
    assert entries["mine"] == {"per_rank": {"pos": [5, {"__tensor__": {"dtype": "I64", "shape": [2]}}]}}


def test_inspect_a_given_step_or_directory(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for target in ("10", "step_10", str(ckpt / "step_10")):
        assert main(["inspect", str(ckpt), target, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["step"] == 10 and data["chosen_by"] == "given" and data["latest"] is False
        assert data["record"]["metrics"] == {"loss": 0.1}

    assert main(["inspect", str(ckpt), "10"]) == 0
    out = capsys.readouterr().out
    assert "step 10" in out and "model.weight" in out and "2x4" in out and "float32" in out
    assert '"epoch": 3' in out and "module (2 tensors)" in out and "committed" in out


def test_inspect_falls_back_like_resume_when_latest_is_broken(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = ckpt / "step_20" / "train_state.rank0.safetensors"
    with open(victim, "r+b") as f:
        f.truncate(10)
    assert main(["inspect", str(ckpt), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step"] == 10 and data["chosen_by"] == "newest complete"

    assert main(["inspect", str(ckpt), "20", "--json"]) == 0  # a damaged one is still described
    data = json.loads(capsys.readouterr().out)
    assert data["status"] == "incomplete" and data["problems"] and data["tensors"]
    assert data["kept_because"] == []


def test_inspect_errors_are_one_line(ckpt: Path, tmp_path: Path) -> None:
    proc = run_cli("inspect", ckpt, "15")
    assert proc.returncode == 1 and not proc.stdout
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("safeckpt: error: there is no checkpoint of step 15")

    proc = run_cli("inspect", tmp_path / "nope")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr

    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli("inspect", empty, "--json")
    assert proc.returncode == 1 and "no complete checkpoint" in proc.stderr and not proc.stdout
