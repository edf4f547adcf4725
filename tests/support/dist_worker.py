"""One rank of a multi-process scenario (used by test_distributed.py).

Each scenario runs on every rank of a real gloo group and writes what this
rank saw (its result, or the error it raised) to ``<results>/rank<r>.json``.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from safeckpt import CheckpointManager, Retention
from safeckpt._dist import participants as distributed
from safeckpt._fs.fileops import FileOps
from safeckpt.errors import CheckpointError


class RankFaults(FileOps):
    """Fails, hangs at, or kills this process at the train-state write of one step."""

    def __init__(self, step: int, *, kill: bool = False, hang: float = 0.0) -> None:
        self.step, self.kill, self.hang = step, kill, hang

    def write_file(self, path: Path, data: bytes) -> None:
        if path.name.startswith("train_state") and path.parent.name.startswith(f"step_{self.step}."):
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.hang:
                time.sleep(self.hang)  # alive but not answering, like a stuck NFS client
            else:
                raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
        super().write_file(path, data)


def build(world_size: int, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": optim, "step_count": 0}


def train(state: dict[str, Any], rank: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(4, 16, generator=gen)
        loss = state["model"](x).pow(2).mean()
        state["optim"].zero_grad()
        loss.backward()
        state["optim"].step()
        state["step_count"] += 1


def full_weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Unsharded model weights and Adam moments (collective when sharded)."""
    out = {}
    for name, value in state["model"].state_dict().items():
        out[f"model.{name}"] = value.full_tensor() if hasattr(value, "full_tensor") else value.detach()
    for i, (param, slot) in enumerate(state["optim"].state.items()):
        for key in ("exp_avg", "exp_avg_sq"):
            value = slot[key]
            out[f"optim.{i}.{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value
        del param
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


# --- scenarios: each returns JSON data, or raises --------------------------------------


def save_sharded(rank: int, ws: int, root: Path, results: Path, async_save: bool) -> dict[str, Any]:
    state = build(ws)
    train(state, rank, 3)
    groups = _live_groups()
    with CheckpointManager(root, async_save=async_save, timeout=60) as mgr:
        mgr.save(3, state, metrics={"loss": 1.0})
        mgr.wait()
        latest = mgr.latest_step
        opened = _live_groups() - groups
    left = _live_groups() - groups
    # a manager never closed keeps its groups until the exit hook, which runs last
    spare = CheckpointManager(root, async_save=False, timeout=60)
    unclosed = _live_groups() - groups
    distributed._release_all()
    try:
        spare.wait()  # a collective on released groups refuses: it never falls back to the default group
        refused = ""
    except CheckpointError as e:
        refused = str(e)
    weights = full_weights(state)
    if rank == 0:
        save_file(weights, str(results / "expected.safetensors"))
    return {
        "latest": latest,
        "groups": [opened, left, unclosed, _live_groups() - groups],
        "refused": refused,
    }


def _live_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0


def restore_sharded(rank: int, ws: int, root: Path, results: Path) -> dict[str, Any]:
    state = build(ws, seed=7)
    with CheckpointManager(root, timeout=60) as mgr:
        step = mgr.restore(state).step
    weights = full_weights(state)
    mismatched = None
    if (results / "expected.safetensors").exists():
        expected = load_file(str(results / "expected.safetensors"))
        mismatched = sorted(k for k in expected if not torch.equal(expected[k], weights[k]))
    train(state, rank, 1)  # and training goes on from the restored state
    return {"step": step, "mismatched": mismatched, "count": state["step_count"]}


def async_retention(rank: int, ws: int, root: Path, results: Path) -> dict[str, Any]:
    state = build(ws)
    with CheckpointManager(root, retention=Retention(keep_last=2), queue_depth=2, timeout=60) as mgr:
        for step in range(1, 7):
            train(state, rank, 1)
            mgr.save(step, state, metrics={"loss": 1.0 / step})
        mgr.wait()
        latest = mgr.latest_step
    return {"latest": latest, "dirs": sorted(p.name for p in root.glob("step_*"))}


def one_rank_fails(rank: int, ws: int, root: Path, results: Path, async_save: bool) -> dict[str, Any]:
    state = build(ws)
    ops = RankFaults(step=2) if rank == 1 else FileOps()
    out: dict[str, Any] = {}
    with CheckpointManager(root, async_save=async_save, file_ops=ops, timeout=60) as mgr:
        mgr.save(1, state)
        mgr.wait()
        try:
            mgr.save(2, state)
            mgr.wait()
        except Exception as e:
            out["error"] = _describe(e)
        out["latest"] = mgr.latest_step
        fresh = build(ws, seed=5)
        out["restored"] = mgr.restore(fresh).step
        mgr.save(3, state)  # later saves work again
        mgr.wait()
    out["dirs"] = sorted(p.name for p in root.glob("step_*"))
    return out


def one_rank_lost(rank: int, ws: int, root: Path, results: Path, timeout: float, how: str) -> dict[str, Any]:
    """Rank 1 dies (``how="killed"``) or stops answering (``"hangs"``) in the save of step 2."""
    state = build(ws)
    faults = RankFaults(step=2, kill=how == "killed", hang=timeout * 3 if how == "hangs" else 0.0)
    ops = faults if rank == 1 else FileOps()
    mgr = CheckpointManager(root, file_ops=ops, timeout=timeout)
    mgr.save(1, state)
    mgr.wait()
    started = time.monotonic()
    try:
        mgr.save(2, state)
        mgr.wait()
        return {"error": None}
    except Exception as e:
        return {"error": _describe(e), "seconds": time.monotonic() - started}


def leader_rejects_a_save(rank: int, ws: int, root: Path, results: Path) -> dict[str, Any]:
    """Only rank 0 knows step 5 is saved, so only it rejects save(3); every rank must raise,
    and the next save must still land whole."""
    state = build(ws)
    out: dict[str, Any] = {}
    with CheckpointManager(root, timeout=60) as mgr:
        mgr.save(5, state)
        try:
            mgr.save(3, state)
        except Exception as e:
            out["error"] = _describe(e)
        train(state, rank, 1)
        mgr.save(6, state)
        mgr.wait()
    fresh = build(ws, seed=9)
    with CheckpointManager(root, timeout=60) as mgr:
        out["restored"] = mgr.restore(fresh).step
    out["same"] = all(
        torch.equal(a, b)
        for a, b in zip(full_weights(state).values(), full_weights(fresh).values(), strict=True)
    )
    return out


def stale_view_restore(rank: int, ws: int, root: Path, results: Path) -> dict[str, Any]:
    """Rank 1 looks at a stale copy of the root (its `latest` names step 1); rank 0 decides."""
    state = build(ws, seed=3)
    view = root if rank == 0 else results / "stale-copy"
    with CheckpointManager(view, timeout=60) as mgr:
        return {"step": mgr.restore(state).step}


def _overlap_model(world_size: int, kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    if kind == "ddp":  # BatchNorm: DDP broadcasts its buffers at the start of each forward
        model: nn.Module = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 8))
        model = nn.parallel.DistributedDataParallel(model)
    else:
        model = build(world_size)["model"]
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _local_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    def local(t: Any) -> Any:
        if hasattr(t, "to_local"):
            return t.to_local().clone()
        return t.clone() if isinstance(t, torch.Tensor) else t

    flat = {f"model.{k}": local(v) for k, v in model.state_dict().items()}
    for pid, st in optim.state_dict()["state"].items():
        flat |= {f"optim.{pid}.{k}": local(v) for k, v in st.items()}
    return flat


