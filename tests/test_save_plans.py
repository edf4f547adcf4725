"""DCP's save plans are reused between saves of one manager, and only while nothing changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint.planner import SavePlanner

import safeckpt
from safeckpt import CheckpointManager, Retention
from safeckpt._dcp import plans as save_plans
from safeckpt._dcp.safe_metadata import read_metadata
from safeckpt._storage.writer import RawFileSystemWriter
from safeckpt._util.torch_private import PLAN_CACHES
from safeckpt.errors import SaveFailedError

# Every test but the last needs DCP's plan caches (torch 2.13 has them; an older torch may not).
needs_caching = pytest.mark.skipif(not save_plans.CACHING, reason="this torch has no DCP plan caching")


def cached(name: str) -> dict[str, Any]:
    """DCP's class-level plan cache ``name`` (empty where this torch has none)."""
    return getattr(SavePlanner, f"_cached_{name}", {})


@pytest.fixture
def global_plans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times DCP made a global plan (once per save without a cached plan)."""
    made: list[int] = []
    original = default_planner.create_default_global_save_plan

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(default_planner, "create_default_global_save_plan", counting)
    return made


def fresh_metadata(tmp_path: Path, state: dict[str, Any]) -> Any:
    """The ``.metadata`` a manager with nothing cached writes for ``state``."""
    with CheckpointManager(tmp_path / "fresh", async_save=False, retention=Retention()) as mgr:
        mgr.save(0, state)
        return read_metadata(mgr.root / "step_0")


def same(loaded: Any, saved: Any) -> bool:
    """Equal values, dtypes, keys and key types."""
    if isinstance(saved, torch.Tensor):
        return loaded.dtype == saved.dtype and torch.equal(loaded, saved.detach())
    return [(type(k), k) for k in loaded] == [(type(k), k) for k in saved] and all(
        same(loaded[k], saved[k]) for k in saved
    )


@needs_caching
def test_a_plan_is_reused_while_the_state_keeps_its_shape(tmp_path: Path, global_plans: list[int]) -> None:
    state = {"model": {"w": torch.randn(4, 3), "b": torch.randn(3)}, "step": 0}
    with CheckpointManager(tmp_path / "ckpt", async_save=False, retention=Retention()) as mgr:
        for step in range(1, 4):
            state["model"]["w"].add_(1.0)  # new values, same plan
            mgr.save(step, state)
        assert len(global_plans) == 1
        key = mgr._plans.key
        assert all(key in cached(name) for name in PLAN_CACHES)
    assert not any(key in cached(name) for name in PLAN_CACHES)  # forgotten at close
    loaded = safeckpt.load(tmp_path / "ckpt")
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])


@needs_caching
@pytest.mark.parametrize(
    "before, after, plans",
    [
        # same names, shapes and offsets: DCP's own comparison calls these plans equal
        ({"w": torch.ones(4, 3)}, {"w": torch.ones(4, 3, dtype=torch.bfloat16)}, 2),
        ({"w": torch.ones(4, 3)}, {"w": torch.ones(4, 3, requires_grad=True)}, 2),
        # the key's type lives in the train state: DCP's plan is the same, and so is reused
        ({"m": {0: torch.ones(2)}}, {"m": {"0": torch.ones(2)}}, 1),
    ],
    ids=["dtype", "requires-grad", "int-key-to-str"],
)
def test_a_change_dcps_comparison_misses_is_planned_anew(
    tmp_path: Path, global_plans: list[int], before: dict[str, Any], after: dict[str, Any], plans: int
) -> None:
    with CheckpointManager(tmp_path / "ckpt", async_save=False, retention=Retention()) as mgr:
        mgr.save(1, before)
        mgr.save(2, before)
        mgr.save(3, after)
        assert len(global_plans) == plans
        written = read_metadata(mgr.root / "step_3")
    expected = fresh_metadata(tmp_path, after)
    assert written.state_dict_metadata == expected.state_dict_metadata
    assert written.planner_data == expected.planner_data
    assert same(safeckpt.load(tmp_path / "ckpt"), after)


@needs_caching
def test_two_managers_in_one_process_keep_their_own_plans(tmp_path: Path, global_plans: list[int]) -> None:
    a = {"x": torch.arange(6.0).reshape(2, 3)}
    b = {"x": torch.arange(6, dtype=torch.float64).reshape(2, 3)}  # DCP's comparison: the same plan
    with (
        CheckpointManager(tmp_path / "a", async_save=False, retention=Retention()) as ma,
        CheckpointManager(tmp_path / "b", async_save=False, retention=Retention()) as mb,
    ):
        for step in range(1, 3):
            ma.save(step, a)
            mb.save(step, b)
    assert len(global_plans) == 2  # one plan each; one cache for both would plan all 4 saves
    assert torch.equal(safeckpt.load(tmp_path / "a")["x"], a["x"])
    assert torch.equal(safeckpt.load(tmp_path / "b")["x"], b["x"])
    assert read_metadata(tmp_path / "b" / "step_2").state_dict_metadata["x"].properties.dtype == torch.float64


@needs_caching
def test_a_failed_save_drops_the_plans_and_the_next_one_plans_in_full(
    tmp_path: Path, global_plans: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"w": torch.ones(4, 3)}
    with CheckpointManager(tmp_path / "ckpt", async_save=False, retention=Retention()) as mgr:
        mgr.save(1, state)
        state["w"] = state["w"].to(torch.bfloat16)  # a new plan, cached only if its save succeeds
        original = RawFileSystemWriter.write_data

        def failing(*args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "No space left on device (injected)")

        monkeypatch.setattr(RawFileSystemWriter, "write_data", failing)
        with pytest.raises(SaveFailedError, match="injected"):
            mgr.save(2, state)
        assert not any(mgr._plans.key in cached(name) for name in PLAN_CACHES)
        monkeypatch.setattr(RawFileSystemWriter, "write_data", original)
        mgr.save(3, state)
        assert len(global_plans) == 3
        assert read_metadata(mgr.root / "step_3").state_dict_metadata["w"].properties.dtype == torch.bfloat16
        assert mgr.latest_step == 3 and not (mgr.root / "step_2").exists()


@needs_caching
def test_a_plan_reused_against_a_lost_coordinator_cache_fails_the_save_not_the_checkpoint(
    tmp_path: Path, global_plans: list[int]
) -> None:
    state = {"w": torch.ones(4, 3), "b": torch.zeros(2)}
    with CheckpointManager(tmp_path / "ckpt", async_save=False, retention=Retention()) as mgr:
        mgr.save(1, state)
        del SavePlanner._cached_all_plans[mgr._plans.key]  # as if the coordinator had lost it
        with pytest.raises(SaveFailedError, match="no longer holds"):
            mgr.save(2, state)
        mgr.save(3, state)
        assert len(global_plans) == 2
        assert sorted(read_metadata(mgr.root / "step_3").state_dict_metadata) == ["b", "w"]
    assert torch.equal(safeckpt.load(tmp_path / "ckpt")["w"], state["w"])


def test_a_torch_without_plan_caching_plans_every_save(
    tmp_path: Path, global_plans: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(save_plans, "CACHING", False)
    state = {"w": torch.randn(3)}
    with CheckpointManager(tmp_path / "ckpt", async_save=False, retention=Retention()) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        assert not any(mgr._plans.key in cached(name) for name in PLAN_CACHES)
    assert len(global_plans) == 2
    assert torch.equal(safeckpt.load(tmp_path / "ckpt")["w"], state["w"])


# --- plans of plain tensors, made here ---------------------------------------------------------------


def plain_state() -> dict[str, Any]:
    w = torch.nn.Parameter(torch.randn(4, 3))
    return {
        "w": w,
        "tied": w,  # the same tensor under two names
        "b": torch.zeros(3, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 5),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "i": torch.arange(5, dtype=torch.int64),
        "grad": torch.ones(2, requires_grad=True),
    }


def test_a_plan_of_plain_tensors_has_the_items_dcp_makes(tmp_path: Path) -> None:
    state = plain_state()
    ours = save_plans.SavePlans().planner()
    ours.set_up_planner(state, is_coordinator=True)
    theirs = default_planner.DefaultSavePlanner()
    theirs.set_up_planner(state, is_coordinator=True)
    plan, expected = ours.create_local_plan(), theirs.create_local_plan()
    assert plan.items == expected.items and plan.planner_data == expected.planner_data
    assert ours.plan is plan
    # one properties object per kind of tensor, one zero offset per rank: pickled once each
    kinds = {(i.tensor_data.properties.dtype, i.tensor_data.properties.requires_grad) for i in plan.items}
    assert len({id(i.tensor_data.properties) for i in plan.items}) == len(kinds) == 4
    chunks = [i.tensor_data.chunk for i in plan.items]
    assert len({id(c.offsets) for c in chunks}) == len({len(c.offsets) for c in chunks}) == 3  # 0-, 1-, 2-dim
    for item in plan.items:  # each tensor itself, as DCP's lookup finds it
        assert ours.resolve_data(item) is theirs.resolve_data(item)
    with CheckpointManager(tmp_path / "ckpt", async_save=False, retention=Retention()) as mgr:
        mgr.save(1, state)
        metadata = read_metadata(mgr.root / "step_1")
    saved = metadata.state_dict_metadata.values()
    kinds = {(md.properties.dtype, md.properties.requires_grad) for md in saved}
    assert len({id(md.properties) for md in saved}) == len(kinds) < len(saved)
    loaded = dcp_load_plain(mgr.root / "step_1", state)
    assert all(torch.equal(loaded[k], v.detach()) for k, v in state.items())


def dcp_load_plain(directory: Path, like: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What plain ``dcp.load`` reads from ``directory`` into fresh tensors shaped as ``like``."""
    import torch.distributed.checkpoint as dcp

    target = {k: torch.empty_like(v.detach()) for k, v in like.items()}
    dcp.load(target, checkpoint_id=directory, no_dist=True)
    return target


