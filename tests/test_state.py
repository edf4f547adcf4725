"""The state walk: every tensor through DCP, every other leaf JSON; round trips of every dtype and
container; refused values; the train-state file; RNG."""

from __future__ import annotations

import io
import json
import math
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import safeckpt
from safeckpt import CheckpointManager
from safeckpt._fs.fileops import FileOps
from safeckpt._state.train_state import (
    capture_rng,
    decode_train_state,
    encode_train_state,
    encode_values,
    restore_rng,
)
from safeckpt._state.walk import StateCache, capture
from safeckpt.errors import IncompleteCheckpointError, UnsupportedStateError

SYNC_ASYNC = pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.contiguous().view(-1)
    return flat if flat.dtype == torch.bool else flat.view(torch.uint8)


def same(a: Any, b: Any) -> bool:
    """Equality that also checks types and dtypes, and compares floats and tensors bit for bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return (
            list(a) == list(b)
            and all(type(k) is type(j) for k, j in zip(a, b, strict=True))
            and all(same(a[k], b[k]) for k in a)
        )
    return bool(a == b)


def saved_and_loaded(root: Path, state: dict[Any, Any], *, async_save: bool) -> dict[Any, Any]:
    with CheckpointManager(root, async_save=async_save, save_rng=False) as mgr:
        mgr.save(1, state)
    return safeckpt.load(root)


def dcp_keys(checkpoint: Path) -> set[str]:
    from safeckpt._dcp.safe_metadata import read_metadata

    return set(read_metadata(checkpoint).state_dict_metadata)


# --- round trips: every dtype, tensor kind and container ---------------------------------------

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def sample(dtype: torch.dtype) -> torch.Tensor:
    source = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)) * 100
    if dtype == torch.bool:
        return source > 0
    if dtype.is_complex:
        return torch.complex(source, -source).to(dtype)
    tensor = source.to(dtype)
    if dtype.is_floating_point and dtype.itemsize > 1:
        tensor[0, 0], tensor[0, 1], tensor[0, 2] = math.nan, math.inf, -0.0
    return tensor


@SYNC_ASYNC
def test_every_dtype_and_tensor_kind_round_trips_bit_exact_through_dcp(root: Path, async_save: bool) -> None:
    state: dict[str, Any] = {}
    for dtype in DTYPES:
        t = sample(dtype)
        name = str(dtype).removeprefix("torch.")
        # a view (non-contiguous), a 0-d one, an empty one, and the tensor itself
        state[name] = {"full": t, "column": t[:, 1], "scalar": t[0, 0], "empty": t[:0]}
    shared = torch.arange(6.0)
    state["shared"] = [shared, shared, shared.view(2, 3)]
    state["grad"] = nn.Parameter(torch.ones(2))
    loaded = saved_and_loaded(root, state, async_save=async_save)
    expected = {k: (v.detach().contiguous() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    expected = {
        k: {n: t.contiguous() for n, t in v.items()} if isinstance(v, dict) else v
        for k, v in expected.items()
    }
    expected["shared"] = [t.contiguous() for t in state["shared"]]
    assert same(loaded, expected)
    assert not loaded["grad"].requires_grad
    # Every tensor went to DCP; the train-state file holds no tensor (RNG off).
    keys = dcp_keys(root / "step_1")
    assert {"float32.full", "bool.empty", "shared.2", "grad"} <= keys
    doc = _document(root / "step_1" / "train_state.rank0.safetensors")
    assert doc["values"] == [] and doc["rng"] is None


CONTAINERS = [
    pytest.param({"a": {"b": {"c": [torch.ones(1), (torch.zeros(2), 3)]}}}, id="nested"),
    pytest.param({"ints": {0: torch.ones(1), 7: {-1: "neg"}, 2**40: 1}}, id="int-keys"),
    pytest.param({"t": (1, (2.5, None), [torch.ones(1)], ())}, id="tuples"),
    pytest.param({"l": [[1, [2, [3, []]]], {}], "e": {}}, id="empty-containers"),
    pytest.param(
        {"model.ema": torch.ones(2), "a/b": 1, "sp ace": 2, "üñí": torch.zeros(1), "%2E": 3}, id="odd-keys"
    ),
    pytest.param({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, id="dotted-collision"),
    pytest.param({1: torch.ones(1), "1": torch.zeros(1)}, id="int-str-collision"),
    pytest.param(
        {"a": torch.ones(1), "a.b": torch.zeros(1), "": {"": torch.ones(1)}, "x.": torch.ones(2)},
        id="prefix-and-empty-keys",
    ),
    pytest.param(
        {"v": [True, False, None, 0, "", 2**100, b"\x00\xff", [math.inf, -math.inf, math.nan, -0.0]]},
        id="plain-values",
    ),
    pytest.param({"__tensor__": "t0", "__dict__": 1, "T": {"V": 0}}, id="keys-that-look-like-tags"),
    pytest.param({"cfg": {"dtype": torch.bfloat16, "device": torch.device("cpu")}}, id="dtype-and-device"),
    pytest.param(
        {"np": [np.arange(6, dtype=np.int32).reshape(2, 3), np.array([0.5, np.nan], dtype=np.float16)]},
        id="ndarrays",
    ),
]


@pytest.mark.parametrize("state", CONTAINERS)
def test_every_container_and_key_round_trips(root: Path, state: dict[Any, Any]) -> None:
    assert same(saved_and_loaded(root, state, async_save=True), state)


def test_keys_are_those_of_dcp_flattening_and_plain_dcp_load_reads_them(root: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    state = {"model": model.state_dict(), "ema": {"layers": [{"w": torch.ones(2)}]}, "step": 3}
    with CheckpointManager(root, save_rng=False) as mgr:
        mgr.save(1, state)
    assert dcp_keys(root / "step_1") == {
        "model.0.weight",
        "model.0.bias",
        "model.1.weight",
        "model.1.bias",
        "ema.layers.0.w",
    }
    fresh = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    template = {"model": fresh.state_dict(), "ema": {"layers": [{"w": torch.zeros(2)}]}}
    dcp.load(template, checkpoint_id=str(root / "step_1"))  # plain DCP, nested template
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )
    assert torch.equal(template["ema"]["layers"][0]["w"], torch.ones(2))


def test_colliding_keys_are_escaped_not_lost(root: Path) -> None:
    state = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}, 1: torch.full((1,), 2.0), "1": torch.ones(1)}
    with CheckpointManager(root, save_rng=False) as mgr:
        mgr.save(1, state)
    assert dcp_keys(root / "step_1") == {"a.b", "%a.b", "1", "%1"}
    assert same(safeckpt.load(root), state)


# --- what cannot be saved ---------------------------------------------------------------------


class Opaque:
    pass


class BadScheduler:
    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": 3, "lr_lambda": lambda epoch: 0.9**epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


UNSUPPORTED = [
    pytest.param(
        {"model": {"head": {"fn": lambda x: x}}}, "model.head.fn is a builtins.function", id="lambda"
    ),
    pytest.param({"cfg": {"opts": [1, Opaque()]}}, "cfg.opts.1 is a test_state.Opaque", id="object"),
    pytest.param({"f": io.BytesIO()}, "f is a _io.BytesIO", id="open-file"),
    pytest.param({"s": {1, 2}}, "s is a builtins.set", id="set"),
    pytest.param({"sched": BadScheduler()}, "sched.lr_lambda is a builtins.function", id="stateful"),
    pytest.param({"t": [torch.zeros(2).to_sparse()]}, "t.0 is a torch.Tensor with layout", id="sparse"),
    pytest.param({"t": torch.empty(2, device="meta")}, "t is a torch.Tensor (meta)", id="meta"),
    pytest.param({"a": np.array(["x"])}, "a is a numpy.ndarray", id="ndarray-of-str"),
    pytest.param({"k": {(1, 2): 1}}, "k has a key (1, 2) of type tuple", id="tuple-key"),
    pytest.param({"k": {2.5: 1}}, "k has a key 2.5 of type float", id="float-key"),
    pytest.param({"k": {True: 1}}, "k has a key True of type bool", id="bool-key"),
    pytest.param({None: 1}, "the state has a key None", id="top-level-key"),
]


@pytest.mark.parametrize("state,where", UNSUPPORTED)
def test_an_unsupported_value_names_its_path(state: dict[str, Any], where: str) -> None:
    with pytest.raises(UnsupportedStateError) as info:
        capture(state, rng=True)
    assert where in str(info.value)
    assert "Nothing was written" in str(info.value)
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("state", [[("model", 1)], "state"], ids=["list", "str"])
def test_a_state_that_is_not_a_mapping_is_refused(state: Any) -> None:
    with pytest.raises(UnsupportedStateError, match="state must be a dict"):
        capture(state, rng=False)


@SYNC_ASYNC
@pytest.mark.parametrize("bad", [lambda: None, Opaque(), {frozenset(): 1}], ids=["lambda", "object", "key"])
def test_an_unsupported_value_is_refused_before_anything_is_written(
    root: Path, async_save: bool, bad: Any
) -> None:
    model = nn.Linear(2, 2)
    with CheckpointManager(root, async_save=async_save) as mgr:
        mgr.save(1, {"model": model, "opts": {"x": 1}})
        mgr.wait()
        before = sorted(p.name for p in root.iterdir())
        with pytest.raises(UnsupportedStateError, match=r"opts\.x"):
            mgr.save(2, {"model": model, "opts": {"x": bad}})
        mgr.wait()
        assert [c.step for c in mgr.checkpoints()] == [1]
        assert sorted(p.name for p in root.iterdir()) == before
        assert list((root / ".staging").glob("*")) == []
        mgr.save(3, {"model": model})  # the manager is still usable
    assert (root / "step_3").is_dir() and (root / "step_1").is_dir() and not (root / "step_2").exists()


def test_an_optimizer_without_its_module_names_its_path() -> None:
    model, other = nn.Linear(3, 2), nn.Linear(3, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for state in ({"train": {"optim": optim}}, {"model": other, "train": {"optim": optim}}):
        with pytest.raises(UnsupportedStateError) as info:
            capture(state, rng=False)
        assert "train.optim is an optimizer" in str(info.value)
        assert "{'model': model, 'optim': optim}" in str(info.value)


# --- the walk's cache and the staging buffers ---------------------------------------------------


def test_the_walk_is_cached_while_the_structure_stays_and_redone_when_it_changes() -> None:
    cache = StateCache()
    tensors = {f"t{i}": torch.full((4,), float(i)) for i in range(50)}
    first = capture({"x": tensors, "epoch": 1}, rng=False, cache=cache)
    second = capture({"x": dict(tensors), "epoch": 2}, rng=False, cache=cache)
    assert (cache.misses, cache.hits) == (1, 1)
    assert list(first.dcp) == list(second.dcp) == [f"x.t{i}" for i in range(50)]
    assert decode_train_state(second.encode_train_state(), source="t")["values"] == [2]  # values are fresh
    capture({"x": {**tensors, "new": torch.ones(1)}, "epoch": 3}, rng=False, cache=cache)
    capture({"x": tensors, "epoch": {"now": "a dict"}}, rng=False, cache=cache)
    assert (cache.misses, cache.hits) == (3, 1)
    reordered = capture({"x": dict(reversed(tensors.items())), "epoch": 4}, rng=False, cache=cache)
    same_count = {("u0" if k == "t0" else k): v for k, v in tensors.items()}  # only a name differs
    renamed = capture({"x": same_count, "epoch": 5}, rng=False, cache=cache)
    assert (cache.misses, cache.hits) == (5, 1)
    assert next(iter(reordered.dcp)) == "x.t49" and next(iter(renamed.dcp)) == "x.u0"
    capture({"x": tensors, "epoch": {"now": "a dict"}}, rng=False, cache=cache)
    assert (cache.misses, cache.hits) == (6, 1)
    with pytest.raises(UnsupportedStateError, match=r"epoch is a builtins\.set"):
        capture({"x": tensors, "epoch": {1}}, rng=False, cache=cache)  # same shape, bad leaf
    capture({"x": tensors, "epoch": {1: 0}}, rng=False, cache=cache)
    with pytest.raises(UnsupportedStateError, match="key True of type bool"):
        capture({"x": tensors, "epoch": {True: 0}}, rng=False, cache=cache)  # equal to 1, not valid


def test_many_small_tensors_are_staged_into_reused_buffers(root: Path) -> None:
    tensors = {i: torch.full((8,), float(i)) for i in range(2000)}
    with CheckpointManager(root, save_rng=False) as mgr:
        mgr.save(1, {"t": tensors})
        mgr.wait()
        slot = mgr._pool.slots[0]  # type: ignore[union-attr]
        allocated = slot.allocations
        for t in tensors.values():
            t.add_(1)
        mgr.save(2, {"t": tensors})
        mgr.wait()
        assert slot.allocations == allocated == 2000
    loaded = safeckpt.load(root)
    assert torch.equal(loaded["t"][1999], torch.full((8,), 2000.0))


class HoldStep1(FileOps):
    """Holds the writer thread at step 1's train-state write (after its DCP data) until released."""

    def __init__(self) -> None:
        self.reached, self.release = threading.Event(), threading.Event()

    def write_file(self, path: Path, data: bytes) -> None:
        if path.name.startswith("train_state") and path.parent.name.startswith("step_1."):
            self.reached.set()
            assert self.release.wait(60)
        super().write_file(path, data)


