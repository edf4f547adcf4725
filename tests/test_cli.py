"""The ``safeckpt`` command: ls, verify, prune, pin/unpin, help and errors.

Most tests call ``main(argv)`` in this process; the exit-code and error-path tests
run the real command in a subprocess, as a user would. inspect, gc, export/import
and register have their own test files (test_cli_*.py, test_export.py).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from notice import without_notice
from safeckpt import CheckpointManager, Retention, read_record
from safeckpt._format.record import amend_record
from safeckpt._fs.atomic import swap_pointer
from safeckpt._fs.fileops import DEFAULT_FILE_OPS
from safeckpt._fs.lock import SidecarLock
from safeckpt.cli import main
from safeckpt.cli.common import print_table
from stores import loc

LOSSES = {10: 0.5, 20: 0.3, 30: 0.4, 40: 0.6, 50: 0.7, 60: 0.8}


@pytest.fixture
def ckpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A root with committed steps 10..60 (``latest`` = 60), every one kept."""
    monkeypatch.setenv("COLUMNS", "80")  # piped output never wraps, whatever the width
    monkeypatch.delenv("SAFECKPT_DEBUG", raising=False)
    root = tmp_path / "ckpt"
    torch.manual_seed(0)
    state = {"model": nn.Linear(4, 2), "ema": torch.zeros(3)}
    with CheckpointManager(root, async_save=False) as mgr:
        for step, loss in LOSSES.items():
            mgr.save(step, state, metrics={"loss": loss})
    return root


def tree(root: Path) -> list[tuple[str, int]]:
    """Every path under ``root`` with its size (the record files included)."""
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")
    )


def steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*"))


def table_rows(out: str) -> dict[int, str]:
    """The rows of a piped ``ls`` table by step: one line each, starting with the step and its time."""
    return {
        int(line.split()[0]): line for line in out.splitlines() if re.match(r" *\d+  \d{4}-\d\d-\d\d ", line)
    }


def ls_json(root: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["ls", str(root), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


# --- ls ------------------------------------------------------------------------------------------


def test_ls_explains_with_the_retention_the_job_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=2, keep_every=20)) as mgr:
        for step in (10, 20, 30, 40):
            mgr.save(step, {"w": torch.zeros(2)})
    data = ls_json(root, capsys=capsys)
    assert data["retention_source"] == "recorded"
    kept = {c["step"]: c["kept_because"] for c in data["checkpoints"]}
    assert kept == {20: ["every 20"], 30: ["last 2"], 40: ["latest", "last 2", "every 20"]}
    given = ls_json(root, "--keep-last", "1", capsys=capsys)
    assert given["retention_source"] == "given"
    assert {c["step"]: c["kept_because"] for c in given["checkpoints"]}[20] == []


def test_ls_missing_root_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(tmp_path / "nope")]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("safeckpt: error: ") and "does not exist" in captured.err


def test_ls_empty_root_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(tmp_path)]) == 0
    assert f"no checkpoints in {tmp_path}" in capsys.readouterr().out
    assert ls_json(tmp_path, capsys=capsys)["checkpoints"] == []


def test_ls_table(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(ckpt)]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert sorted(rows) == sorted(LOSSES)
    assert "latest" in rows[60] and "committed" in rows[60]
    assert all("latest" not in rows[s] for s in LOSSES if s != 60)
    assert "loss=0.3" in rows[20]
    assert "KiB" in rows[10] or " B " in rows[10]
    time_iso = ls_json(ckpt, capsys=capsys)["checkpoints"][0]["time_iso"]
    assert time_iso[:19].replace("T", " ") in rows[10]


