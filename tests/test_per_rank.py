"""per_rank(): state that differs between ranks is saved in the rank's own file, tensors included,
and restored to the same rank in place (the multi-rank cases are in test_state_dist.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import safeckpt
from safeckpt import CheckpointManager, per_rank
from safeckpt._ops.inspection import train_state_summary
from safeckpt.errors import UnsupportedStateError
from test_state import SYNC_ASYNC


class Stream:
    """A data stream's position: a generator's state (a uint8 tensor), an order and a cursor."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(16, generator=self.generator)
        self.cursor = 0

    def next(self) -> torch.Tensor:
        self.cursor += 1
        return torch.randn(3, generator=self.generator) + self.order[self.cursor % 16]

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "order": self.order, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.order = state["order"]
        self.cursor = state["cursor"]


@SYNC_ASYNC
def test_a_per_rank_stateful_resumes_its_stream_bit_exact(root: Path, async_save: bool) -> None:
    stream = Stream(seed=3)
    for _ in range(5):
        stream.next()
    with CheckpointManager(root, async_save=async_save) as mgr:
        mgr.save(5, {"data": per_rank(stream)})
        expected = [stream.next() for _ in range(4)]  # also changes what an async save copied
        mgr.wait()
        fresh = Stream(seed=99)
        assert mgr.restore({"data": per_rank(fresh)}).step == 5
    assert fresh.cursor == 5
    assert all(torch.equal(fresh.next(), e) for e in expected)


def test_a_per_rank_dict_is_restored_in_place(root: Path) -> None:
    saved = {"t": torch.arange(4.0), "n": 7, "nested": {"u": torch.ones(2, dtype=torch.int16)}}
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"own": per_rank(saved)})
        t, u = torch.zeros(4), torch.zeros(2, dtype=torch.int16)
        target = {"own": per_rank({"t": t, "n": 0, "nested": {"u": u}})}
        mgr.restore(target)
    inner = target["own"].value
    assert inner["t"] is t and inner["nested"]["u"] is u  # the caller's tensors, filled
    assert torch.equal(t, torch.arange(4.0)) and torch.equal(u, torch.ones(2, dtype=torch.int16))
    assert inner["n"] == 7


def test_per_rank_tensors_are_in_the_train_state_file_not_in_dcp(root: Path) -> None:
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(3), "own": per_rank({"t": torch.arange(5)})})
        mgr.save(2, {"w": torch.ones(3)})
    directory = root / "step_1"
    # format 3 where a per_rank value is in the file (an earlier safeckpt names the version), else 2
    assert train_state_summary(directory)["train_state.rank0.safetensors"]["format"] == 3
    assert train_state_summary(root / "step_2")["train_state.rank0.safetensors"]["format"] == 2
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata)
    assert "w" in keys and not any(k.startswith("own") for k in keys)
    summary = train_state_summary(directory)["train_state.rank0.safetensors"]["entries"]
    assert summary["own"] == {"per_rank": {"t": {"__tensor__": {"dtype": "I64", "shape": [5]}}}}
    loaded = safeckpt.load(root, step=1)
    assert torch.equal(loaded["own"]["t"], torch.arange(5)) and torch.equal(loaded["w"], torch.ones(3))


def test_a_per_rank_value_of_another_shape_or_missing_keys_is_an_error_naming_it(root: Path) -> None:
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"own": per_rank({"t": torch.arange(4.0), "k": 1})})
        before = torch.zeros(3)
        with pytest.raises(UnsupportedStateError, match=r"own\.t is float32 \[4\] in the checkpoint"):
            mgr.restore({"own": per_rank({"t": before, "k": 0})})
        assert torch.equal(before, torch.zeros(3))  # nothing was changed
        with pytest.raises(UnsupportedStateError, match=r"'own\.extra'"):
            mgr.restore({"own": per_rank({"t": torch.zeros(4), "k": 0, "extra": 2})})
        loose = {"t": torch.zeros(4), "k": 0, "extra": 2}
        restored = mgr.restore({"own": per_rank(loose)}, strict=False)
    assert restored.missing == ("own.extra",)
    assert torch.equal(loose["t"], torch.arange(4.0)) and loose["k"] == 1


def test_a_per_rank_value_that_changes_shape_between_saves_is_saved_as_it_is_now(root: Path) -> None:
    own: dict[str, Any] = {"t": torch.arange(2)}
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"own": per_rank(own)})
        own["t"] = torch.arange(6).reshape(2, 3)  # the same structure signature: only the value changes
        own["more"] = [1, (2, 3)]
        mgr.save(2, {"own": per_rank(own)})
        fresh: dict[str, Any] = {"t": torch.zeros(2, 3, dtype=torch.int64), "more": None}
        mgr.restore({"own": per_rank(fresh)})
    assert torch.equal(fresh["t"], torch.arange(6).reshape(2, 3)) and fresh["more"] == [1, (2, 3)]


