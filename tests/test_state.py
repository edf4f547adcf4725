"""Training state without pickle: the train-state encoding, classification, RNG, optimizers."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from safeckpt import CheckpointManager
from safeckpt.errors import IncompleteCheckpointError, UnsupportedStateError
from safeckpt.state import (
    apply_train_state,
    capture,
    capture_rng,
    decode_train_state,
    encode_train_state,
    load_targets,
    restore_rng,
)


def round_trip(value: Any) -> Any:
    blob = encode_train_state({"x": {"kind": "value", "value": value}}, None)
    return decode_train_state(blob, source="test")["entries"]["x"]["value"]


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
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


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
    torch.float8_e4m3fn,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
def test_tensors_round_trip_bit_exact(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    source = torch.randn(3, 4, generator=generator) * 100
    if dtype == torch.bool:
        tensor = source > 0
    elif dtype == torch.complex64:
        tensor = torch.complex(source, -source)
    else:
        tensor = source.to(dtype)
    if dtype.is_floating_point and dtype.itemsize > 1:
        tensor[0, 0], tensor[0, 1], tensor[0, 2] = math.nan, math.inf, -0.0
    for value in (tensor, tensor[:, 1], tensor[0, 0], tensor[:0]):  # views, a 0-d and an empty one
        assert same(round_trip(value), value.contiguous())


def test_tensor_encoding_copies_and_detaches() -> None:
    param = torch.ones(3, requires_grad=True)
    blob = encode_train_state({"x": {"kind": "value", "value": [param, param]}}, None)
    with torch.no_grad():
        param.add_(1)  # a change after capture is not in the snapshot
    a, b = decode_train_state(blob, source="t")["entries"]["x"]["value"]
    assert same(a, torch.ones(3)) and same(b, torch.ones(3)) and not a.requires_grad


VALUES = [
    pytest.param((1, "a", (2.5, None)), id="tuples"),
    pytest.param({1: "one", 2: {3: [4]}}, id="int-keys"),
    pytest.param({(1, 2): "tuple key", None: 0, 2.5: 1, True: 2}, id="other-keys"),
    pytest.param({"__tensor__": "t0", "__dict__": 1, "__x": 2}, id="keys-that-look-like-tags"),
    pytest.param({"kind": "value", "value": 1}, id="looks-like-an-entry"),
    pytest.param([[1, [2, [3, []]]], {}], id="nested-lists"),
    pytest.param(b"\x00\xffbytes", id="bytes"),
    pytest.param([math.inf, -math.inf, math.nan, -0.0, 1e-310], id="special-floats"),
    pytest.param({"a": math.nan}, id="nan-in-dict"),
    pytest.param(2**100, id="big-int"),
    pytest.param("üñí\u2028code", id="unicode"),
    pytest.param([True, False, None, 0, ""], id="scalars"),
    pytest.param({"t": torch.arange(5), "nested": [(torch.zeros(2, 2), {"u": torch.ones(1)})]}, id="tensors"),
    pytest.param(np.arange(6, dtype=np.int32).reshape(2, 3), id="ndarray-int"),
    pytest.param(np.array([0.5, np.nan, -np.inf], dtype=np.float16), id="ndarray-float16"),
    pytest.param(np.array([2**64 - 1], dtype=np.uint64), id="ndarray-uint64"),
    pytest.param(np.array(True), id="ndarray-0d-bool"),
    pytest.param(np.random.RandomState(3).get_state(), id="numpy-rng-state"),
]


@pytest.mark.parametrize("value", VALUES)
def test_values_round_trip(value: Any) -> None:
    assert same(round_trip(value), value)


def test_numpy_scalars_become_python_numbers() -> None:
    assert same(round_trip([np.float64(0.1), np.int64(-3), np.bool_(True)]), [0.1, -3, True])


def test_the_file_holds_json_and_tensors_only() -> None:
    blob = encode_train_state({"x": {"kind": "value", "value": {"t": torch.ones(2), 1: b"z"}}}, None)
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
    document = json.loads(header["__metadata__"]["safeckpt.train_state"])
    assert document["entries"]["x"]["value"] == {
        "__dict__": [["t", {"__tensor__": "t0"}], [1, {"__bytes__": "eg=="}]]
    }


# --- what cannot be saved -------------------------------------------------------------------------


class Opaque:
    pass


class BadScheduler:
    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": 3, "lr_lambda": lambda epoch: 0.9**epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


UNSUPPORTED = [
    pytest.param({"cb": lambda x: x}, "state['cb'] is a builtins.function", id="lambda"),
    pytest.param(
        {"cfg": {"opts": [1, Opaque()]}}, "state['cfg']['opts'][1] is a test_state.Opaque", id="object"
    ),
    pytest.param({"s": {1, 2}}, "state['s'] is a builtins.set", id="set"),
    pytest.param({"k": {frozenset(): 1}}, "state['k'] key is a builtins.frozenset", id="odd-key"),
    pytest.param({"sched": BadScheduler()}, "state['sched'].state_dict()['lr_lambda'] is a", id="stateful"),
    pytest.param(
        {"t": [torch.zeros(2, dtype=torch.complex128)]}, "state['t'][0] is a torch.Tensor", id="complex128"
    ),
    pytest.param({"t": [torch.zeros(2).to_sparse()]}, "state['t'][0] is a torch.Tensor", id="sparse"),
    pytest.param({"a": np.array(["x"])}, "state['a'] is a numpy.ndarray", id="ndarray-of-str"),
    pytest.param({"a": np.array([1 + 2j])}, "state['a'] is a numpy.ndarray", id="ndarray-complex"),
]


@pytest.mark.parametrize("state,where", UNSUPPORTED)
def test_an_unsupported_value_names_where_it_is(state: dict[str, Any], where: str) -> None:
    with pytest.raises(UnsupportedStateError) as info:
        capture(state, rng=True)
    assert where in str(info.value)
    assert "without pickle" in str(info.value) and "Nothing was written" in str(info.value)
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("state", [[("model", 1)], "state"], ids=["list", "str"])
def test_a_state_that_is_not_a_mapping_is_refused(state: Any) -> None:
    with pytest.raises(UnsupportedStateError, match="state must be a dict"):
        capture(state, rng=False)


def test_a_non_string_key_is_refused() -> None:
    with pytest.raises(UnsupportedStateError, match="state keys must be strings, got 1"):
        capture({1: torch.ones(1)}, rng=False)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_an_unsupported_value_is_refused_before_anything_is_written(root: Path, async_save: bool) -> None:
    model = nn.Linear(2, 2)
    with CheckpointManager(root, async_save=async_save) as mgr:
        with pytest.raises(UnsupportedStateError, match=r"state\['cb'\]"):
            mgr.save(1, {"model": model, "cb": lambda: None})
        mgr.wait()
        assert mgr.checkpoints() == []
        assert sorted(p.name for p in root.iterdir() if p.name not in (".lock", ".staging", ".trash")) == []
        assert list((root / ".staging").glob("*")) == []
        # The manager is still usable.
        mgr.save(2, {"model": model})
    assert (root / "step_2").is_dir() and not (root / "step_1").exists()


# --- classification and applying ------------------------------------------------------------------


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": (1, 2)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def test_capture_splits_the_state() -> None:
    model = nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    counter = Counter()
    counter.n = 7
    captured = capture(
        {"model": model, "optim": optim, "ema": torch.ones(2), "counter": counter, "epoch": 4}, rng=False
    )
    assert set(captured.dcp) == {"model", "optim", "ema"}
    assert set(captured.dcp["model"]) == {"weight", "bias"}
    decoded = decode_train_state(captured.train_state, source="t")
    assert decoded["rng"] is None
    assert decoded["entries"] == {
        "counter": {"kind": "stateful", "state": {"n": 7, "history": (1, 2)}},
        "epoch": {"kind": "value", "value": 4},
    }
    fresh = Counter()
    state: dict[str, Any] = {"counter": fresh, "epoch": 0}
    apply_train_state(state, {**decoded["entries"], "gone": {"kind": "value", "value": 1}})
    assert fresh.n == 7 and state == {"counter": fresh, "epoch": 4}


def test_an_optimizer_without_its_module_gives_a_clear_error() -> None:
    model = nn.Linear(3, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    other = nn.Linear(3, 2)
    for state in ({"optim": optim}, {"model": other, "optim": optim}):
        with pytest.raises(UnsupportedStateError) as info:
            capture(state, rng=False)
        message = str(info.value)
        assert "state['optim'] is an optimizer" in message
        assert "no nn.Module in the same state holds all of its parameters" in message
        assert "{'model': model, 'optim': optim}" in message
        with pytest.raises(UnsupportedStateError, match="state\\['optim'\\] is an optimizer"):
            load_targets(state)


def test_an_optimizer_over_two_modules_needs_the_one_that_holds_all_parameters() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    both = nn.Sequential(a, b)
    optim = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    with pytest.raises(UnsupportedStateError):
        capture({"a": a, "b": b, "optim": optim}, rng=False)
    assert "optim" in capture({"a": a, "model": both, "optim": optim}, rng=False).dcp


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
    blob = encode_train_state({}, capture_rng())
    expected = draws()
    rng = decode_train_state(blob, source="t")["rng"]
    assert set(rng) >= {"python", "numpy", "torch"}
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert draws() != expected
    restore_rng(rng)
    assert draws() == expected
    restore_rng(rng)
    assert draws() == expected


def test_restore_rng_ignores_what_it_was_not_given() -> None:
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    restore_rng({"cuda": [torch.zeros(8, dtype=torch.uint8)] * 99})  # wrong device count: ignored
    assert torch.equal(torch.rand(3), expected)


# --- damaged files --------------------------------------------------------------------------------


def _blob_with_document(document: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    return save({"t0": torch.ones(1)}, metadata={"safeckpt.train_state": json.dumps(document)})


DAMAGED = [
    pytest.param(b"", id="empty"),
    pytest.param(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json", id="garbage"),
    pytest.param(
        encode_train_state({"x": {"kind": "value", "value": torch.ones(100)}}, None)[:-7], id="truncated"
    ),
    pytest.param(_blob_with_document({"format": 1}), id="no-entries"),
    pytest.param(_blob_with_document({"entries": {"x": {"__tensor__": "t9"}}}), id="missing-tensor"),
    pytest.param(_blob_with_document({"entries": {"x": {"__tuple__": 5}}}), id="bad-tuple"),
    pytest.param(_blob_with_document({"entries": {"x": {"__bytes__": "!!"}}}), id="bad-base64"),
]


@pytest.mark.parametrize("blob", DAMAGED)
def test_a_damaged_train_state_file_is_an_incomplete_checkpoint(blob: bytes) -> None:
    with pytest.raises(IncompleteCheckpointError) as info:
        decode_train_state(blob, source="/ckpt/step_1/train_state.rank0.safetensors")
    assert "/ckpt/step_1/train_state.rank0.safetensors is not a readable train-state file" in str(info.value)
    assert info.value.path == "/ckpt/step_1/train_state.rank0.safetensors"
