"""SafeCheckpointIO and ManagedCheckpoint on ``s3://`` paths, against a real S3 server (moto)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from safeckpt.lightning import SafeCheckpointIO, StorageOptionsError

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("async_save", [False, True])
def test_save_load_and_remove_on_a_url(s3_bucket, async_save: bool) -> None:  # type: ignore[no-untyped-def]
    io = SafeCheckpointIO(async_save=async_save)
    path = s3_bucket.url("ckpts/epoch=0.ckpt")
    checkpoint = {"state_dict": {"w": torch.arange(6.0)}, "epoch": 0}
    io.save_checkpoint(checkpoint, path)
    loaded = io.load_checkpoint(path)  # waits for its own save of the path
    assert torch.equal(loaded["state_dict"]["w"], checkpoint["state_dict"]["w"]) and loaded["epoch"] == 0
    io.remove_checkpoint(path)
    io.teardown()
    assert not [k for k in s3_bucket.keys() if k.endswith(".ckpt")]  # noqa: SIM118 - S3Bucket.keys lists the bucket


def test_a_removal_cancels_a_queued_save_of_a_url(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    io = SafeCheckpointIO(async_save=True, queue_depth=3)
    paths = [s3_bucket.url(f"c/{i}.ckpt") for i in range(3)]
    for i, path in enumerate(paths):
        io.save_checkpoint({"w": torch.full((1 << 16,), float(i))}, path)
    io.remove_checkpoint(paths[2])
    io.teardown()
    names = sorted(k.rsplit("/", 1)[1] for k in s3_bucket.keys() if k.endswith(".ckpt"))  # noqa: SIM118
    assert "2.ckpt" not in names and "0.ckpt" in names


def test_storage_options_reach_the_store_of_a_url(s3_bucket, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # wrong: the options win
    io = SafeCheckpointIO(async_save=False)
    path = s3_bucket.url("opts/x.ckpt")
    io.save_checkpoint({"a": 1}, path, storage_options=s3_bucket.storage_options)
    assert io.load_checkpoint(path) == {"a": 1}
    with pytest.raises(StorageOptionsError, match="nonsense"):
        io.save_checkpoint({"a": 1}, path, storage_options={"nonsense": 1})
    io.teardown()


def test_a_trainer_checkpoints_to_s3_through_the_plugin(s3_bucket, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("s3fs")  # Lightning's ModelCheckpoint looks at a remote dirpath through fsspec
    dirpath = s3_bucket.url("trainer")
    callback = ModelCheckpoint(
        dirpath=dirpath, save_top_k=2, monitor="step", mode="max", every_n_train_steps=2
    )
    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer = Trainer(
        max_steps=8, callbacks=[callback], plugins=[SafeCheckpointIO()], default_root_dir=tmp_path, **quiet
    )
    trainer.fit(BoringModel())
    names = sorted(k.rsplit("/", 1)[1] for k in s3_bucket.keys() if k.endswith(".ckpt"))  # noqa: SIM118
    assert len(names) == 2, names  # top-2 kept, the rest removed through the plugin
    resumed = Trainer(max_steps=10, plugins=[SafeCheckpointIO()], default_root_dir=tmp_path, **quiet)
    resumed.fit(BoringModel(), ckpt_path=callback.best_model_path)
    assert resumed.global_step == 10
