"""The demo, run as real processes: killed with SIGKILL or stopped with SIGTERM, resumed, and
bit-exact at the end."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from notice import without_notice
from safeckpt import read_record
from safeckpt.demo import main, weights_sha256

SMALL = ["--steps", "60", "--save-every", "10"]
HASH = re.compile(r"^final weights sha256: ([0-9a-f]{64})$", re.MULTILINE)
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))
RESUMED = re.compile(r"^resumed from step (\d+)$", re.MULTILINE)


def run_demo(root: Path, *args: str, module: str = "safeckpt.demo") -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", module]
    if module == "safeckpt":
        command.append("demo")
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("SAFECKPT_DEBUG", None)
    return without_notice(
        subprocess.run(
            [*command, "--dir", str(root), *SMALL, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
    )


def final_hash(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = HASH.findall(proc.stdout)
    assert len(found) == 1, proc.stdout
    return found[0]


def latest_step(root: Path) -> int | None:
    try:
        return int(os.readlink(root / "latest").removeprefix("step_"))
    except FileNotFoundError:
        return None


def resumed_from(proc: subprocess.CompletedProcess[str]) -> int | None:
    found = RESUMED.findall(proc.stdout)
    assert len(found) <= 1, proc.stdout
    return int(found[0]) if found else None


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, subprocess.CompletedProcess[str]]:
    """An uninterrupted run through ``python -m safeckpt demo``: its hash, weights file, output."""
    tmp = tmp_path_factory.mktemp("reference")
    weights = tmp / "out" / "final.safetensors"
    proc = run_demo(tmp / "root", "--weights-out", str(weights), module="safeckpt")
    return final_hash(proc), weights, proc


def test_uninterrupted_run_saves_prunes_and_reports_a_hash(reference) -> None:
    digest, _, proc = reference
    assert resumed_from(proc) is None
    # what was saved and pruned is shown (the manager's INFO lines, through the demo's handler)
    for step in (10, 20, 30, 40, 50, 60):
        assert re.search(rf"committed step {step}\b", proc.stdout), proc.stdout
    assert re.search(r"pruned step\(s\) 10\b", proc.stdout), proc.stdout
    assert re.fullmatch(r"[0-9a-f]{64}", digest)


def test_weights_out_holds_the_final_weights(reference) -> None:
    digest, weights, _ = reference
    assert weights_sha256(load_file(str(weights))) == digest
    with safe_open(str(weights), framework="pt") as f:
        assert f.metadata() == {"sha256": digest, "step": "60"}
    assert not list(weights.parent.glob(".*tmp*"))


def test_killed_and_resumed_runs_end_with_the_same_hash(tmp_path: Path, reference) -> None:
    digest, _, _ = reference
    root = tmp_path / "root"

    # killed on a save step: that save is likely still being written when SIGKILL lands
    first = run_demo(root, "--kill-at", "20")
    assert first.returncode == -signal.SIGKILL, first.stdout + first.stderr
    assert not HASH.search(first.stdout)
    after_first = latest_step(root)
    assert after_first in (None, 10, 20)

    # resumed from whatever was committed, and killed again between saves
    second = run_demo(root, "--kill-at", "35")
    assert second.returncode == -signal.SIGKILL, second.stdout + second.stderr
    assert resumed_from(second) == after_first
    # save(30) returned before the kill, and with one staging slot it waits until the save
    # before it has left the slot, i.e. until the one before that committed
    on_disk = latest_step(root)
    assert on_disk is not None and on_disk <= 30

    third = run_demo(root)
    n = resumed_from(third)
    assert n == on_disk and n % 10 == 0, third.stdout
    assert final_hash(third) == digest

    # a finished run resumes from its last step, trains nothing, and ends with the same hash
    fourth = run_demo(root)
    assert resumed_from(fourth) == 60
    assert "committed step" not in fourth.stdout
    assert final_hash(fourth) == digest
    assert read_record(root / "step_60").metrics.keys() == {"loss"}


def test_sigterm_saves_the_step_it_is_at_and_the_resumed_run_ends_with_the_same_hash(
    tmp_path: Path, reference
) -> None:
    digest, _, _ = reference
    root = tmp_path / "root"
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "safeckpt.demo", "--dir", str(root), *SMALL],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # the first commit: training is under way, 50 steps to go
        seen.append(line)
        if re.search(r"committed step 10\b", line):
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    output = "".join(seen) + rest
    assert proc.returncode == 128 + signal.SIGTERM, output
    found = re.search(r"SIGTERM: saved step (\d+) and stopped", output)
    assert found, output
    stopped = int(found.group(1))
    assert 10 <= stopped < 60 and latest_step(root) == stopped and not HASH.search(output)
    resumed = run_demo(root)
    assert resumed_from(resumed) == stopped
    assert final_hash(resumed) == digest


def test_demo_with_bad_options_fails_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    proc = run_demo(tmp_path / "file" / "root")
    assert proc.returncode == 2  # a --dir under a file: refused as the bad option it is
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("safeckpt: error: ")
    assert "Traceback" not in proc.stderr


def test_demo_bad_option_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--dir", str(tmp_path / "root"), "--save-every", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --save-every: must be a positive integer" in err
    assert not (tmp_path / "root").exists()


# Not marked slow (about 45 s): it is the one check that a multi-rank resume is bit-exact end to end,
# and it found the data position of rank 1 coming back as rank 0's.
@pytest.mark.distributed
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed next to this Python")
def test_torchrun_two_ranks_kill_and_resume(tmp_path: Path) -> None:
    torchrun = TORCHRUN
    assert torchrun is not None

    def launch(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [torchrun, "--nproc-per-node", "2", "-m", "safeckpt.demo", "--dir", str(root), *SMALL, *args],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
            timeout=300,
        )

    digest = final_hash(launch(tmp_path / "whole"))
    killed = launch(tmp_path / "root", "--kill-at", "35")
    assert killed.returncode != 0
    resumed = launch(tmp_path / "root")
    n = resumed_from(resumed)
    assert n is not None and n <= 35 and n % 10 == 0
    assert final_hash(resumed) == digest