def test_an_async_save_snapshots_nested_tensors_and_values_at_save_time(root: Path) -> None:
    class Wrapper:
        def __init__(self) -> None:
            self.t = torch.zeros(1000)

        def state_dict(self) -> dict[str, Any]:
            return {"t": self.t, "n": int(self.t[0])}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    wrapper, nested = Wrapper(), {"a": [torch.zeros(3)], "lr": [0.1]}
    ops = HoldStep1()
    with CheckpointManager(root, save_rng=False, file_ops=ops, queue_depth=2) as mgr:
        mgr.save(1, {"w": wrapper, "nested": nested})
        assert ops.reached.wait(60)
        mgr.save(2, {"w": wrapper, "nested": nested})  # staged; written only after step 1
        wrapper.t.add_(1)  # training goes on while the save waits to be written
        nested["a"][0].add_(1)
        nested["lr"][0] = 0.2
        ops.release.set()
    expected = {"w": {"t": torch.zeros(1000), "n": 0}, "nested": {"a": [torch.zeros(3)], "lr": [0.1]}}
    assert same(safeckpt.load(root, step=2), expected)


# --- the train-state file -----------------------------------------------------------------------


def _document(path: Path) -> dict[str, Any]:
    blob = path.read_bytes()
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
    return json.loads(header["__metadata__"]["safeckpt.train_state"])