def test_ls_with_retention_explains_what_prune_would_remove(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--keep-last", "2", "--keep-best", "1", "--metric", "loss"]
    assert main(["ls", str(ckpt), *args]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert "best 1 by loss" in rows[20]
    assert "last 2" in rows[50] and "last 2" in rows[60] and "latest" in rows[60]
    for step in (10, 30, 40):
        assert "the next prune removes it" in rows[step]

    kept = {c["step"]: c["kept_because"] for c in ls_json(ckpt, *args, capsys=capsys)["checkpoints"]}
    assert kept == {
        10: [],
        20: ["best 1 by loss (min)"],
        30: [],
        40: [],
        50: ["last 2"],
        60: ["latest", "last 2"],
    }


def test_ls_json_and_leftovers(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    leftover = ckpt / ".staging" / "step_70.0123456789ab"
    leftover.mkdir(parents=True)
    (ckpt / "step_80").mkdir()  # a directory with no record: listed, never loaded
    data = ls_json(ckpt, capsys=capsys)
    assert data["latest"] == 60
    assert data["staging"] == ["step_70.0123456789ab"]
    by_step = {c["step"]: c for c in data["checkpoints"]}
    assert sorted(by_step) == [*LOSSES, 80]
    assert by_step[30]["size"] == read_record(ckpt / "step_30").size > 0
    assert by_step[30]["metrics"] == {"loss": 0.4}
    assert by_step[30]["status"] == "committed" and by_step[30]["problems"] == []
    # without retention options, ls explains with the retention the job recorded (keep all here)
    assert data["retention_source"] == "recorded"
    assert by_step[60]["kept_because"] == ["latest", "no retention limit"] and by_step[60]["latest"]
    assert by_step[80]["status"] == "incomplete" and by_step[80]["problems"]

    assert main(["ls", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "1 entry in .staging/" in out and "step_70.0123456789ab" in out
    assert "incomplete" in out
    assert leftover.is_dir()  # ls never starts a manager, which would collect it


def test_ls_notes_a_broken_latest(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    swap_pointer(ckpt / "latest", "step_999", DEFAULT_FILE_OPS)
    data = ls_json(ckpt, capsys=capsys)
    assert data["latest"] is None and data["latest_name"] == "step_999"
    assert next(c for c in data["checkpoints"] if c["step"] == 60)["kept_because"] == [
        "newest (`latest` is missing or broken)",
        "no retention limit",
    ]
    assert main(["ls", str(ckpt)]) == 0
    assert "`latest` names step_999" in capsys.readouterr().out


# --- verify --------------------------------------------------------------------------------------


def test_verify_passes_on_a_sound_root(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert all(f"step {s}: ok" in out for s in LOSSES)
    assert "6 checked, 0 broken" in out


def test_verify_detects_a_truncated_file(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = max((p for p in (ckpt / "step_30").iterdir() if p.name != "metadata.json"), key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    before = tree(ckpt)

    assert main(["verify", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert f"step 30: BROKEN: {victim.name} has" in out
    assert all(f"step {s}: ok" in out for s in LOSSES if s != 30)

    assert main(["verify", str(ckpt), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["checkpoints"]["30"] and not data["checkpoints"]["20"]

    assert main(["verify", str(ckpt), "--step", "20"]) == 0
    assert main(["verify", str(ckpt), "--step", "30"]) == 1
    assert tree(ckpt) == before  # verify changes nothing


def test_verify_says_where_auto_resume_goes_when_latest_is_broken(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = max((p for p in (ckpt / "step_60").iterdir() if p.suffix == ".distcp"), key=os.path.getsize)
    victim.write_bytes(b"\0" * victim.stat().st_size)  # same size, other bytes: only checksums tell
    assert main(["verify", str(ckpt), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["broken"] == [60]
    assert data["latest_problem"] == (
        "`latest` names step 60, which is broken; auto-resume takes the newest complete checkpoint "
        "(step 50) instead"
    )


def test_verify_missing_step(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(ckpt), "--step", "15"]) == 1
    assert "no checkpoint of step 15" in capsys.readouterr().err


def point_latest(root: Path, target: str) -> None:
    os.unlink(root / "latest")
    os.symlink(target, root / "latest")


@pytest.mark.parametrize(
    "where, expected",
    [
        pytest.param("outside-relative", "not to a checkpoint directory of this root", id="outside-relative"),
        pytest.param("outside-absolute", "not to a checkpoint directory of this root", id="outside-absolute"),
        pytest.param("symlinked-step", "a symbolic link to", id="a-step-name-linking-outside"),
        pytest.param("missing-step", "step_999, which does not exist", id="missing-step"),
    ],
)
def test_verify_fails_when_latest_leads_outside_the_root_or_nowhere(
    ckpt: Path, capsys: pytest.CaptureFixture[str], where: str, expected: str
) -> None:
    outside = ckpt.parent / "elsewhere" / "step_60"
    shutil.copytree(ckpt / "step_60", outside)  # a whole checkpoint, but not one of this root
    target = {
        "outside-relative": "../elsewhere/step_60",
        "outside-absolute": str(outside),
        "symlinked-step": "step_70",
        "missing-step": "step_999",
    }[where]
    os.symlink(outside, ckpt / "step_70")
    point_latest(ckpt, target)
    assert main(["verify", str(ckpt), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["broken"] == []
    assert (
        expected in data["latest_problem"]
        and "newest complete checkpoint (step 60)" in data["latest_problem"]
    )
    assert main(["verify", str(ckpt)]) == 1
    assert expected in capsys.readouterr().out


def test_verify_fails_when_latest_names_a_step_and_no_checkpoint_is_left(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every checkpoint gone but `latest` still naming one: auto-resume would start from scratch."""
    for step in LOSSES:
        shutil.rmtree(ckpt / f"step_{step}")
    assert main(["verify", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert f"no checkpoints in {ckpt}" in out
    assert "`latest` names step_60, which does not exist" in out and "would start fresh" in out
    os.unlink(ckpt / "latest")
    assert main(["verify", str(ckpt)]) == 0  # an empty root is a healthy one


def run_cli(*args: object) -> subprocess.CompletedProcess[str]:
    """The real command in a subprocess (the console script when installed)."""
    script = Path(sys.executable).parent / "safeckpt"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "safeckpt"]
    env = {k: v for k, v in os.environ.items() if k != "SAFECKPT_DEBUG"}
    return without_notice(
        subprocess.run(
            [*command, *map(str, args)], capture_output=True, text=True, env=env, timeout=180, check=False
        )
    )


def run_clis(*commands: tuple[object, ...]) -> list[subprocess.CompletedProcess[str]]:
    """Several independent commands at once (each process's start is most of its time)."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: run_cli(*args), commands))


def test_verify_exit_codes_through_the_command(ckpt: Path) -> None:
    healthy, usage, missing = run_clis(
        ("verify", ckpt, "--json"), ("verify", ckpt, "forty"), ("verify", ckpt.parent / "nope")
    )
    assert usage.returncode == 2 and usage.stderr.count("\n") == 1 and "--help" in usage.stderr
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "does not exist" in missing.stderr
    assert healthy.returncode == 0, healthy.stderr
    data = json.loads(healthy.stdout)
    assert data["schema_version"] == 1 and data["ok"] is True and data["broken"] == []
    assert sorted(map(int, data["checkpoints"])) == sorted(LOSSES)

    # same size, one byte changed in the middle of a data file: only its checksum tells
    victim = max((p for p in (ckpt / "step_40").iterdir() if p.suffix == ".distcp"), key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    damaged, plain = run_clis(("verify", ckpt, "20", "40", "--json"), ("verify", ckpt))
    assert damaged.returncode == 1, damaged.stderr
    data = json.loads(damaged.stdout)
    assert data["ok"] is False and data["broken"] == [40] and sorted(data["checkpoints"]) == ["20", "40"]
    assert any(victim.name in problem for problem in data["checkpoints"]["40"])

    assert plain.returncode == 1 and "step 40: BROKEN" in plain.stdout and "step 50: ok" in plain.stdout
    assert plain.stderr == ""  # no progress bar when stderr is not a terminal


def test_verify_positional_steps(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(ckpt), "20", "30"]) == 0
    out = capsys.readouterr().out
    assert "step 20: ok" in out and "step 30: ok" in out and "step 10" not in out
    assert "2 checked, 0 broken" in out
    assert main(["verify", str(ckpt), "20", "15"]) == 1
    assert "no checkpoint of step 15" in capsys.readouterr().err


# --- prune ---------------------------------------------------------------------------------------


def test_prune_dry_run_changes_nothing(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = tree(ckpt)
    assert main(["prune", str(ckpt), "--keep-last", "2", "--dry-run"]) == 0
    assert "would remove step(s) 10, 20, 30, 40; would keep 50, 60" in capsys.readouterr().out
    assert tree(ckpt) == before


def test_prune_removes_what_retention_drops(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--keep-last", "2", "--keep-best", "1", "--metric", "loss", "--json"]
    assert main(["prune", str(ckpt), *args]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["removed"] == [10, 30, 40] and result["kept"] == [20, 50, 60]
    assert steps_on_disk(ckpt) == [20, 50, 60]
    assert not list((ckpt / ".trash").iterdir())
    assert main(["verify", str(ckpt)]) == 0


def test_prune_never_removes_latest(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a run restarted from step 30 (restore(step=30)) points `latest` there
    swap_pointer(ckpt / "latest", "step_30", DEFAULT_FILE_OPS)
    assert main(["prune", str(ckpt), "--keep-last", "1"]) == 0
    assert "removed step(s) 10, 20, 40, 50" in capsys.readouterr().out
    assert steps_on_disk(ckpt) == [30, 60]
    assert os.readlink(ckpt / "latest") == "step_30"


def test_prune_leaves_saves_in_flight_alone(ckpt: Path) -> None:
    in_flight = ckpt / ".staging" / "step_70.0123456789ab"
    in_flight.mkdir(parents=True)
    (in_flight / "part").write_bytes(b"x" * 10)
    assert main(["prune", str(ckpt), "--keep-last", "1"]) == 0
    assert (in_flight / "part").read_bytes() == b"x" * 10
    assert steps_on_disk(ckpt) == [60]


def test_prune_without_a_rule_applies_the_retention_the_job_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=2)) as mgr:
        mgr.save(10, {"w": torch.zeros(2)})
        mgr.pin(10)
        for step in (20, 30):
            mgr.save(step, {"w": torch.zeros(2)})
    assert steps_on_disk(root) == [10, 20, 30]
    assert main(["unpin", str(root), "10"]) == 0  # the job would remove it at its next commit
    capsys.readouterr()
    before = tree(root)

    assert main(["prune", str(root), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "rule: the job's recorded retention: last 2 or pinned" in out
    assert "would remove step(s) 10; would keep 20, 30 (dry run)" in out
    assert tree(root) == before

    assert main(["prune", str(root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["retention_source"], data["retention"]) == ("recorded", "last 2 or pinned")
    assert data["removed"] == [10] and data["kept"] == [20, 30]
    assert steps_on_disk(root) == [20, 30]

    # a rule given wins over the recorded one, and says so
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "rule: the rules given: last 1 or pinned" in out and "removed step(s) 20" in out


def test_prune_keeps_milestones(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--keep-last", "1", "--keep-milestones", "20,40", "--json"]
    assert main(["ls", str(ckpt), *args]) == 0
    kept = {c["step"]: c["kept_because"] for c in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert kept[20] == kept[40] == ["milestone (steps 20, 40)"] and kept[30] == []

    assert main(["prune", str(ckpt), *args]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["retention_source"] == "given"
    assert data["retention"] == "last 1 or milestone (steps 20, 40) or pinned"
    assert data["removed"] == [10, 30, 50] and steps_on_disk(ckpt) == [20, 40, 60]

    assert main(["prune", str(ckpt), "--keep-milestones", "pow2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "milestone (power-of-two steps)" in out and "would remove step(s) 20, 40; would keep 60" in out


def test_prune_without_a_rule_or_a_recorded_one_is_a_usage_error(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = SidecarLock(ckpt / ".lock")
    try:
        for step in LOSSES:  # records of a job that recorded no retention
            amend_record(loc(ckpt / f"step_{step}"), lock, retention=None)
    finally:
        lock.close()
    before = tree(ckpt)
    assert main(["prune", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no retention to prune" in err and "--keep-milestones" in err
    assert tree(ckpt) == before


# --- pin / unpin ---------------------------------------------------------------------------------


def test_pin_survives_prune_and_unpin_releases(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pin", str(ckpt), "20"]) == 0
    assert "pinned step 20" in capsys.readouterr().out
    assert read_record(ckpt / "step_20").pinned
    assert ls_json(ckpt, capsys=capsys)["checkpoints"][1]["kept_because"] == ["no retention limit", "pinned"]

    assert main(["prune", str(ckpt), "--keep-last", "1"]) == 0
    assert steps_on_disk(ckpt) == [20, 60]

    assert main(["unpin", str(ckpt), "20"]) == 0
    assert not read_record(ckpt / "step_20").pinned
    assert main(["prune", str(ckpt), "--keep-last", "1"]) == 0
    assert steps_on_disk(ckpt) == [60]


def test_pin_missing_step(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pin", str(ckpt), "15"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint of step 15" in err


# --- piped tables ------------------------------------------------------------------------------

BOX_DRAWING = re.compile("[\u2500-\u257f]")


def test_piped_tables_are_plain_text_one_line_per_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    root = tmp_path / ("a_long_directory_name_" * 4) / "ckpt"
    metrics = {"val_loss": 0.50412345, "a_rather_long_metric_name": 12.5}
    with CheckpointManager(root, async_save=False) as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": torch.zeros(3)}, metrics=metrics)
    leftover = root / ".trash" / ("step_0.pruned.0123456789ab")
    leftover.mkdir(parents=True)
    (leftover / "f").write_bytes(b"z" * 2048)

    ls = run_cli("ls", root)
    assert ls.returncode == 0, ls.stderr
    lines = ls.stdout.splitlines()
    rows = table_rows(ls.stdout)
    assert sorted(rows) == [10, 20]
    for row in rows.values():
        assert "a_rather_long_metric_name=12.5 val_loss=0.5041" in row and "committed" in row
    assert "latest" in rows[20]
    assert str(root) in lines[0] and lines[1].split() == [
        "step",
        "time",
        "size",
        "metrics",
        "status",
        "why",
        "kept",
    ]
    assert max(map(len, lines)) > 80  # wider than the terminal width, and still not wrapped

    gc = run_cli("gc", root, "--dry-run")
    assert gc.returncode == 0, gc.stderr
    row = next(line for line in gc.stdout.splitlines() if line.startswith("trash "))
    assert row.split() == ["trash", ".trash/step_0.pruned.0123456789ab", "2.0", "KiB", "would", "remove"]

    inspect = run_cli("inspect", root, "10")
    assert inspect.returncode == 0, inspect.stderr
    assert any(line.split()[:3] == ["w", "float32", "3"] for line in inspect.stdout.splitlines())
    assert any(line.startswith("train_state.rank0.safetensors ") for line in inspect.stdout.splitlines())

    for proc in (ls, gc, inspect):
        assert not BOX_DRAWING.search(proc.stdout), proc.stdout


def test_tables_on_a_terminal_are_drawn_by_rich() -> None:
    table = Table(title="checkpoints")
    table.add_column("step", justify="right")
    table.add_column("metrics", overflow="fold")
    table.add_row("10", "[red]val_loss=0.504[/]")
    drawn = io.StringIO()
    print_table(Console(file=drawn, force_terminal=True, width=80), table)
    assert BOX_DRAWING.search(drawn.getvalue()) and "val_loss=0.504" in drawn.getvalue()
    piped = io.StringIO()
    print_table(Console(file=piped, width=80), table)
    assert piped.getvalue() == "checkpoints\nstep  metrics\n  10  val_loss=0.504\n"


# --- errors, as a user sees them -----------------------------------------------------------------


def test_bad_argument_is_one_line_and_a_traceback_only_when_debugging(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["prune", str(ckpt), "--keep-best", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("safeckpt: error: --keep-best needs --metric")
    assert "Traceback" not in err

    # the real command, through the console script when it is installed
    script = Path(sys.executable).parent / "safeckpt"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "safeckpt"]
    proc = subprocess.run(
        [*command, "prune", str(ckpt), "--keep-best", "2"],
        capture_output=True,
        text=True,
        env={**os.environ, "SAFECKPT_DEBUG": "1"},
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr and "ConfigError" in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("safeckpt: error: --keep-best needs --metric")
    assert steps_on_disk(ckpt) == sorted(LOSSES)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["ls"], id="missing-root"),
        pytest.param(["prune", "x", "--keep-last", "0"], id="zero"),
        pytest.param(["prune", "x", "--keep-milestones", "10,ten"], id="bad-milestones"),
        pytest.param(["pin", "x", "ten"], id="not-a-number"),
        pytest.param(["frobnicate"], id="unknown-command"),
    ],
)
def test_usage_errors_are_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "--help" in err, err


COMMANDS = ("demo", "ls", "inspect", "verify", "prune", "pin", "unpin", "gc", "export", "import", "register")


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert f"    {command} " in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_an_example(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    examples = out[out.index("examples:") :].splitlines()[1:]
    assert examples and all(line.strip().startswith(("safeckpt ", "torchrun ")) for line in examples if line)
    assert any(line.strip().startswith(f"safeckpt {command}") for line in examples)


def test_json_outputs_carry_the_schema_version(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["ls", str(ckpt)], ["prune", str(ckpt), "--keep-last", "9", "--dry-run"], ["gc", str(ckpt)]):
        assert main([*argv, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["schema_version"] == 1
