"""``safeckpt export`` / ``import`` and :mod:`safeckpt.export`: weights out as safetensors or an
HF folder (also from a 2-rank sharded checkpoint), atomic and never over an existing output
without --force, a group of tensors at a time; and back in as a checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from safeckpt import CheckpointManager
from safeckpt._dcp import io as dcp_io
from safeckpt._ops.inspection import inspect_checkpoint
from safeckpt.cli import main
from safeckpt.export import INDEX_NAME, export_weights


def run_cli(*args: Any) -> subprocess.CompletedProcess[str]:
    """The real ``safeckpt`` command in a subprocess (the console script when installed)."""
    script = Path(sys.executable).parent / "safeckpt"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "safeckpt"]
    env = {k: v for k, v in os.environ.items() if k != "SAFECKPT_DEBUG"}
    return subprocess.run(
        [*command, *map(str, args)], capture_output=True, text=True, env=env, timeout=180, check=False
    )


def build_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    model.register_buffer("steps", torch.tensor([3, 4], dtype=torch.int64))
    return model


def expected_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A root with steps 1 and 2 of {model, optim}; the weights of step 2."""
    root = tmp_path / "ckpt"
    model = build_model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    with CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2):
            model(torch.randn(2, 16)).sum().backward()
            optim.step()
            mgr.save(step, {"model": model, "optim": optim})
    return root, expected_weights(model)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        assert torch.equal(got[key], value), key


