"""The one door to torch's private symbols (``safeckpt._util.torch_private``): ``import safeckpt``
and a save and restore work with any of them missing, the switch turns them all off, each public
fallback does what the private symbol does, and no other module reaches a private symbol."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint._traverse import set_element as torch_set_element

from notice import NOTICE
from safeckpt._util import public_fallbacks
from safeckpt._util import torch_private as door

HERE = Path(__file__).resolve().parent / "support"  # the workers it starts
SRC = HERE.parent / "src" / "safeckpt"

DTENSOR = "torch.distributed.tensor"
RAW = "raw DCP storage (_StorageInfo, _StoragePrefix, _save, weights-only Unpickler)"
# What the door looks up, each as the test hides it from the door, and the fast path it turns off.
CASES: list[tuple[str, list[tuple[str, str]], str]] = [
    ("set_element", [("torch.distributed.checkpoint._traverse", "set_element")], "set_element"),
    ("dcp _traverse module", [("torch.distributed.checkpoint._traverse", "")], "set_element"),
    ("_StorageInfo", [("torch.distributed.checkpoint.filesystem", "_StorageInfo")], RAW),
    ("_StoragePrefix", [("torch.distributed.checkpoint.filesystem", "_StoragePrefix")], RAW),
    ("torch.serialization._save", [("torch.serialization", "_save")], RAW),
    ("weights-only Unpickler", [("torch._weights_only_unpickler", "Unpickler")], RAW),
    ("weights-only unpickler module", [("torch._weights_only_unpickler", "")], RAW),
    ("_foreach_copy_", [("torch", "_foreach_copy_")], "_foreach_copy_"),
    ("c10d _world", [("torch.distributed.distributed_c10d", "_world")], "distributed_c10d._world"),
    ("DTensor._local_tensor", [(DTENSOR, "DTensor._local_tensor")], "DTensor._local_tensor"),
    ("DTensor._spec", [(DTENSOR, "DTensor._spec")], "DTensor._spec"),
    (
        "SavePlanner._cached_metadata",
        [("torch.distributed.checkpoint.planner", "SavePlanner._cached_metadata")],
        "save-plan caching",
    ),
]


def run_worker(cases: list[tuple[str, list[tuple[str, str]]]], **env: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, str(HERE / "private_worker.py"), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **env},
        cwd=HERE,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_import_save_and_restore_work_with_any_private_symbol_missing() -> None:
    everything = [pair for _, hidden, _ in CASES for pair in hidden]
    cases = [("none", []), *[(name, hidden) for name, hidden, _ in CASES], ("all", everything)]
    results = {r["case"]: r for r in run_worker(cases)}
    assert set(results) == {name for name, _ in cases}
    if not door.ENABLED:  # SAFECKPT_TORCH_PRIVATE=0 reaches the worker: every case has them all off
        assert all(set(r["off"]) == set(door.available()) for r in results.values()), results
        return
    assert results["none"]["off"] == [] and results["none"]["missing"] == []
    for name, _, turned_off in CASES:
        assert results[name]["off"] == [turned_off], (name, results[name])
    assert set(results["all"]["off"]) == {off for _, _, off in CASES}


def test_the_switch_turns_every_fast_path_off_and_says_so_once() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, safeckpt, safeckpt.export\n"
            "from safeckpt._util import torch_private as d\n"
            "print(json.dumps([d.ENABLED, d.available()]))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SAFECKPT_TORCH_PRIVATE": "0"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    enabled, available = json.loads(proc.stdout)
    assert enabled is False and not any(available.values()), available
    assert [line for line in proc.stderr.splitlines() if line.startswith(NOTICE)] == [
        "safeckpt: SAFECKPT_TORCH_PRIVATE=0: torch's and Lightning's private fast paths are off; the public "
        "fallbacks run (same files, same values, slower)"
    ]


# --- each fallback does what the private symbol does -----------------------------------------------


@pytest.mark.parametrize(
    "path",
    [("a",), ("a", "b", "c"), ("a", 2), ("a", 1, "b"), ("a", 0, 1), ("x", "y"), ("a", 3, 0, "z")],
    ids=str,
)
def test_set_element_fallback_is_dcps(path: tuple[Any, ...]) -> None:
    def start() -> dict[str, Any]:
        return {"a": {"b": {"c": 0}}, "x": {}}

    ours, theirs = start(), start()
    if path[:2] in (("a", 2), ("a", 1), ("a", 0), ("a", 3)):
        ours["a"], theirs["a"] = [None], [None]  # a list on the way: DCP extends it
    public_fallbacks.set_element(ours, path, "v")
    torch_set_element(theirs, path, "v")
    assert ours == theirs


def test_copy_each_is_foreach_copy() -> None:
    sources = [torch.randn(3), torch.arange(4.0), torch.tensor(2.5)]
    ours = [torch.zeros_like(s) for s in sources]
    theirs = [torch.zeros_like(s) for s in sources]
    door._copy_each(ours, sources)
    torch._foreach_copy_(theirs, sources)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_child_lookup_fallback_finds_what_modules_holds() -> None:
    parent = nn.Module()
    parent.add_module("child", nn.Linear(2, 2))
    parent.register_buffer("buf", torch.ones(1))
    for name in ["child", "buf", "train", "missing", "", "weight"]:
        assert door._child_public(parent, name) is door._child_private(parent, name), name


def test_typed_storage_without_the_private_keyword(monkeypatch: pytest.MonkeyPatch) -> None:
    untyped = torch.UntypedStorage(8, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the public call warns, once per process, that it is deprecated
        fast = door.typed_storage(untyped, torch.float32)
        monkeypatch.setattr(door, "_typed_storage_internal", False)
        slow = door.typed_storage(untyped, torch.float32)
    assert (slow.dtype, slow.size(), slow.device) == (fast.dtype, fast.size(), fast.device)


def test_lightning_file_fallback_is_torch_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lightning")
    path = tmp_path / "x.ckpt"
    torch.save({"state_dict": {"w": torch.arange(3.0)}, "epoch": 2}, path)
    fast = door.load_lightning_file(path, map_location="cpu", weights_only=True)
    monkeypatch.setitem(door._lightning, "lightning.fabric.utilities.cloud_io:_load", None)
    slow = door.load_lightning_file(path, map_location="cpu", weights_only=True)
    assert slow["epoch"] == fast["epoch"] == 2
    assert torch.equal(slow["state_dict"]["w"], fast["state_dict"]["w"])


# --- nobody else reaches a private symbol -----------------------------------------------------------

# Names torch and Lightning keep private that safeckpt has used; any attribute of these names outside
# the door is a private reach (our own objects do not use them).
_KNOWN = {
    "_local_tensor",
    "_spec",
    "_modules",
    "_foreach_copy_",
    "_world",
    "_cached_plans_key",
    "_checkpoint_connector",
    "_loaded_checkpoint",
    "_get_loops_state_dict",
    "_call_callbacks_state_dict",
    "_call_lightning_datamodule_hook",
    "_weights_only_unpickler",
    "_traverse",
    "_StorageInfo",
    "_StoragePrefix",
    "_find_last_checkpoints",
}
# Module-level names under which src imports torch and its parts.
_TORCH_NAMES = {"torch", "dist", "dcp", "nn", "pl", "lightning", "dcp_metadata", "DTensor", "SavePlanner"}


def _private_reaches(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in ("torch", "lightning", "pytorch_lightning"):
                parts = node.module.split(".")
                if any(p.startswith("_") for p in parts) or any(a.name.startswith("_") for a in node.names):
                    found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in ("torch", "lightning") and any(p.startswith("_") for p in parts):
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if node.attr in _KNOWN or (isinstance(base, ast.Name) and base.id in _TORCH_NAMES):
                found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and name.value in _KNOWN:
                found.append(f"line {node.lineno}: getattr(..., {name.value!r})")
    return found


def test_only_the_door_reaches_private_torch_and_lightning_symbols() -> None:
    reaches = {}
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "torch_private.py" and path.parent.name == "_util":
            continue
        found = _private_reaches(ast.parse(path.read_text(), str(path)))
        if found:
            reaches[str(path.relative_to(SRC))] = found
    assert reaches == {}, "private torch/Lightning symbols outside safeckpt._util.torch_private"


def test_the_guard_sees_a_private_reach() -> None:
    code = (
        "import torch\nfrom torch.distributed.checkpoint._traverse import set_element\n"
        "from torch.serialization import _save\nx = torch._foreach_copy_\ny = t._local_tensor\n"
    )
    assert len(_private_reaches(ast.parse(code))) == 4
