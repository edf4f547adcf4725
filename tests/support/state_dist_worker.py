"""One rank of a multi-process state scenario (used by test_state_dist.py).

Each scenario runs on every rank of a real gloo group and writes what this rank
saw (its result, or the error it raised) to ``<results>/rank<r>.json``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import safeckpt
from dist_worker import build, full_weights, train
from safeckpt import CheckpointManager

ROWS, COLS = 8, 3


def _full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) / 7


def _sharded(value: torch.Tensor, ws: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    return distribute_tensor(value, mesh, [Shard(0)])


def _whole(value: Any) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def dtensor_save(rank: int, ws: int, root: Path, results: Path) -> dict[str, Any]:
    """A DTensor at depth 3 ({"model": {"layers": [{"w": ...}]}}), next to plain values."""
    state = {"model": {"layers": [{"w": _sharded(_full(), ws)}, {"w": _sharded(_full() * 2, ws)}]}, "n": 5}
    with CheckpointManager(root, timeout=60) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)  # the second save stages into the reused buffers
    return {"saved": True}


def dtensor_restore(rank: int, ws: int, root: Path, results: Path) -> dict[str, Any]:
    """Restore at another world size: a DTensor on the current mesh, or a plain tensor at 1 rank."""

    def blank() -> Any:
        zeros = torch.zeros(ROWS, COLS)
        return _sharded(zeros, ws) if ws > 1 else zeros

    state: dict[str, Any] = {"model": {"layers": [{"w": blank()}, {"w": blank()}]}, "n": 0}
    target = state["model"]["layers"][1]["w"]
    with CheckpointManager(root, timeout=60) as mgr:
        step = mgr.restore(state).step
    layers = state["model"]["layers"]
    out = {
        "step": step,
        "n": state["n"],
        "in_place": layers[1]["w"] is target,
        "ok": torch.equal(_whole(layers[0]["w"]), _full())
        and torch.equal(_whole(layers[1]["w"]), _full() * 2),
    }
    loaded = safeckpt.load(root)  # template-free: sharded tensors come back whole
    out["load_ok"] = torch.equal(loaded["model"]["layers"][1]["w"], _full() * 2) and loaded["n"] == 5
    return out


def fsdp_plain_dicts(rank: int, ws: int, root: Path, results: Path, phase: str) -> dict[str, Any]:
    """FSDP2 (fully_shard) with {"model": model.state_dict(), "optim": optim.state_dict()}."""
    state = build(ws, seed=0 if phase == "save" else 7)
    train(state, rank, 2 if phase == "save" else 1)  # restore: the optimizer has moments to fill
    model, optim = state["model"], state["optim"]
    plain = {"model": model.state_dict(), "optim": optim.state_dict()}
    if phase == "save":
        with CheckpointManager(root, timeout=60) as mgr:
            mgr.save(2, plain)
        weights = full_weights(state)
        if rank == 0:
            torch.save(weights, results / "fsdp_expected.pt")
        return {"saved": True}
    with CheckpointManager(root, timeout=60) as mgr:
        step = mgr.restore(plain).step
    model.load_state_dict(plain["model"])
    optim.load_state_dict(plain["optim"])
    expected = torch.load(results / "fsdp_expected.pt", weights_only=True)
    weights = full_weights(state)
    return {
        "step": step,
        "mismatched": sorted(k for k in expected if not torch.equal(expected[k], weights[k])),
    }


def pipeline_stages(rank: int, ws: int, root: Path, results: Path) -> dict[str, Any]:
    """Ranks holding disjoint keys save into one checkpoint and restore their own."""

    def stage_state(fill: float) -> dict[str, Any]:
        return {f"stage{rank}": {"w": torch.full((4,), fill + rank), "pos": (rank, "x")}}

    with CheckpointManager(root, timeout=60) as mgr:
        mgr.save(1, stage_state(10.0))
        mgr.wait()
        fresh = stage_state(0.0)
        mgr.restore(fresh)
    whole = safeckpt.load(root)
    return {
        "restored": fresh[f"stage{rank}"]["w"].tolist(),
        "pos": list(fresh[f"stage{rank}"]["pos"]),
        "whole": sorted(whole),
    }


def group_managers(rank: int, ws: int, root: Path, results: Path) -> dict[str, Any]:
    """Two managers side by side, each scoped to its own process group (2 ranks each)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = rank // 2
    value = torch.full((3,), float(10 * mine))  # a plain tensor under one key is replicated (DCP)
    with CheckpointManager(root / f"stage{mine}", process_group=groups[mine], timeout=60) as mgr:
        mgr.save(1, {"w": value, f"only{rank % 2}": torch.ones(1)})
        mgr.wait()
        fresh = {"w": torch.zeros(3), f"only{rank % 2}": torch.zeros(1)}
        step = mgr.restore(fresh).step
        latest = mgr.latest_step
        assert torch.equal(fresh[f"only{rank % 2}"], torch.ones(1))
    record = json.loads((root / f"stage{mine}" / "step_1" / "metadata.json").read_text())
    dist.barrier()
    return {"step": step, "latest": latest, "w": fresh["w"].tolist(), "world_size": record["world_size"]}