def test_what_per_rank_cannot_hold_is_refused_before_anything_is_written(root: Path) -> None:
    with pytest.raises(UnsupportedStateError, match="per_rank\\(\\) takes a Stateful"):
        per_rank(nn.Linear(2, 2))
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(1)})
        with pytest.raises(UnsupportedStateError, match=r"own\.fn is a builtins\.function"):
            mgr.save(2, {"own": per_rank({"fn": lambda: 0})})
        nested = r"own\.a is .*PerRank inside per_rank\(\).*drop the inner"
        with pytest.raises(UnsupportedStateError, match=nested):
            mgr.save(2, {"own": per_rank({"a": per_rank(torch.ones(1))})})
        generator = r"own\.g is a torch.*Generator \(save its get_state\(\)"
        with pytest.raises(UnsupportedStateError, match=generator):
            mgr.save(2, {"own": per_rank({"g": torch.Generator()})})
        assert [c.step for c in mgr.checkpoints()] == [1]
    assert json.loads((root / "step_1" / "metadata.json").read_text())["step"] == 1


def test_only_keys_several_ranks_hold_with_different_bytes_are_diverging() -> None:
    from safeckpt._state.replicas import SMALL_BYTES, diverging, fingerprints

    same, other = torch.arange(4), torch.arange(4) + 1
    big = torch.randn(256, SMALL_BYTES // 4)  # past the size fingerprinted whole: sampled
    shard1 = torch.randn(256, SMALL_BYTES // 4)  # another part of one weight (plain tensor parallelism)
    rank0 = fingerprints({"a": same, "b": same, "stage0": same, "big": big, "w": big, "t": big})
    rank1 = fingerprints(
        {"a": same.clone(), "b": other, "stage1": other, "big": big.clone(), "w": shard1, "t": big.t()}
    )
    assert "t" not in rank1  # a large tensor that is not contiguous is left out
    # disjoint keys (pipeline stages) are not compared; equal large replicas are not diverging
    assert diverging([rank0, rank1]) == {"b": [0, 1], "w": [0, 1]}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a sync save's live GPU tensors")
def test_cuda_tensors_are_fingerprinted_as_their_host_copies() -> None:
    from safeckpt._state.replicas import SMALL_BYTES, fingerprints

    host = {"small": torch.arange(4.0), "big": torch.randn(256, SMALL_BYTES // 4)}
    on_gpu = {k: v.cuda() for k, v in host.items()}
    assert fingerprints(on_gpu) == fingerprints(host) and set(fingerprints(on_gpu)) == {"small", "big"}


def test_a_rank_with_many_tensors_checks_a_share_per_save_and_every_key_within_a_few(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from safeckpt._state import replicas as replicas

    monkeypatch.setattr(replicas, "MOST", 8)
    model = {f"layer{i}": torch.full((3,), float(i)) for i in range(40)}  # before the loader's state
    rank0 = {**model, "data.order": torch.arange(5)}
    rank1 = {**{k: v.clone() for k, v in list(model.items())[:20]}, "data.order": torch.arange(5).flip(0)}
    seen: set[str] = set()
    for step in range(0, 64 * 500, 500):  # steps a run saves at: multiples of the save interval
        prints0, prints1 = replicas.fingerprints(rank0, step), replicas.fingerprints(rank1, step)
        assert len(prints0) <= 16  # about MOST, never all 41
        # what the rank with more tensors (a smaller share) checks, the one with fewer checks too
        assert set(prints0) & set(rank1) <= set(prints1)
        seen |= set(replicas.diverging([prints0, prints1]))
    assert seen == {"data.order"}


class Sampler:
    """A Stateful that marks its own position per_rank inside its state_dict (a dict it keeps)."""

    def __init__(self) -> None:
        self.order = torch.zeros(3, dtype=torch.int64)
        self.state = {"epoch": 0, "mine": per_rank({"cursor": 0, "order": self.order})}
        self.received: Any = None

    def state_dict(self) -> dict[str, Any]:
        return self.state  # its own dict, not a copy

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.received = state
        self.state = {"epoch": state["epoch"], "mine": per_rank(state["mine"])}


@SYNC_ASYNC
def test_a_stateful_with_per_rank_inside_gets_plain_values_in_load_state_dict(
    root: Path, async_save: bool
) -> None:
    saved = Sampler()
    saved.state = {"epoch": 2, "mine": per_rank({"cursor": 7, "order": torch.arange(3)})}
    with CheckpointManager(root, async_save=async_save) as mgr:
        mgr.save(1, {"sampler": saved})
        mgr.wait()
        fresh = Sampler()
        wrapper = fresh.state["mine"]
        mgr.restore({"sampler": fresh})
    assert fresh.received["epoch"] == 2 and fresh.received["mine"]["cursor"] == 7
    assert torch.equal(fresh.received["mine"]["order"], torch.arange(3))
    assert not any(isinstance(v, type(wrapper)) for v in fresh.received.values())
    assert torch.equal(fresh.order, torch.arange(3))  # the saved tensor went into the live one
    assert isinstance(fresh.state["mine"], type(wrapper))  # the object still marks it per_rank
