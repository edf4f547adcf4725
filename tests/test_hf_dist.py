"""safeckpt.hf on 2 gloo ranks under torchrun: the Trainer under DDP (and a resume at world size 1),
and a custom Accelerate loop saving ``accelerator_state`` (bit-exact against a run that never
stopped)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import safeckpt

WORKER = Path(__file__).parent / "support" / "hf_dist_worker.py"
pytestmark = pytest.mark.distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(mode: str, root: Path, out: Path, world: int, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(safeckpt.__file__).parents[1]), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}"]
    command += [f"--master-port={_free_port()}", str(WORKER), mode, str(root), str(out), *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-4000:]
    return json.loads(out.read_text())


def run(mode: str, root: Path, out: Path, world: int, *args: str) -> dict[str, Any]:
    return finish(start(mode, root, out, world, *args), out)


def test_accelerate_loop_on_two_ranks_resumes_bit_exact(tmp_path: Path) -> None:
    """Everything ``accelerator.save_state`` covers, through a CheckpointManager: stopped after
    step 5 (saved at 4), resumed: the weights, the registered object and the step go on exactly."""
    reference = start("accelerate", tmp_path / "ref", tmp_path / "ref.json", 2, "--steps", "8")
    root = tmp_path / "root"
    first = run("accelerate", root, tmp_path / "a.json", 2, "--steps", "8", "--stop-at", "5")
    assert first["step"] == 5
    second = run("accelerate", root, tmp_path / "b.json", 2, "--steps", "8")
    assert second["resumed"] == 4 and second["counter_at_resume"] == 4
    assert second["weights"] == finish(reference, tmp_path / "ref.json")["weights"]


@pytest.mark.slow
def test_trainer_ddp_two_ranks_then_resume_on_one(tmp_path: Path) -> None:
    """The Trainer under DDP on 2 ranks, stopped after step 5, resumed on 1 rank: it goes on from
    step 4 with the weights saved there (the data position is the Trainer's: by optimizer steps)."""
    root = tmp_path / "root"
    first = run("trainer", root, tmp_path / "a.json", 2, "--steps", "8", "--stop-at", "5")
    assert first["step"] == 5 and first["resumed"] == 0
    record = safeckpt.read_record(root / "step_4")
    assert record.status == "committed"
    second = run("trainer", root, tmp_path / "b.json", 1, "--steps", "8")
    assert second["resumed"] == 4 and second["restored_equal"] is True
    assert second["step"] == 8


@pytest.mark.slow
def test_trainer_ddp_two_ranks_resumes_bit_exact(tmp_path: Path) -> None:
    reference = start("trainer", tmp_path / "ref", tmp_path / "ref.json", 2, "--steps", "8")
    root = tmp_path / "root"
    run("trainer", root, tmp_path / "a.json", 2, "--steps", "8", "--stop-at", "5")
    second = run("trainer", root, tmp_path / "b.json", 2, "--steps", "8")
    assert second["resumed"] == 4 and second["restored_equal"] is True
    assert second["weights"] == finish(reference, tmp_path / "ref.json")["weights"]


def test_trainer_fsdp2_two_ranks_then_resume_on_one(tmp_path: Path) -> None:
    """FSDP2 (``fsdp_version: 2``) on 2 gloo ranks: sharded saves (each rank writes its shards);
    resumed on 1 rank, the shards are put together into the weights saved at step 4."""
    root = tmp_path / "root"
    first = run("trainer-fsdp", root, tmp_path / "a.json", 2, "--steps", "8", "--stop-at", "5")
    assert first["step"] == 5
    assert len(list((root / "step_4").glob("*.distcp"))) == 2  # one file of shards per rank
    second = run("trainer-fsdp", root, tmp_path / "b.json", 1, "--steps", "8")
    assert second["resumed"] == 4 and second["restored_equal"] is True
    assert second["step"] == 8


@pytest.mark.slow
def test_trainer_fsdp2_two_ranks_resumes_bit_exact(tmp_path: Path) -> None:
    reference = start("trainer-fsdp", tmp_path / "ref", tmp_path / "ref.json", 2, "--steps", "8")
    root = tmp_path / "root"
    run("trainer-fsdp", root, tmp_path / "a.json", 2, "--steps", "8", "--stop-at", "5")
    second = run("trainer-fsdp", root, tmp_path / "b.json", 2, "--steps", "8")
    assert second["resumed"] == 4 and second["restored_equal"] is True
    assert second["weights"] == finish(reference, tmp_path / "ref.json")["weights"]
