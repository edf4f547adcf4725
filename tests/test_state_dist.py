"""State across ranks: DTensors in nested dicts resharded on resume, FSDP2 plain state dicts,
pipeline stages with disjoint keys, and managers scoped to process groups (real gloo ranks)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

import state_dist_worker
from forkserver import context

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(scenario: str, ws: int, root: Path, results: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``ws`` ranks; each rank's result, in rank order (a failed rank fails)."""
    results.mkdir(parents=True, exist_ok=True)
    for old in results.glob("rank*.json"):
        old.unlink()
    ctx = context()
    port = _free_port()
    procs = [
        ctx.Process(
            target=state_dist_worker.main, args=(scenario, rank, ws, port, str(root), str(results), kwargs)
        )
        for rank in range(ws)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=240)  # a generous bound on a hang, not a timing assertion
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    out = []
    for rank in range(ws):
        path = results / f"rank{rank}.json"
        report = (
            json.loads(path.read_text()) if path.exists() else {"ok": None, "exitcode": procs[rank].exitcode}
        )
        assert report["ok"], f"rank {rank} failed: {report.get('traceback') or report}"
        out.append(report["result"])
    return out


@pytest.mark.parametrize("restored_ws", [1, 4])
def test_a_dtensor_at_depth_3_saved_by_2_ranks_restores_at_another_world_size(
    tmp_path: Path, restored_ws: int
) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    run("dtensor_save", 2, root, results)
    restored = run("dtensor_restore", restored_ws, root, results)
    assert restored == [{"step": 2, "n": 5, "in_place": True, "ok": True, "load_ok": True}] * restored_ws


def test_fsdp2_plain_model_and_optimizer_state_dicts_save_and_restore(tmp_path: Path) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    run("fsdp_plain_dicts", 2, root, results, phase="save")
    restored = run("fsdp_plain_dicts", 2, root, results, phase="restore")
    assert restored == [{"step": 2, "mismatched": []}] * 2


def test_pipeline_stages_with_disjoint_keys_share_one_checkpoint(tmp_path: Path) -> None:
    out = run("pipeline_stages", 2, tmp_path / "ckpt", tmp_path / "results")
    assert [o["restored"] for o in out] == [[10.0] * 4, [11.0] * 4]
    assert [o["pos"] for o in out] == [[0, "x"], [1, "x"]]
    assert all(o["whole"] == ["stage0", "stage1"] for o in out)


def test_a_dtype_change_on_one_rank_reaches_the_metadata_despite_cached_plans(tmp_path: Path) -> None:
    out = run("one_rank_changes_dtype", 2, tmp_path / "ckpt", tmp_path / "results")
    assert out[0]["stage0"] == {"dtype": "torch.float32", "equal": True}
    assert out[1]["stage1"] == {"dtype": "torch.bfloat16", "equal": True}
    assert all(o["dtypes"] == {"stage0": "torch.float32", "stage1": "torch.bfloat16"} for o in out)


def test_managers_scoped_to_process_groups_run_side_by_side(tmp_path: Path) -> None:
    out = run("group_managers", 4, tmp_path / "ckpt", tmp_path / "results")
    assert [o["w"] for o in out] == [[0.0] * 3, [0.0] * 3, [10.0] * 3, [10.0] * 3]
    assert [o["latest"] for o in out] == [1, 1, 1, 1]
    assert all(o["step"] == 1 and o["world_size"] == 2 for o in out)


def test_per_rank_state_comes_back_to_its_own_rank_and_stays_as_is_on_a_new_one(tmp_path: Path) -> None:
    """A plain tensor that every rank holds under one key is a replica (DCP saves one copy); a
    per_rank() value is each rank's own. Restored at 4 ranks, ranks 2 and 3 have none: theirs stay;
    at 1 rank, rank 1's are restored to no rank, with a warning."""
    root, results = tmp_path / "ckpt", tmp_path / "results"
    out = run("per_rank_state", 2, root, results, phase="save")
    assert [(o["order"], o["cursor"]) for o in out] == [([10] * 4, 10), ([11] * 4, 11)]
    assert len({o["w"] for o in out}) == 1  # one copy for both ranks
    # ... and rank 0 said so, once, naming the plain tensor (not the per_rank one)
    differ = out[0]["differ"]
    assert len(differ) == 1 and "'w' (ranks 0, 1)" in differ[0] and "'big' (ranks 0, 1)" in differ[0], differ
    assert "'data" not in differ[0] and "'same'" not in differ[0] and out[1]["differ"] == []
    wider = run("per_rank_state", 4, root, results, phase="restore")
    assert [(o["order"], o["cursor"]) for o in wider] == [([10] * 4, 10), ([11] * 4, 11)] + [
        ([-1] * 4, -1)
    ] * 2
    assert all(o["step"] == 2 for o in wider)
    assert all(o["dropped"] == [] for o in wider)
    # Restored at 1 rank: rank 0 continues from its own, and says rank 1's are restored to no one
    (narrower,) = run("per_rank_state", 1, root, results, phase="restore")
    assert (narrower["order"], narrower["cursor"]) == ([10] * 4, 10)
    (dropped,) = narrower["dropped"]
    assert "what rank 1 held per_rank (['data'] (1))" in dropped
