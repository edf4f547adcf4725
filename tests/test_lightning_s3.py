"""SafeCheckpointIO and ManagedCheckpoint on ``s3://`` paths, against a real S3 server (moto)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from safeckpt._util import torch_private
from safeckpt.errors import RootNotWritableError
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


# --- issue 52: the Trainer's start ------------------------------------------------------------------

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


class _StartStep(Callback):
    """The global step training started at (a resume starts past 0)."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.step = trainer.global_step


def test_a_missing_bucket_is_refused_as_the_trainer_starts(s3_bucket, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("s3fs")
    missing = f"{s3_bucket.name}-missing"
    callback = ModelCheckpoint(dirpath=f"s3://{missing}/run", every_n_train_steps=1)
    started = _StartStep()
    trainer = Trainer(
        max_steps=4,
        callbacks=[callback, started],
        plugins=[SafeCheckpointIO()],
        default_root_dir=tmp_path,
        **QUIET,
    )
    with pytest.raises(RootNotWritableError, match=f"the bucket '{missing}' does not exist.*create it"):
        trainer.fit(BoringModel())
    assert started.step is None and trainer.global_step == 0  # before the first step, not after it
    # Without a ModelCheckpoint: the first save says the same, not the raw S3 error of the writer.
    io = SafeCheckpointIO()
    with pytest.raises(RootNotWritableError, match=f"the bucket '{missing}' does not exist"):
        io.save_checkpoint({"a": 1}, f"s3://{missing}/run/x.ckpt")
    io.teardown()


def test_fit_ckpt_path_last_resumes_from_a_url_dirpath(s3_bucket, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Lightning lists a URL dirpath's last.ckpt without its scheme and looks for it on the local
    # disk (its bug #18261): "last" found nothing, the run started over and wrote last-v1.ckpt.
    pytest.importorskip("s3fs")
    if not torch_private.ENABLED:
        pytest.skip("the fix wraps Lightning's private ModelCheckpoint._find_last_checkpoints: switched off")
    dirpath = s3_bucket.url("run")

    def trainer(max_steps: int, started: _StartStep) -> Trainer:
        callback = ModelCheckpoint(dirpath=dirpath, save_last=True, every_n_train_steps=2)
        return Trainer(
            max_steps=max_steps,
            callbacks=[callback, started],
            plugins=[SafeCheckpointIO()],
            default_root_dir=tmp_path,
            **QUIET,
        )

    trainer(4, _StartStep()).fit(BoringModel())
    started = _StartStep()
    resumed = trainer(6, started)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no last checkpoint available")
        resumed.fit(BoringModel(), ckpt_path="last")
    assert started.step == 4 and resumed.global_step == 6
    names = sorted(k.rsplit("/", 1)[1] for k in s3_bucket.keys() if k.endswith(".ckpt"))  # noqa: SIM118
    assert "last.ckpt" in names and not [n for n in names if "-v" in n], names
