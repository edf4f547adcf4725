"""Checkpoints auto-resume moved aside into ``.damaged/``: ``ls`` shows them, ``verify`` notes them
without failing (they are never loaded), ``gc`` removes them.

The mover is the manager's; here a directory is moved aside by hand the way it does it:
``<root>/step_<N>`` to ``<root>/.damaged/step_<N>.<12 hex>``, with a ``damaged.json`` note.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from safeckpt import CheckpointManager
from safeckpt.cli import main

REASON = "__0_0.distcp: bytes 0-1535 do not match their checksum"
NOTE_TIME = 1_800_000_000.5


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Steps 10, 20, 30 committed; step 20 moved aside as damaged (its bytes flipped), and a
    copy of step 30 moved aside too (the job saved step 30 again after resuming)."""
    monkeypatch.delenv("SAFECKPT_DEBUG", raising=False)
    root = tmp_path / "ckpt"
    with CheckpointManager(root, async_save=False) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, {"w": torch.full((256,), float(step))}, metrics={"loss": 1 / step})
    move_aside(root, 20, "0123456789ab", {"step": 20, "reason": REASON, "time": NOTE_TIME, "seq": 2})
    copy = root / ".damaged" / "step_30.fedcba987654"
    shutil.copytree(root / "step_30", copy)
    (copy / "damaged.json").write_text("{not json")  # a note that cannot be read: no reason, no time
    return root


def move_aside(root: Path, step: int, token: str, note: dict[str, object]) -> Path:
    target = root / ".damaged" / f"step_{step}.{token}"
    target.parent.mkdir(exist_ok=True)
    os.rename(root / f"step_{step}", target)
    data = next(p for p in target.iterdir() if p.suffix == ".distcp")
    data.write_bytes(bytes(b ^ 0xFF for b in data.read_bytes()))  # damaged bytes: never read
    (target / "damaged.json").write_text(json.dumps(note))
    return target


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().out


def test_ls_shows_damaged_checkpoints(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(["ls", str(root), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert [c["step"] for c in data["checkpoints"]] == [10, 30]
    damaged = {d["step"]: d for d in data["damaged"]}
    assert sorted(damaged) == [20, 30]
    assert damaged[20]["reason"] == REASON and damaged[20]["time"] == NOTE_TIME and damaged[20]["seq"] == 2
    assert damaged[20]["path"] == str(root / ".damaged" / "step_20.0123456789ab")
    assert damaged[20]["time_iso"].startswith("2027-01-")  # 1.8e9 s, in local time
    assert damaged[20]["size"] > 0
    assert damaged[30]["reason"] is None and damaged[30]["time"] is None and damaged[30]["seq"] is None

    code, out = run(["ls", str(root)], capsys)
    assert code == 0
    rows = [line for line in out.splitlines() if line.split()[0].isdigit() and "damaged" in line]
    assert len(rows) == 2
    assert rows[0].split()[0] == "20" and f"damaged: {REASON}" in rows[0]
    assert "step_20.0123456789ab" in rows[0] and "safeckpt gc" in rows[0]
    assert rows[1].split()[:2] == ["30", "-"]  # no readable note: when and why unknown


def test_verify_notes_damaged_checkpoints_and_passes(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(["verify", str(root)], capsys)
    assert code == 0, out
    assert "step 10: ok" in out and "step 30: ok" in out and "step 20" not in out.split("note:")[0]
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 2 and f"step 20 was moved aside as damaged: {REASON}" in notes[0]
    assert "2 checked, 0 broken" in out

    code, out = run(["verify", str(root), "--json"], capsys)
    data = json.loads(out)
    assert (
        code == 0
        and data["ok"] is True
        and data["broken"] == []
        and sorted(data["checkpoints"]) == ["10", "30"]
    )
    assert [d["step"] for d in data["damaged"]] == [20, 30]


def test_gc_removes_damaged_checkpoints(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    damaged = sorted((root / ".damaged").iterdir())
    code, out = run(["gc", str(root), "--dry-run", "--json"], capsys)
    assert code == 0
    items = {i["path"]: i for i in json.loads(out)["items"]}
    for path in damaged:
        item = items[str(path)]
        assert (item["kind"], item["action"]) == ("damaged", "would remove") and item["size"] > 0
    assert all(path.is_dir() for path in damaged)  # a dry run changes nothing

    code, out = run(["gc", str(root), "--dry-run"], capsys)
    assert code == 0 and any(line.startswith("damaged ") for line in out.splitlines())

    code, out = run(["gc", str(root), "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and {i["action"] for i in data["items"] if i["kind"] == "damaged"} == {"removed"}
    assert not any(path.exists() for path in damaged)
    assert data["bytes_freed"] >= sum(items[str(p)]["size"] for p in damaged)
    code, out = run(["ls", str(root), "--json"], capsys)
    assert json.loads(out)["damaged"] == []
    assert main(["verify", str(root)]) == 0  # the committed checkpoints are untouched