def overlap_exact(rank: int, ws: int, root: Path, results: Path, *, kind: str) -> dict[str, Any]:
    """overlap_staging=True on every rank, the background copy held until two more steps ran: each
    rank's checkpoint is its state at save()."""
    import threading

    from safeckpt._manager import overlap

    go = threading.Event()
    real = overlap.OverlappedCopy._run
    overlap.OverlappedCopy._run = lambda self: (go.wait(60), real(self))[1]  # type: ignore[method-assign]
    model, optim = _overlap_model(ws, kind)
    # DDP: the same batches on every rank, so the BatchNorm statistics every rank holds are alike
    # (DCP keeps one copy of a plain tensor, from any rank); FSDP2: each rank's own shards.
    gen = torch.Generator().manual_seed(100 + (0 if kind == "ddp" else rank))

    def step() -> None:
        model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()

    step()
    expected = _local_state(model, optim)
    with CheckpointManager(root, overlap_staging=True) as mgr:
        mgr.save(1, {"model": model, "optim": optim})
        step()
        step()
        go.set()
        mgr.wait()
    changed = [k for k, v in _local_state(model, optim).items() if not torch.equal(v, expected[k])]
    fresh, fresh_optim = _overlap_model(ws, kind)
    with CheckpointManager(root) as mgr:
        mgr.restore({"model": fresh, "optim": fresh_optim})
    got = _local_state(fresh, fresh_optim)
    buffers = {f"model.{k}" for k, _ in model.named_buffers()}
    checked = [k for k in expected if kind == "ddp" or k not in buffers]
    return {
        "mismatch": [k for k in checked if not torch.equal(got[k], expected[k])],
        "checked": len(checked),
        "changed_since": len(changed),
    }


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    f.__name__: f
    for f in (
        save_sharded,
        restore_sharded,
        async_retention,
        one_rank_fails,
        one_rank_lost,
        leader_rejects_a_save,
        stale_view_restore,
        overlap_exact,
    )
}


def _describe(error: BaseException) -> dict[str, Any]:
    return {
        "type": type(error).__name__,
        "message": str(error),
        "failures": {str(k): v for k, v in getattr(error, "failures", {}).items()},
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
            json.dumps({"ok": False, "error": _describe(e), "traceback": traceback.format_exc()})
        )
        raise
    finally:
        if ws > 1 and dist.is_initialized() and scenario != "one_rank_lost":
            dist.destroy_process_group()
    if scenario == "one_rank_lost":
        os._exit(0)  # the gloo group is broken; do not wait on it at exit