def one_rank_changes_dtype(rank: int, ws: int, root: Path, results: Path) -> dict[str, Any]:
    """Saves reuse their DCP plans; then only rank 1's tensor becomes bf16 (same shape)."""
    state = {f"stage{rank}": {"w": torch.arange(6.0).reshape(2, 3) + rank}}
    with CheckpointManager(root, async_save=False, timeout=60) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        if rank == 1:
            state["stage1"]["w"] = state["stage1"]["w"].to(torch.bfloat16) / 3
        mgr.save(3, state)
    whole = safeckpt.load(root)
    return {
        name: {"dtype": str(w["w"].dtype), "equal": torch.equal(w["w"], state[name]["w"])}
        for name, w in whole.items()
        if name in state
    } | {"dtypes": {name: str(w["w"].dtype) for name, w in whole.items()}}


def per_rank_state(rank: int, ws: int, root: Path, results: Path, phase: str) -> dict[str, Any]:
    """Each rank's own stream position (per_rank) beside a replicated plain tensor (DCP keeps one)."""

    def state(fill: int) -> dict[str, Any]:
        return {
            "w": torch.full((3,), float(fill)),
            "big": torch.full((1 << 16,), float(fill)),  # 256 KiB: compared by a sample
            "same": torch.ones(1 << 16),
            "data": safeckpt.per_rank({"order": torch.full((4,), fill), "cursor": fill}),
        }

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("safeckpt").addHandler(handler)
    with CheckpointManager(root, timeout=60) as mgr:
        if phase == "save":
            mgr.save(1, state(10 + rank))
            mgr.save(2, state(10 + rank))  # warned once per key, not at every save
            mgr.wait()
        fresh = state(-1)
        restored = mgr.restore(fresh)
    own = fresh["data"].value
    return {
        "step": restored.step,
        "order": own["order"].tolist(),
        "cursor": own["cursor"],
        "w": fresh["w"][0].item(),
        "differ": [w for w in warnings if "differ between ranks" in w],
        "dropped": [w for w in warnings if "restored to no rank" in w],
    }


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    f.__name__: f
    for f in (
        dtensor_save,
        dtensor_restore,
        fsdp_plain_dicts,
        pipeline_stages,
        group_managers,
        one_rank_changes_dtype,
        per_rank_state,
    )
}


def main(
    scenario: str, rank: int, ws: int, port: int, root: str, results: str, kwargs: dict[str, Any]
) -> None:
    """Entry point of one spawned rank."""
    torch.set_num_threads(1)
    out_path = Path(results) / f"rank{rank}.json"
    try:
        if ws > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=datetime.timedelta(seconds=60))
        result = SCENARIOS[scenario](rank, ws, Path(root), Path(results), **kwargs)
        out_path.write_text(json.dumps({"ok": True, "result": result}))
    except BaseException as e:
        out_path.write_text(
            json.dumps(
                {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            )
        )
        raise
    finally:
        if ws > 1 and dist.is_initialized():
            dist.destroy_process_group()
