"""Frozen weights stored once (issue 56) on an object store (S3 on moto): a save names the earlier
area whose data file of unchanged frozen tensors it reads instead of uploading it again; an area
goes only when no kept checkpoint reads it (pruning, start-up collection, ``safeckpt gc``); a kill
at each request of a save and of its pruning resumes exact, never a record naming deleted objects.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import s3_frozen_crash_worker as worker
from safeckpt import CheckpointManager, Retention
from safeckpt._ops.inspection import inspect_checkpoint
from safeckpt._ops.maintenance import verify
from safeckpt.cli import main
from safeckpt.cli.ls import listing

WORKER = Path(worker.__file__)
pytestmark = [pytest.mark.s3, pytest.mark.timeout(900)]


def save_steps(root: str, steps: range, *, keep_last: int, numel: int = 1 << 16) -> None:
    """Saves with a frozen base of ``numel`` floats: ``frozen_value(step)`` (changed at CHANGE_AT)."""
    model, state = make(numel)
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=keep_last)) as mgr:
        for step in steps:
            with torch.no_grad():
                model.head.fill_(float(step))
            model.base.data.fill_(worker.frozen_value(step))
            mgr.save(step, state)


def make(numel: int) -> tuple[Any, dict[str, Any]]:
    model = worker.Model()
    model.base = torch.nn.Parameter(torch.zeros(numel), requires_grad=False)
    return model, {"model": model, "optim": torch.optim.SGD([model.head], lr=0.1)}


def restored(root: str, step: int, numel: int = 1 << 16) -> tuple[float, float]:
    """(head, base) of ``step`` restored alone; the base must be uniform."""
    model, state = make(numel)
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore(state, step=step).step == step
    assert bool((model.base == model.base[0]).all())
    return float(model.head.detach()[0]), float(model.base[0])


class Bucket:
    """What a root holds, as the bucket shows it: commits, their areas, the bytes under each area."""

    def __init__(self, s3_bucket: Any, prefix: str) -> None:
        self.s3, self.prefix = s3_bucket, prefix

    def commits(self) -> dict[str, dict[str, str]]:
        """Each committed checkpoint's name -> its commit object's user metadata."""
        client, out = self.s3.client(), {}
        for key in self.s3.keys():  # noqa: SIM118  (a method of the fixture, not a dict)
            parts = key[len(self.prefix) :].split("/")
            if key.startswith(self.prefix) and len(parts) == 2 and parts[1] == "metadata.json":  # noqa: SIM102
                if parts[0].startswith("step_"):
                    out[parts[0]] = client.head_object(Bucket=self.s3.name, Key=key)["Metadata"]
        return out

    def record(self, name: str) -> dict[str, Any]:
        got = self.s3.client().get_object(Bucket=self.s3.name, Key=f"{self.prefix}{name}/metadata.json")
        return json.loads(got["Body"].read())

    def area_bytes(self) -> dict[str, int]:
        """Bytes under each area (``.staging/<save>``)."""
        out: dict[str, int] = {}
        pages = self.s3.client().get_paginator("list_objects_v2").paginate(Bucket=self.s3.name)
        for page in pages:
            for obj in page.get("Contents", []):
                parts = obj["Key"][len(self.prefix) :].split("/")
                if obj["Key"].startswith(self.prefix) and parts[0] == ".staging" and len(parts) > 2:
                    area = f".staging/{parts[1]}"
                    out[area] = out.get(area, 0) + obj["Size"]
        return out

    def held(self) -> set[str]:
        """The areas the kept commits own or use."""
        found = set()
        for meta in self.commits().values():
            found.add(meta["safeckpt-area"])
            found.update(a for a in meta.get("safeckpt-uses", "").split(",") if a)
        return found


def test_a_later_save_names_the_earlier_area_instead_of_uploading(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    root = s3_bucket.url("r")
    save_steps(root, range(1, 4), keep_last=5)
    bucket = Bucket(s3_bucket, "r/")
    commits = bucket.commits()
    assert sorted(commits) == ["step_1", "step_2", "step_3"], sorted(commits)
    first = commits["step_1"]["safeckpt-area"]
    assert commits["step_2"]["safeckpt-uses"] == first  # the area whose file it reads
    shared = {n: c["from"] for n, c in bucket.record("step_2")["contents"].items() if "from" in c}
    assert list(shared.values()) == [first], shared
    # step 3 changed the base through .data: written, nothing shared
    assert "safeckpt-uses" not in commits["step_3"]
    assert not [c for c in bucket.record("step_3")["contents"].values() if "from" in c]
    sizes = bucket.area_bytes()
    frozen = 4 << 16
    assert sizes[first] > frozen and sizes[commits["step_3"]["safeckpt-area"]] > frozen, sizes
    assert sizes[commits["step_2"]["safeckpt-area"]] < frozen // 4, sizes  # the base was not uploaded
    assert [restored(root, step) for step in (1, 2, 3)] == [(1.0, 3.0), (2.0, 3.0), (3.0, 40.0)]
    # ls and inspect: step 2's shared bytes, and the root's total with them counted once
    data = listing(root)
    by_step = {c["step"]: c for c in data["checkpoints"]}
    assert [by_step[s]["shared_bytes"] > frozen for s in (1, 2, 3)] == [False, True, False]
    assert by_step[2]["own_bytes"] + by_step[2]["shared_bytes"] == by_step[2]["size"]
    assert data["total_bytes"] == sum(c["own_bytes"] for c in by_step.values())
    assert inspect_checkpoint(root, 2)["shared_from"] == [first]
    assert verify(root) == {1: [], 2: [], 3: []}


def test_pruning_the_writer_keeps_the_area_a_kept_checkpoint_reads(s3_bucket, capsys) -> None:  # type: ignore[no-untyped-def]
    root = s3_bucket.url("r")
    bucket = Bucket(s3_bucket, "r/")
    save_steps(root, range(1, 3), keep_last=1)  # step 2 shares step 1's file, and prunes step 1
    commits = bucket.commits()
    assert list(commits) == ["step_2"]
    used = commits["step_2"]["safeckpt-uses"]
    assert used in bucket.area_bytes() and bucket.area_bytes()[used] > 4 << 16
    # Neither the next start's collection nor `safeckpt gc` takes what a kept record reads.
    with CheckpointManager(root, async_save=False) as mgr:
        assert mgr.latest_step == 2
    assert main(["gc", root, "--json"]) == 0
    capsys.readouterr()
    assert set(bucket.area_bytes()) == bucket.held(), (bucket.area_bytes(), bucket.held())
    assert used in bucket.area_bytes()
    assert restored(root, 2) == (2.0, 3.0)
    assert verify(root) == {2: []}
    data = listing(root)  # the writer is pruned: the shared bytes are counted once, with step 2
    assert data["checkpoints"][0]["shared_bytes"] > 4 << 16
    assert data["total_bytes"] == data["checkpoints"][0]["size"]
    assert main(["ls", root]) == 0
    assert "total:" in capsys.readouterr().out
    # Step 3 changes the base through .data: written again; the last reader of step 1's area goes.
    save_steps(root, range(3, 4), keep_last=1)
    assert list(bucket.commits()) == ["step_3"]
    assert set(bucket.area_bytes()) == bucket.held()
    assert used not in bucket.area_bytes()
    assert restored(root, 3) == (3.0, 40.0)


def _run(root: str, kill_at: int, log: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(WORKER), root, str(kill_at), str(log)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _lines(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def _kill_in_sharing_saves(s3_bucket, tmp_path: Path, *, kills: int | None) -> None:  # type: ignore[no-untyped-def]
    """Kill at ``kills`` requests spread evenly over (None: at every request of) step 2's save
    (shares step 1's area, prunes step 1) and step 3's (writes the file again, prunes the last
    reader of step 1's area); the next start restores the newest commit exact, and finishing the
    run leaves no area that no commit holds."""
    whole = _run(s3_bucket.url("count"), 0, tmp_path / "count.log")
    assert whole.returncode == 0, whole.stderr
    at = {int(w[2]): int(w[1]) for w in _lines(tmp_path / "count.log") if w[0] == "at"}
    window = range(at[2] + 1, at[4] + 1)
    assert len(window) > 20
    chosen = window if kills is None else window[:: len(window) // kills]
    for kill_at in chosen:
        root, log = s3_bucket.url(f"k{kill_at}"), tmp_path / f"k{kill_at}.log"
        killed = _run(root, kill_at, log)
        assert killed.returncode == -9, (kill_at, killed.stderr)
        known = max([int(w[1]) for w in _lines(log) if w[0] == "committed"], default=0)
        model, state = worker.make_state()
        with CheckpointManager(root, read_only=True) as mgr:
            step = mgr.restore(state).step or 0
        assert step in (known, known + 1), (kill_at, known, step)
        assert float(model.head.detach()[0]) == step, kill_at
        assert bool((model.base == worker.frozen_value(step)).all()), kill_at
        assert verify(root)[step] == [], kill_at
        resumed = _run(root, 0, log)  # the next writer collects, finishes the run
        assert resumed.returncode == 0, (kill_at, resumed.stderr)
        bucket = Bucket(s3_bucket, f"k{kill_at}/")
        assert list(bucket.commits()) == ["step_4"], kill_at
        assert set(bucket.area_bytes()) == bucket.held(), (kill_at, bucket.area_bytes(), bucket.held())
        model, state = worker.make_state()
        with CheckpointManager(root, read_only=True) as mgr:
            assert mgr.restore(state).step == worker.STEPS
        assert bool((model.base == worker.frozen_value(worker.STEPS)).all()), kill_at


def test_kills_spread_over_a_sharing_save_and_its_pruning_resume_exact(s3_bucket, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _kill_in_sharing_saves(s3_bucket, tmp_path, kills=5)  # lean; the slow variant takes every request


@pytest.mark.slow
def test_kill_at_every_request_of_a_sharing_save_and_its_pruning_resumes_exact(s3_bucket, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _kill_in_sharing_saves(s3_bucket, tmp_path, kills=None)


def test_sharing_holds_when_the_trained_state_grows_into_more_objects(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    # Save 1 of the model alone (the trained state is one object), save 2 with its AdamW state too
    # (three times the bytes: two objects). The untrained file keeps its name and is shared.
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.base = torch.nn.Parameter(torch.randn(1 << 18), requires_grad=False)  # 1 MiB, frozen
    model.adapter = torch.nn.Parameter(torch.randn(1 << 20))  # 4 MiB, trained
    optim = torch.optim.AdamW([model.adapter], lr=0.1)
    root, options = s3_bucket.url("grow"), {"part_size": 5 << 20, "max_concurrency": 4}
    with CheckpointManager(root, storage_options=options, retention=Retention(keep_last=5)) as mgr:
        mgr.save(1, {"model": model})
        mgr.wait()
        mgr.save(2, {"model": model, "optim": optim})
    bucket = Bucket(s3_bucket, "grow/")
    record = bucket.record("step_2")
    trained = [n for n in record["files"] if n.endswith(".distcp") and n not in record["contents"]]
    assert len(trained) == 2, trained  # the trained state took two objects
    shared = {n: c.get("from") for n, c in record["contents"].items()}
    assert list(shared.values()) == [bucket.commits()["step_1"]["safeckpt-area"]], shared