def test_export_one_file_equals_the_state_dict(saved: tuple[Path, dict], tmp_path: Path) -> None:
    root, want = saved
    out = tmp_path / "out" / "model.safetensors"
    proc = run_cli("export", root, "--to", out, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["schema_version"] == 1 and data["step"] == 2 and data["format"] == "safetensors"
    assert data["tensors"] == len(want) and data["bytes"] == out.stat().st_size - _header_size(out)
    assert_same(load_file(str(out)), want)
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.safetensors"]  # no temp left


def _header_size(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def test_export_hf_folder_in_shards_with_a_dtype(saved: tuple[Path, dict], tmp_path: Path) -> None:
    root, want = saved
    out = tmp_path / "hf"
    argv = ["export", str(root), "--to", str(out), "--format", "hf", "--shard-size", "1KB", "--dtype", "bf16"]
    assert main([*argv, "--step", "2"]) == 0
    index = json.loads((out / INDEX_NAME).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(index["weight_map"]) == sorted(want)
    assert sorted(set(index["weight_map"].values())) == shards
    got: dict[str, torch.Tensor] = {}
    for name in shards:
        got.update(load_file(str(out / name)))
    converted = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in want.items()}
    assert_same(got, converted)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in converted.values())
    # each shard is at most 1 kB unless it holds a single larger tensor
    for name in shards:
        tensors = load_file(str(out / name))
        assert len(tensors) == 1 or sum(v.numel() * v.element_size() for v in tensors.values()) <= 1000


def test_export_refuses_to_overwrite_without_force(
    saved: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, want = saved
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"precious")
    assert main(["export", str(root), "--to", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists already; pass --force" in err
    assert out.read_bytes() == b"precious"
    assert main(["export", str(root), "--to", str(out), "--force"]) == 0
    assert_same(load_file(str(out)), want)

    folder = tmp_path / "hf"
    assert main(["export", str(root), "--to", str(folder), "--format", "hf", "--step", "1"]) == 0
    assert main(["export", str(root), "--to", str(folder), "--format", "hf"]) == 1
    assert main(["export", str(root), "--to", str(folder), "--format", "hf", "--force"]) == 0
    assert_same(load_file(str(folder / "model-00001-of-00001.safetensors")), want)  # step 2 now
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize(
    ("argv", "code", "text"),
    [
        pytest.param(
            ["--key", "nope"], 2, "no tensors under the key 'nope'; its keys are model, optim", id="key"
        ),
        pytest.param(["--step", "7"], 1, "step_7", id="step"),
        pytest.param(["--shard-size", "lots"], 2, "must be a size like 5GB", id="size"),
    ],
)
def test_export_errors_are_one_line(
    saved: tuple[Path, dict],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    code: int,
    text: str,
) -> None:
    root, _ = saved
    out = tmp_path / "m.safetensors"
    try:
        assert main(["export", str(root), "--to", str(out), *argv]) == code
    except SystemExit as e:  # argparse: a usage error
        assert e.code == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and text in err, err
    assert not out.exists()


def test_export_reads_a_group_of_tensors_at_a_time(
    saved: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, want = saved
    requested: list[int] = []
    real_load = dcp_io.load

    def spy(state_dict: dict[str, Any], directory: Path, group: Any, **kwargs: Any) -> None:
        requested.append(sum(t.numel() * t.element_size() for t in state_dict.values()))
        real_load(state_dict, directory, group, **kwargs)

    monkeypatch.setattr(dcp_io, "load", spy)
    budget = 600
    result = export_weights(root, tmp_path / "m.safetensors", read_budget=budget)
    largest = max(v.numel() * v.element_size() for v in want.values())
    assert len(requested) > 2
    assert max(requested) <= max(budget, largest)
    assert sum(requested) == result.bytes
    assert_same(load_file(str(tmp_path / "m.safetensors")), want)


def test_import_then_restore_gives_the_same_weights(
    saved: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, want = saved
    exported = tmp_path / "m.safetensors"
    assert main(["export", str(root), "--to", str(exported)]) == 0
    new_root = tmp_path / "finetune"
    proc = run_cli("import", exported, "--to", new_root, "--step", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["path"] == str(new_root / "step_0")

    fresh = build_model(seed=5)
    with CheckpointManager(new_root) as mgr:
        restored = mgr.restore({"model": fresh})
    assert (getattr(restored, "step", restored)) == 0
    assert_same(expected_weights(fresh), want)

    # an HF folder imports the same way; a second import of step 0 needs --overwrite
    folder = tmp_path / "hf"
    assert main(["export", str(root), "--to", str(folder), "--format", "hf", "--shard-size", "1KB"]) == 0
    assert main(["import", str(folder), "--to", str(new_root), "--step", "0"]) == 1
    assert "has a checkpoint of step 0 already; pass --overwrite" in capsys.readouterr().err
    assert main(["import", str(folder), "--to", str(new_root), "--step", "0", "--overwrite"]) == 0
    fresh = build_model(seed=6)
    with CheckpointManager(new_root) as mgr:
        mgr.restore({"model": fresh})
    assert_same(expected_weights(fresh), want)


def test_import_missing_weights_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["import", str(tmp_path / "nope.safetensors"), "--to", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.distributed
def test_export_of_a_two_rank_sharded_checkpoint(tmp_path: Path) -> None:
    from test_distributed import launch, results_of

    root, results = tmp_path / "ckpt", tmp_path / "results"
    results_of(launch("save_sharded", 2, root, results, async_save=False))
    record = json.loads((root / "step_3" / "metadata.json").read_text())
    assert record["world_size"] == 2
    sharded = [t["fqn"] for t in inspect_checkpoint(root, 3)["tensors"] if t.get("sharded")]
    assert "model.0.weight" in sharded  # each rank holds a piece: export must assemble them
    expected = load_file(str(results / "expected.safetensors"))
    want = {k.removeprefix("model."): v for k, v in expected.items() if k.startswith("model.")}
    assert want

    out = tmp_path / "hf"
    proc = run_cli("export", root, "--to", out, "--format", "hf", "--shard-size", "2KB", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["step"] == 3
    index = json.loads((out / INDEX_NAME).read_text())
    assert sorted(index["weight_map"]) == sorted(want)
    got: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        shard = load_file(str(out / name))
        assert all(index["weight_map"][k] == name for k in shard)
        got.update(shard)
    assert len(set(index["weight_map"].values())) > 1
    assert_same(got, want)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 << 30),
        ("10KiB", 10240),
        ("1.5G", 1_500_000_000),
        ("1048576", 1 << 20),
        ("7b", 7),
    ],
)
def test_shard_sizes_parse(text: str, size: int) -> None:
    from safeckpt.cli.args import byte_size

    assert byte_size(text) == size


@pytest.mark.parametrize("text", ["lots", "5XB", "0", "GiB", "-1MB", "1KM"])
def test_bad_shard_sizes_are_refused(text: str) -> None:
    import argparse

    from safeckpt.cli.args import byte_size

    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)
