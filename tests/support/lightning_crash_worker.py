"""Lightning runs that test_lightning.py kills with SIGKILL.

    python lightning_crash_worker.py DIR
    python lightning_crash_worker.py managed ROOT OUT_JSON KILL_EPOCH

The first: a Trainer that saves last.ckpt every epoch through SafeCheckpointIO, until it is
killed. It prints ``SAVE <global_step>`` (flushed) as each checkpoint is built, before its
write; the test SIGKILLs it while a later last.ckpt is being written. A 64 MiB buffer makes
each write long enough to be caught in the middle.

The second: a ManagedCheckpoint run on a shuffled DataLoader with dropout (so every RNG draw
shows in the weights), 6 epochs of 4 batches, that resumes from ROOT. It validates every
second epoch and saves every epoch, so step 4 is saved at training-epoch end and step 16 at
validation end. At the second batch of epoch KILL_EPOCH (-1: never), once every save so far
is committed, it SIGKILLs itself (leaving step 4 as the newest in epoch 1, step 16 in epoch
4); otherwise it writes OUT_JSON: the step it resumed from and a hash of the final weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, TensorDataset

from safeckpt.lightning import ManagedCheckpoint, SafeCheckpointIO

warnings.filterwarnings("ignore")
QUIET: dict[str, Any] = {
    "accelerator": "cpu",
    "enable_progress_bar": False,
    "logger": False,
    "enable_model_summary": False,
}


class Heavy(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ballast", torch.randn(16 << 20))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        print(f"SAVE {self.global_step}", flush=True)


def last_ckpt(directory: str) -> None:
    trainer = Trainer(
        default_root_dir=directory,
        plugins=[SafeCheckpointIO(queue_depth=1)],
        callbacks=[ModelCheckpoint(dirpath=directory, save_last=True, every_n_epochs=1)],
        max_epochs=1000,
        limit_train_batches=1,
        limit_val_batches=0,
        **QUIET,
    )
    trainer.fit(Heavy())


class Shuffled(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        data = torch.Generator().manual_seed(1)  # the same samples in every run, whatever the RNG
        self.data = TensorDataset(torch.randn(16, 4, generator=data), torch.randn(16, 1, generator=data))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4, shuffle=True)


class KillIn(Callback):
    """SIGKILLs the process at the second batch of ``epoch``, once every save so far is committed."""

    def __init__(self, epoch: int, checkpoint: ManagedCheckpoint) -> None:
        self.epoch = epoch
        self.checkpoint = checkpoint

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.current_epoch == self.epoch and args[-1] == 1:
            assert self.checkpoint.manager is not None
            self.checkpoint.manager.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def managed(root: str, out: str, kill_epoch: int) -> None:
    seed_everything(0)
    checkpoint = ManagedCheckpoint(root)
    trainer = Trainer(
        max_epochs=6,
        check_val_every_n_epoch=2,
        callbacks=[checkpoint, KillIn(kill_epoch, checkpoint)],
        **QUIET,
    )
    model = Shuffled()
    trainer.fit(model)
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode() + tensor.numpy().tobytes())
    with open(out, "w") as f:
        json.dump({"restored_step": checkpoint.restored_step, "weights": digest.hexdigest()}, f)


if __name__ == "__main__":
    if sys.argv[1] == "managed":
        managed(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        last_ckpt(sys.argv[1])
