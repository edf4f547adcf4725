"""Many ranks: real gloo processes saving sharded (FSDP2) state, agreeing on outcomes,
surviving a failing or dying rank, and resharding on resume."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

import dist_worker
from forkserver import context

pytestmark = pytest.mark.distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(scenario: str, ws: int, root: Path, results: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``ws`` ranks; each rank's report, in rank order."""
    results.mkdir(parents=True, exist_ok=True)
    for old in results.glob("rank*.json"):
        old.unlink()
    ctx = context()
    port = free_port()
    procs = [
        ctx.Process(
            target=dist_worker.main,
            args=(scenario, rank, ws, port, str(root), str(results), kwargs),
        )
        for rank in range(ws)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=240)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    reports = []
    for rank in range(ws):
        path = results / f"rank{rank}.json"
        reports.append(
            json.loads(path.read_text()) if path.exists() else {"ok": None, "exitcode": procs[rank].exitcode}
        )
    return reports


def results_of(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for rank, report in enumerate(reports):
        assert report["ok"], f"rank {rank} failed: {report.get('traceback') or report}"
    return [r["result"] for r in reports]


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_sharded_save_and_restore(tmp_path: Path, async_save: bool) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    saved = results_of(launch("save_sharded", 2, root, results, async_save=async_save))
    assert [s["latest"] for s in saved] == [3, 3]  # every rank answers the same
    # close() shuts its own two gloo groups: left to interpreter exit, they can abort the process
    # opened, left after close(), a manager left open, after the exit hook
    assert [s["groups"] for s in saved] == [[2, 0, 2, 0], [2, 0, 2, 0]]
    assert all("process groups were shut down" in s["refused"] for s in saved)
    record = json.loads((root / "step_3" / "metadata.json").read_text())
    assert record["world_size"] == 2
    assert {"train_state.rank0.safetensors", "train_state.rank1.safetensors"} <= set(record["files"])
    restored = results_of(launch("restore_sharded", 2, root, results))
    assert restored == [{"step": 3, "mismatched": [], "count": 4}] * 2


@pytest.mark.parametrize("saved_ws, restored_ws", [(2, 4), (2, 1), (4, 2), (1, 2)])
def test_resharding_on_resume(tmp_path: Path, saved_ws: int, restored_ws: int) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    results_of(launch("save_sharded", saved_ws, root, results, async_save=True))
    restored = results_of(launch("restore_sharded", restored_ws, root, results))
    assert all(r["step"] == 3 and r["mismatched"] == [] for r in restored)


def test_async_saves_with_retention_across_ranks(tmp_path: Path) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    out = results_of(launch("async_retention", 2, root, results))
    assert out[0]["latest"] == 6
    assert out[0]["dirs"] == ["step_5", "step_6"]
    assert not list((root / ".staging").iterdir()) and not list((root / ".trash").iterdir())


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_one_rank_failing_its_write_fails_the_save_on_every_rank(tmp_path: Path, async_save: bool) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    out = results_of(launch("one_rank_fails", 2, root, results, async_save=async_save))
    errors = [o["error"] for o in out]
    assert errors[0] == errors[1], "every rank raises the same error"
    assert errors[0]["type"] == "SaveFailedError"
    assert "rank(s) [1]" in errors[0]["message"] and "injected" in errors[0]["message"]
    assert set(errors[0]["failures"]) == {"1"}
    assert out[0]["latest"] == 1  # nothing of step 2 was committed
    assert [o["restored"] for o in out] == [1, 1]
    assert out[0]["dirs"] == ["step_1", "step_3"]


def test_a_rank_killed_mid_save_makes_the_others_raise_and_a_relaunch_resumes(tmp_path: Path) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    reports = launch("one_rank_lost", 2, root, results, timeout=20.0, how="killed")
    assert reports[1]["ok"] is None and reports[1]["exitcode"] == -9  # it really died
    survivor = results_of(reports[:1])[0]
    assert survivor["error"] is not None, "the surviving rank must raise, not hang or succeed"
    assert survivor["error"]["type"] in ("RankAgreementError", "SaveFailedError")
    assert survivor["seconds"] < 120
    assert not (root / "step_2").exists()
    # A fresh launch resumes from the last committed checkpoint and collects the leftovers.
    restored = launch("restore_sharded", 2, root, results)
    assert [r["result"]["step"] for r in restored if r["ok"]] == [1, 1]
    assert not list((root / ".staging").iterdir())


def test_a_rank_that_stops_answering_makes_the_others_raise_within_the_timeout(tmp_path: Path) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    reports = launch("one_rank_lost", 2, root, results, timeout=5.0, how="hangs")
    survivor = results_of(reports[:1])[0]
    assert survivor["error"] is not None and survivor["error"]["type"] == "RankAgreementError"
    assert "stopped answering within 5 s" in survivor["error"]["message"]
    assert 4.0 < survivor["seconds"] < 60, "it waited for the timeout, then raised"
    assert os.readlink(root / "latest") == "step_1"


def test_resume_decision_is_rank_0s(tmp_path: Path) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    results_of(launch("save_sharded", 2, root, results, async_save=False))
    stale = results / "stale-copy"
    shutil.copytree(root, stale, symlinks=True)
    (stale / "step_3").rename(stale / "step_1")  # rank 1's view: only an older step 1
    (stale / "latest").unlink()
    (stale / "latest").symlink_to("step_1")
    out = results_of(launch("stale_view_restore", 2, root, results))
    assert out == [{"step": 3}, {"step": 3}]


def test_a_save_only_rank_0_rejects_raises_everywhere_and_the_next_lands_whole(tmp_path: Path) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    out = results_of(launch("leader_rejects_a_save", 2, root, results))
    assert out[0]["error"] == out[1]["error"] and out[0]["error"]["type"] == "InvalidSaveError"
    assert [o["restored"] for o in out] == [6, 6] and all(o["same"] for o in out)
