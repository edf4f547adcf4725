"""Frozen weights stored once (issue 56) with a real PEFT LoRA model, on a local root and on S3 (moto):
the base goes into the first checkpoint only, the adapters and their AdamW state into every one;
an adapter merged into its base in place (``merge_adapter``) is written, never shared; every
checkpoint restores alone into a fresh model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from safeckpt import CheckpointManager, Retention
from safeckpt._ops.maintenance import verify
from safeckpt.cli.ls import listing

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.timeout(300)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(256, 256), nn.Linear(256, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def build(seed: int) -> tuple[Any, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, target_modules=["fc1", "fc2"], init_lora_weights=False)
    model = peft.get_peft_model(Mlp(), config)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, optim, {"model": model, "optim": optim}


def base_bytes(model: Any) -> int:
    return sum(p.nbytes for p in model.parameters() if not p.requires_grad)


@pytest.fixture(params=["posix", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "posix":
        return str(tmp_path / "run")
    return str(request.getfixturevalue("s3_bucket").url("peft"))


def test_a_peft_run_stores_its_base_once_and_a_merged_adapter_is_written(root: str) -> None:
    model, optim, state = build(0)
    frozen = base_bytes(model)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with CheckpointManager(root, async_save=True, retention=Retention(keep_last=10)) as mgr:
        for step in (1, 2, 3):
            model(torch.randn(8, 256)).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
            mgr.save(step, state)
            saved[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        mgr.wait()
        model.merge_adapter()  # the adapters folded into the base weights, in place
        merged = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert not torch.equal(
            merged["base_model.model.fc1.base_layer.weight"],
            saved[3]["base_model.model.fc1.base_layer.weight"],
        )
        mgr.save(4, state)
        saved[4] = merged
    by_step = {c["step"]: c for c in listing(root)["checkpoints"]}
    assert by_step[1]["shared_bytes"] == 0 and by_step[1]["own_bytes"] > frozen
    for step in (2, 3):  # the base shared, only the adapters and AdamW's state written
        assert by_step[step]["shared_bytes"] >= frozen and by_step[step]["own_bytes"] < frozen / 2, by_step
    assert by_step[4]["shared_bytes"] == 0 and by_step[4]["own_bytes"] > frozen  # the merged base
    assert all(problems == [] for problems in verify(root).values())
    for step, expected in saved.items():
        fresh, _, fresh_state = build(seed=100 + step)
        with CheckpointManager(root, read_only=True) as mgr:
            assert mgr.restore(fresh_state, step=step).step == step
        got = fresh.state_dict()
        assert all(torch.equal(got[k], v) for k, v in expected.items()), step
