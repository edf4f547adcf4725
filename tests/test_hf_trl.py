"""TRL's SFTTrainer (a Trainer subclass with its own data pipeline and saves) through safeckpt.hf.attach:
its saves go to the manager, and a run stopped and started again ends with the weights of a run that
never stopped. A tiny GPT-2 and a word-level tokenizer built in memory: nothing is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hf_toy

pytest.importorskip("trl")

from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TrainerCallback
from trl import SFTConfig, SFTTrainer

import safeckpt.hf

WORDS = hf_toy.VOCAB - 3


def tokenizer() -> Any:
    vocab = {w: i for i, w in enumerate(["[PAD]", "[EOS]", "[UNK]", *(f"w{i}" for i in range(WORDS))])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"pad_token": "[PAD]", "eos_token": "[EOS]", "unk_token": "[UNK]"}
    return PreTrainedTokenizerFast(tokenizer_object=words, **special)


def texts(n: int = 32) -> Dataset:
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, WORDS, (n, hf_toy.SEQ - 2), generator=generator)
    return Dataset.from_dict({"text": [" ".join(f"w{int(i)}" for i in row) for row in rows]})


class StopAt(TrainerCallback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.at:
            control.should_training_stop = True
        return control


def sft(output_dir: Path) -> Any:
    torch.set_num_threads(1)
    args = SFTConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        max_steps=6,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        max_length=hf_toy.SEQ,
        packing=False,
    )
    return SFTTrainer(model=hf_toy.model(), args=args, train_dataset=texts(), processing_class=tokenizer())


def test_sft_trainer_saves_through_the_manager_and_resumes_exactly(tmp_path: Path) -> None:
    reference = sft(tmp_path / "reference")
    reference.train()
    expected = hf_toy.weights(reference)

    root = tmp_path / "root"
    first = sft(tmp_path / "first")
    first.add_callback(StopAt(4))
    safeckpt.hf.attach(first, root)
    first.train()
    safeckpt.hf.manager_of(first).close()
    assert sorted(p.name for p in root.glob("step_*")) == ["step_2", "step_4"]
    assert not list((tmp_path / "first").glob("checkpoint-*"))  # nothing went the Trainer's own way

    second = sft(tmp_path / "second")
    safeckpt.hf.attach(second, root)
    second.train()  # resumes from step 4 by itself
    safeckpt.hf.manager_of(second).close()
    assert second.state.global_step == 6
    assert hf_toy.same(expected, hf_toy.weights(second))
    assert "step_6" in {p.name for p in root.glob("step_*")}
