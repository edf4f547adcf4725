"""A Trainer that saves last.ckpt every epoch through SafeCheckpointIO, until it is killed.

    python lightning_crash_worker.py DIR

Prints ``SAVE <global_step>`` (flushed) as each checkpoint is built, before its write;
test_lightning.py SIGKILLs it while a later last.ckpt is being written. A 64 MiB buffer
makes each write long enough to be caught in the middle.
"""

from __future__ import annotations

import sys
import warnings

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from safeckpt.lightning import SafeCheckpointIO

warnings.filterwarnings("ignore")


class Heavy(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ballast", torch.randn(16 << 20))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        print(f"SAVE {self.global_step}", flush=True)


def main() -> None:
    directory = sys.argv[1]
    trainer = Trainer(
        default_root_dir=directory,
        plugins=[SafeCheckpointIO(queue_depth=1)],
        callbacks=[ModelCheckpoint(dirpath=directory, save_last=True, every_n_epochs=1)],
        max_epochs=1000,
        limit_train_batches=1,
        limit_val_batches=0,
        accelerator="cpu",
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
    )
    trainer.fit(Heavy())


if __name__ == "__main__":
    main()