def test_a_state_of_other_values_is_planned_by_dcp() -> None:
    planner = save_plans.SavePlans().planner()
    planner.set_up_planner({"w": torch.ones(2), "lr": 0.1}, is_coordinator=True)
    assert save_plans._inputs(planner.state_dict, True, planner.mappings) is None
    assert {i.index.fqn for i in planner.create_local_plan().items} == {"w", "lr"}


@needs_caching
def test_a_plan_made_from_the_same_inputs_is_neither_made_nor_compared_again(
    tmp_path: Path, global_plans: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []
    original = save_plans._plain_items
    monkeypatch.setattr(save_plans, "_plain_items", lambda *a: made.append(1) or original(*a))
    compared: list[int] = []
    same_plan = save_plans._same
    monkeypatch.setattr(save_plans, "_same", lambda *a: compared.append(1) or same_plan(*a))
    w = torch.nn.Parameter(torch.randn(4, 3))
    state = {"model": {"w": w, "b": torch.randn(3)}}
    with CheckpointManager(tmp_path / "ckpt", async_save=False, retention=Retention()) as mgr:
        for step in range(1, 4):
            mgr.save(step, state)
        assert (made, compared, len(global_plans)) == ([1], [], 1)
        w.data = w.data.to(torch.bfloat16)  # the same parameter, cast in place: a new plan
        mgr.save(4, state)
        mgr.save(5, state)
        assert (made, compared, len(global_plans)) == ([1, 1], [1], 2)
        assert (
            read_metadata(mgr.root / "step_5").state_dict_metadata["model.w"].properties.dtype
            == torch.bfloat16
        )
        state["model"]["b"] = torch.randn(3, 1)  # another shape under the same name
        mgr.save(6, state)
        assert read_metadata(mgr.root / "step_6").state_dict_metadata["model.b"].size == torch.Size([3, 1])
    assert same(safeckpt.load(tmp_path / "ckpt"), {"model": {"w": w, "b": state["model"]["b"]}})
