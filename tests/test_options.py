"""I/O options are a manager's own (verify=, direct_io=, dcp_io=), never a silent process-wide
switch; importing safeckpt changes no global state."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from safeckpt import CheckpointManager, ConfigError, CorruptCheckpointError
from safeckpt._dcp import options
from safeckpt._fs import direct_write


def saved(root: Path, **kwargs: object) -> None:
    with CheckpointManager(root, async_save=False, **kwargs) as mgr:  # type: ignore[arg-type]
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((4096,), float(step))})


def flip_shard(root: Path, step: int) -> None:
    path = next((root / f"step_{step}").glob("*.distcp"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_false_is_one_managers_choice_not_the_processes(root: Path) -> None:
    saved(root)
    flip_shard(root, 2)
    unchecked = CheckpointManager(root, read_only=True, verify=False)
    checked = CheckpointManager(root, read_only=True)
    try:
        state = {"w": torch.zeros(4096)}
        assert unchecked.restore(state, step=2).step == 2  # the damaged bytes load, as asked
        with pytest.raises(CorruptCheckpointError):
            checked.restore({"w": torch.zeros(4096)}, step=2)  # the other manager still checks
        assert checked.restore({"w": torch.zeros(4096)}).step == 1
    finally:
        unchecked.close()
        checked.close()


def test_the_environment_turns_verification_off_with_a_warning_once(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    saved(root)
    flip_shard(root, 2)
    monkeypatch.setenv("SAFECKPT_VERIFY", "0")
    monkeypatch.setattr(options, "_warned", set())
    for _ in range(2):
        with CheckpointManager(root, read_only=True) as mgr:
            assert mgr.restore({"w": torch.zeros(4096)}, step=2).step == 2
    warned = [
        r for r in caplog.records if r.levelno >= logging.WARNING and "SAFECKPT_VERIFY" in r.getMessage()
    ]
    assert len(warned) == 1 and "NOT verified" in warned[0].getMessage()
    with CheckpointManager(root, read_only=True, verify=True) as mgr, pytest.raises(CorruptCheckpointError):
        mgr.restore({"w": torch.zeros(4096)}, step=2)  # the manager's own choice wins


def test_direct_io_false_writes_no_byte_through_o_direct(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []
    real = direct_write.DirectFileWriter.__init__

    def spy(self: direct_write.DirectFileWriter, path: object, *, direct: bool = True) -> None:
        asked.append(direct)
        real(self, path, direct=direct)  # type: ignore[arg-type]

    monkeypatch.setattr(direct_write.DirectFileWriter, "__init__", spy)
    saved(root, direct_io=False)
    assert asked and not any(asked)
    asked.clear()
    saved(root.parent / "other")
    assert asked and all(asked)


def test_dcp_io_torch_writes_the_same_files_the_raw_reader_reads(root: Path) -> None:
    saved(root, dcp_io="torch")
    state = {"w": torch.zeros(4096)}
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore(state).step == 2
    assert torch.equal(state["w"], torch.full((4096,), 2.0))


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [({"dcp_io": "fast"}, "dcp_io='fast'"), ({"verify": "yes"}, "True or False")],
)
def test_bad_options_are_config_errors(root: Path, kwargs: dict[str, object], text: str) -> None:
    with pytest.raises(ConfigError, match=text):
        CheckpointManager(root, **kwargs)  # type: ignore[arg-type]
    assert not root.exists()


def test_importing_safeckpt_changes_no_global_state() -> None:
    # What its dependencies do when imported is theirs: they are imported first.
    code = """
import atexit, gc, json, sys, warnings
import numpy, rich.console, safetensors.torch, torch, torch.distributed.checkpoint
import torch.distributed.checkpoint.state_dict
filters, hooks, collecting = list(warnings.filters), atexit._ncallbacks(), gc.isenabled()
import safeckpt, safeckpt.cli
print(json.dumps({"filters": list(warnings.filters) == filters, "atexit": atexit._ncallbacks() - hooks,
                  "gc": gc.isenabled() == collecting}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"filters": True, "atexit": 0, "gc": True}
