"""A tiny GPT-2 Trainer run for the safeckpt.hf tests: built from a config (no download), random
tokens, dropout on (so the RNG states matter), one CPU thread (so a run's bits do not depend on
how many threads the machine gives it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 64
SEQ = 16


class Tokens(torch.utils.data.Dataset):
    """Random token rows, the same for a seed; counts the rows read (the resume must skip, not read)."""

    def __init__(self, n: int = 48, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
        self.reads = 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.reads += 1
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def model(seed: int = 0) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.1, embd_pdrop=0.1
    )
    return GPT2LMHeadModel(config)


def trainer(
    output_dir: Path | str, *, trainer_class: Any = None, train_rows: int = 48, **overrides: Any
) -> Any:
    """A Trainer over :class:`Tokens` (batch 4: 12 steps an epoch), saving every 2 steps."""
    from transformers import Trainer, TrainingArguments

    torch.set_num_threads(1)
    options: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 8,
        "max_steps": 8,
        "save_strategy": "steps",
        "save_steps": 2,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    options.update(overrides)
    args = TrainingArguments(**options)
    eval_dataset = Tokens(16) if options.get("eval_strategy", "no") != "no" else None
    cls = trainer_class or Trainer
    return cls(model=model(), args=args, train_dataset=Tokens(train_rows), eval_dataset=eval_dataset)


def weights(trainer: Any) -> dict[str, torch.Tensor]:
    """The model's weights, whole (an FSDP shard is gathered: call it on every rank)."""
    out = {}
    for name, value in trainer.model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