def test_the_file_records_the_structure_and_json_values_only(root: Path) -> None:
    with CheckpointManager(root, save_rng=False) as mgr:
        mgr.save(1, {"m": {3: (torch.ones(1), b"z")}, "lr": 0.5})
    document = _document(root / "step_1" / "train_state.rank0.safetensors")
    assert document["tree"] == {
        "D": [["m", {"D": [[3, {"U": [{"T": "m.3.0"}, {"V": 0}]}]]}], ["lr", {"V": 1}]]
    }
    assert document["values"] == [{"__bytes__": "eg=="}, 0.5]


def _blob(document: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    return save({"t0": torch.ones(1)}, metadata={"safeckpt.train_state": json.dumps(document)})


DAMAGED = [
    pytest.param(b"", id="empty"),
    pytest.param(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json", id="garbage"),
    pytest.param(encode_train_state('{"D": []}', "[]", {"t": torch.ones(100)})[:-7], id="truncated"),
    pytest.param(_blob({"format": 2}), id="no-tree"),
    pytest.param(_blob({"format": "3", "tree": {"D": []}, "values": []}), id="unknown-format"),
    pytest.param(_blob({"format": 1}), id="format-1-without-entries"),
    pytest.param(_blob({"format": 2, "tree": {"D": []}, "values": [{"__bytes__": "!!"}]}), id="bad-base64"),
]


@pytest.mark.parametrize("blob", DAMAGED)
def test_a_damaged_train_state_file_is_an_incomplete_checkpoint(blob: bytes) -> None:
    with pytest.raises(IncompleteCheckpointError) as info:
        decode_train_state(blob, source="/ckpt/step_1/train_state.rank0.safetensors")
    assert "/ckpt/step_1/train_state.rank0.safetensors is not a readable train-state file" in str(info.value)
    assert info.value.path == "/ckpt/step_1/train_state.rank0.safetensors"


def test_values_encode_numpy_scalars_as_python_numbers() -> None:
    text = encode_values([np.float64(0.1), np.int64(-3), np.bool_(True)])
    assert json.loads(text) == [0.1, -3, True]


# --- RNG -------------------------------------------------------------------------------------------


def draws() -> list[Any]:
    return [
        random.random(),
        random.gauss(0, 1),
        np.random.standard_normal(3).tolist(),
        np.random.randint(0, 2**31, 4).tolist(),
        torch.rand(5).tolist(),
        torch.randn(2).tolist(),
    ]


def test_rng_capture_and_restore_is_bit_exact() -> None:
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    random.gauss(0, 1)  # leaves a cached second Gaussian in Python's state
    np.random.standard_normal()  # and in numpy's (has_gauss)
    blob = encode_train_state('{"D": []}', "[]", capture_rng())
    expected = draws()
    rng = decode_train_state(blob, source="t")["rng"]
    assert set(rng) >= {"python", "numpy", "torch"}
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert draws() != expected
    restore_rng(rng)
    assert draws() == expected


def test_restore_rng_ignores_what_it_was_not_given() -> None:
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    restore_rng({"cuda": [torch.zeros(8, dtype=torch.uint8)] * 99})  # wrong device count: ignored
    assert torch.equal(torch.rand(3), expected)
