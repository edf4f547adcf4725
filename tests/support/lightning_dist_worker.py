"""One rank of a ManagedCheckpoint run under Lightning's DDP on CPU (gloo), or FSDP on CUDA.

    WORLD_SIZE=2 RANK=r LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=p \
        python lightning_dist_worker.py ROOT STRATEGY MAX_EPOCHS OUT_JSON

Lightning sees LOCAL_RANK and takes the processes as launched externally (like torchrun).
Writes OUT_JSON (rank 0): the step it resumed from, the final global_step, the saved steps
and a checksum of the full model weights.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import RandomDataset
from torch.utils.data import DataLoader

from safeckpt import Retention
from safeckpt.lightning import ManagedCheckpoint

warnings.filterwarnings("ignore")


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).sum()
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 64), batch_size=4)


def strategy(name: str):
    if name == "fsdp":  # needs CUDA: Lightning refuses FSDPStrategy on CPU, and so does torch's FSDP
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy()
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo")
    return "auto"


def main() -> None:
    root, name, max_epochs, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    callback = ManagedCheckpoint(root, retention=Retention(keep_last=2), timeout=120.0)
    trainer = Trainer(
        accelerator="cuda" if name == "fsdp" else "cpu",
        devices=world,
        strategy=strategy(name),
        max_epochs=max_epochs,
        limit_train_batches=2,
        callbacks=[callback],
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
    )
    model = Net()
    trainer.fit(model)
    with torch.no_grad():
        weights = {
            k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()
        }
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "restored_step": callback.restored_step,
                    "global_step": trainer.global_step,
                    "saved_steps": callback.saved_steps,
                    "weights_sum": float(sum(v.double().sum() for v in weights.values())),
                },
                f,
            )
    if torch.distributed.is_initialized():
        # torch asks every script to do this and Lightning leaves it to the script: a gloo
        # group left to interpreter exit can abort the process after a run that succeeded
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
