"""The cached model/optimizer state dicts give what DCP's helpers give, and fall back when they must."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from safeckpt._state.state_dicts import StateDicts, _model_renames


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as in most language models
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


def trained(model: nn.Module) -> torch.optim.Optimizer:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([1, 2, 3])).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return optim


def same(a: Any, b: Any) -> bool:
    """Same keys in the same order, the same tensor objects' memory, equal other values."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.stride() == b.stride()
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_a_plain_model_and_optimizer_are_renamed_from_the_cache_and_match_the_helpers() -> None:
    model = Tied()
    optim = trained(model)
    dicts = StateDicts()
    for _ in range(3):
        assert same(dicts.model(model), get_model_state_dict(model))
        assert same(dicts.optimizer(model, optim), get_optimizer_state_dict(model, optim))
    assert dicts.misses == 2 and dicts.hits == 4
    assert "head.weight" in dicts.model(model) and "scratch" not in dicts.model(model)


def test_a_compiled_model_keys_lose_the_wrapper_prefix_as_the_helper_drops_it() -> None:
    inner = Tied()
    model = torch.compile(inner)  # an OptimizedModule: its state_dict keys start with _orig_mod.
    assert all(k.startswith("_orig_mod.") for k in model.state_dict())
    optim = trained(inner)
    dicts = StateDicts()
    first, second = dicts.model(model), dicts.model(model)
    assert dicts.hits == 1
    assert same(second, get_model_state_dict(model)) and same(first, second)
    assert list(second) == list(inner.state_dict())
    assert same(dicts.optimizer(model, optim), get_optimizer_state_dict(model, optim))
    assert same(dicts.optimizer(model, optim), get_optimizer_state_dict(model, optim))
    assert dicts.hits == 2


def test_a_changed_structure_goes_back_to_the_helpers() -> None:
    model = Tied()
    optim = trained(model)
    dicts = StateDicts()
    dicts.model(model), dicts.optimizer(model, optim)
    model.extra = nn.Linear(2, 2)  # new keys
    optim.add_param_group({"params": list(model.extra.parameters()), "lr": 0.5})
    got_model, got_optim = dicts.model(model), dicts.optimizer(model, optim)
    assert dicts.hits == 0 and dicts.misses == 4
    assert "extra.weight" in got_model and same(got_model, get_model_state_dict(model))
    assert same(got_optim, get_optimizer_state_dict(model, optim))
    assert "extra.weight" in got_optim["param_groups"][1]["params"]


def test_a_replaced_parameter_is_seen() -> None:
    model = Tied()
    optim = trained(model)
    dicts = StateDicts()
    dicts.model(model), dicts.optimizer(model, optim)
    old = model.body[0].weight
    model.body[0].weight = nn.Parameter(torch.ones(4, 4))  # same key, new tensor
    assert dicts.model(model)["body.0.weight"].data_ptr() == model.body[0].weight.data_ptr()
    assert optim.param_groups[0]["params"][1] is old
    optim.param_groups[0]["params"][1] = model.body[0].weight  # the optimizer follows it
    optim.state[model.body[0].weight] = optim.state.pop(old)
    got = dicts.optimizer(model, optim)
    assert dicts.misses == 3  # new parameter ids: asked the helper again
    assert same(got, get_optimizer_state_dict(model, optim))
    assert got["state"]["body.0.weight"]["exp_avg"].shape == (4, 4)


def test_an_optimizer_without_state_is_left_to_the_helper_which_initialises_it() -> None:
    model = Tied()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dicts = StateDicts()
    got = dicts.optimizer(model, optim)
    assert got["state"] and dicts.misses == 1  # the helper's zero step made the moments
    assert same(dicts.optimizer(model, optim), get_optimizer_state_dict(model, optim))
    assert dicts.hits == 1


def test_a_result_that_is_not_a_renaming_is_not_cached() -> None:
    raw = {"a": torch.zeros(2), "b": torch.zeros(2)}
    assert _model_renames(raw, {"a": raw["a"], "b": raw["b"]}) is not None
    assert _model_renames(raw, {"a": raw["a"], "b": raw["b"].clone()}) is None  # other memory
    assert _model_renames(raw, {"b": raw["b"], "a": raw["a"]}) is None  # another order
    assert _model_renames(raw, {"a": raw["a"]}) is None

    class Copying(nn.Module):  # the helper's answer is a copy: never taken from the cache
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))
            self._register_state_dict_hook(
                lambda module, sd, prefix, meta: {k: v.clone() for k, v in sd.items()}
            )

    model = Copying()
    dicts = StateDicts()
    dicts.model(model), dicts.model(model)
    assert dicts.hits == 0 and dicts.misses == 2


def test_a_model_with_fsdp1_modules_goes_to_the_helper_without_a_state_dict_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FSDP1's state_dict() outside the helper's context gathers the whole model: never called here."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    import safeckpt._state.state_dicts as state_dicts

    model = Tied()
    wrapper = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(wrapper)  # an FSDP1 module as far as isinstance can tell
    model._modules["wrapped"] = wrapper
    own_calls: list[int] = []
    real = Tied.state_dict
    monkeypatch.setattr(
        Tied, "state_dict", lambda self, *a, **k: (own_calls.append(1), real(self, *a, **k))[1]
    )
    monkeypatch.setattr(state_dicts, "get_model_state_dict", lambda m: {"from": "the helper"})
    dicts = StateDicts()
    assert dicts.model(model) == {"from": "the helper"} and dicts.model(model) == {"from": "the helper"}
    assert own_calls == [] and dicts.hits == 0
