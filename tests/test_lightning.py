"""safeckpt.lightning with a real Trainer on CPU: SafeCheckpointIO and ManagedCheckpoint.

The reference issue (``issue-async-topk-race.txt``): ``ModelCheckpoint(save_top_k=2)`` on
an improving metric with writes that lag behind training. Lightning's ``AsyncCheckpointIO``
leaves files that ``ModelCheckpoint`` believes it deleted; ``SafeCheckpointIO`` leaves
exactly ``best_k_models``. Slow writes come through seams (a ``FileOps`` whose ``replace``
waits, a ``TorchCheckpointIO`` that sleeps before writing), never by patching the code
under test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock, Mock

import pytest
import torch

pytest.importorskip("lightning")

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO
from lightning.pytorch.strategies import SingleDeviceStrategy

from safeckpt import (
    ConfigError,
    JsonlIndexRegistrar,
    KeepAny,
    KeepEvery,
    KeepLast,
    Retention,
    SaveFailedError,
    UnsupportedStateError,
    read_record,
)
from safeckpt._fs.fileops import FileOps
from safeckpt.lightning import ManagedCheckpoint, SafeCheckpointIO, StorageOptionsError
from safeckpt.testing import FileHolder, Linger

HERE = Path(__file__).resolve().parent / "support"  # the workers it starts
QUIET = {"enable_progress_bar": False, "logger": False, "enable_model_summary": False, "accelerator": "cpu"}

warnings.filterwarnings("ignore", module="lightning")
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
)


# --- seams and helpers ----------------------------------------------------------------------


class SlowOps(FileOps):
    """Every ``.ckpt`` file takes ``delay`` s longer to land: a disk slower than training."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def replace(self, src: Path, dst: Path) -> None:
        if str(dst).endswith(".ckpt"):
            time.sleep(self.delay)
        super().replace(src, dst)


class GateOps(FileOps):
    """``replace`` of a ``.ckpt`` file waits for ``gate``; ``entered`` says a write reached it."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()

    def replace(self, src: Path, dst: Path) -> None:
        if str(dst).endswith(".ckpt"):
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        super().replace(src, dst)


class FailOnceOps(FileOps):
    def __init__(self) -> None:
        self.failed = False

    def replace(self, src: Path, dst: Path) -> None:
        if not self.failed and str(dst).endswith(".ckpt"):
            self.failed = True
            raise OSError(5, "Input/output error (injected)", str(dst))
        super().replace(src, dst)


class SlowTorchIO(TorchCheckpointIO):
    """Lightning's own plugin behind a disk that takes ``delay`` s per file (for AsyncCheckpointIO)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        time.sleep(self.delay)
        super().save_checkpoint(checkpoint, path, storage_options)


class Ballast(BoringModel):
    """BoringModel with ``mib`` MiB of extra weights, so a write takes a while."""

    def __init__(self, mib: int = 0) -> None:
        super().__init__()
        if mib:
            self.register_buffer("ballast", torch.randn(mib << 18))


def ckpt_names(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("*.ckpt")}


def leftovers(directory: Path) -> list[str]:
    """Temp files of interrupted writes and undeleted trash."""
    temps = [p.name for p in directory.glob(".*.tmp.*")]
    trash = directory / ".trash"
    return temps + ([p.name for p in trash.iterdir()] if trash.exists() else [])


def topk_run(directory: Path, plugin: Any, *, epochs: int = 25, mib: int = 8) -> ModelCheckpoint:
    """The reference scenario: top-k 2 on an improving metric, one batch per epoch."""
    ck = ModelCheckpoint(dirpath=directory, save_top_k=2, monitor="step", mode="max")
    trainer = Trainer(
        default_root_dir=directory,
        plugins=[plugin],
        callbacks=[ck],
        max_epochs=epochs,
        limit_train_batches=1,
        limit_val_batches=0,
        **QUIET,
    )
    trainer.fit(Ballast(mib))
    return ck


def assert_exactly_best_k(directory: Path, ck: ModelCheckpoint) -> None:
    best = {Path(p).name for p in ck.best_k_models}
    assert len(best) == 2
    assert ckpt_names(directory) == best, "files on disk differ from what ModelCheckpoint kept"
    for name in best:
        loaded = torch.load(directory / name, weights_only=True)
        assert loaded["global_step"] == int(name.split("step=")[1].split(".")[0])
    assert leftovers(directory) == []


# --- SafeCheckpointIO: the state machine, directly -----------------------------------------------


def test_the_core_package_does_not_import_lightning() -> None:
    code = "import sys, safeckpt, safeckpt.cli; assert 'lightning' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_storage_options_and_remote_paths_are_clear_errors(tmp_path: Path) -> None:
    io = SafeCheckpointIO()
    with pytest.raises(StorageOptionsError, match="storage_options"):
        io.save_checkpoint({"a": 1}, tmp_path / "x.ckpt", storage_options={"compress": True})
    with pytest.raises(TypeError):  # what Lightning's own TorchCheckpointIO raises, too
        io.save_checkpoint({"a": 1}, tmp_path / "x.ckpt", storage_options=object())
    with pytest.raises(ConfigError, match="no storage for http://"):  # a scheme no store serves
        io.save_checkpoint({"a": 1}, "http://host/x.ckpt")
    with pytest.raises(ConfigError, match="queue_depth"):
        SafeCheckpointIO(queue_depth=0)
    io.save_checkpoint({"a": 1}, tmp_path / "x.ckpt", storage_options={})
    io.teardown()
    assert torch.load(tmp_path / "x.ckpt", weights_only=True) == {"a": 1}


def test_remove_cancels_queued_and_waits_for_writing(tmp_path: Path) -> None:
    ops = GateOps()
    io = SafeCheckpointIO(queue_depth=3, file_ops=ops)
    a, b, c = (tmp_path / f"{n}.ckpt" for n in "abc")
    io.save_checkpoint({"w": torch.ones(4)}, a)
    assert ops.entered.wait(30)  # a is being written (held before its rename)
    io.save_checkpoint({"w": torch.ones(4) * 2}, b)  # queued behind a
    io.save_checkpoint({"w": torch.ones(4) * 3}, c)  # queued behind b
    io.remove_checkpoint(b)  # queued: cancelled, never written
    io.remove_checkpoint(a)  # writing: removed right after its write ends
    assert io.cancelled == 1 and io.removed_after_write == 1
    assert not a.exists() and not b.exists()
    ops.gate.set()
    io.wait()
    assert ckpt_names(tmp_path) == {"c.ckpt"}
    assert torch.equal(io.load_checkpoint(c)["w"], torch.ones(4) * 3)
    io.teardown()
    assert ckpt_names(tmp_path) == {"c.ckpt"} and leftovers(tmp_path) == []


def test_remove_of_committed_goes_through_trash_and_deleter(tmp_path: Path) -> None:
    io = SafeCheckpointIO()
    old = tmp_path / "old.ckpt"
    torch.save({"x": 1}, old)  # a file from an earlier run: committed as far as we know
    io.remove_checkpoint(old)
    assert not old.exists()
    io.save_checkpoint({"x": torch.zeros(3)}, tmp_path / "new.ckpt")
    io.wait()
    io.remove_checkpoint(tmp_path / "new.ckpt")
    io.remove_checkpoint(tmp_path / "never-saved.ckpt")  # nothing there: nothing to do
    assert ckpt_names(tmp_path) == set()
    io.teardown()  # drains the trash
    assert leftovers(tmp_path) == []


@pytest.mark.fuse
def test_removal_on_nfs_while_a_reader_holds_the_file(nfs_mount: Any) -> None:
    """On NFS a file removed while open elsewhere lingers as .nfsXXXX: out of the way, then drained."""
    nfs = nfs_mount(linger=Linger.constant(0.3))
    directory = nfs.path / "ckpts"
    io = SafeCheckpointIO(retry_interval=0.05)
    io.save_checkpoint({"x": torch.ones(3)}, directory / "a.ckpt")
    io.wait()
    with FileHolder() as holder:
        hold = holder.hold([str(directory / "a.ckpt")])
        io.remove_checkpoint(directory / "a.ckpt")  # returns at once: a rename into the trash
        assert ckpt_names(directory) == set()
        assert list((directory / ".trash").iterdir())  # in the trash (or its .nfs file is), not in the way
        hold.release()
    io.teardown()  # the drain waits out the .nfs file
    assert leftovers(directory) == [] and not list(directory.glob(".nfs*"))


class NoTrashOps(FileOps):
    """Renames into the trash fail (a read-only directory, say)."""

    def replace(self, src: Path, dst: Path) -> None:
        if dst.parent.name == ".trash":
            raise PermissionError(13, "Permission denied (injected)", str(dst))
        super().replace(src, dst)


def test_a_failed_removal_never_fails_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    io = SafeCheckpointIO(file_ops=NoTrashOps())
    io.save_checkpoint({"x": 1}, tmp_path / "a.ckpt")
    io.wait()
    io.remove_checkpoint(tmp_path / "a.ckpt")  # does not raise
    io.teardown()
    assert ckpt_names(tmp_path) == {"a.ckpt"}
    assert any("could not remove" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


def test_a_new_save_supersedes_a_queued_save_of_the_same_path(tmp_path: Path) -> None:
    ops = GateOps()
    io = SafeCheckpointIO(queue_depth=3, file_ops=ops)
    io.save_checkpoint({"v": 0}, tmp_path / "first.ckpt")
    assert ops.entered.wait(30)
    io.save_checkpoint({"v": 1}, tmp_path / "last.ckpt")
    io.save_checkpoint({"v": 2}, tmp_path / "last.ckpt")
    assert io.cancelled == 1
    ops.gate.set()
    assert io.load_checkpoint(tmp_path / "last.ckpt") == {"v": 2}  # waits for the pending save
    io.teardown()


def test_staging_keeps_lightning_containers_and_reuses_buffers(tmp_path: Path) -> None:
    model = torch.nn.BatchNorm1d(3)
    state = model.state_dict()
    io = SafeCheckpointIO()
    io.save_checkpoint({"state_dict": state, "t": (1, torch.ones(2))}, tmp_path / "a.ckpt")
    io.save_checkpoint({"state_dict": state, "t": (1, torch.ones(2))}, tmp_path / "b.ckpt")
    io.teardown()
    loaded = torch.load(tmp_path / "b.ckpt", weights_only=True)
    assert type(loaded["state_dict"]).__name__ == "OrderedDict"
    assert loaded["state_dict"]._metadata == state._metadata  # module versions survive staging
    assert loaded["t"][0] == 1 and torch.equal(loaded["t"][1], torch.ones(2))
    model.load_state_dict(loaded["state_dict"])


def test_background_error_surfaces_once_at_next_call_and_teardown(tmp_path: Path) -> None:
    io = SafeCheckpointIO(file_ops=FailOnceOps())
    io.save_checkpoint({"x": 1}, tmp_path / "a.ckpt")
    assert io._writer is not None
    io._writer.wait_idle()  # let the write fail, without raising it yet
    with pytest.raises(SaveFailedError, match=r"a\.ckpt") as info:
        io.save_checkpoint({"x": 2}, tmp_path / "b.ckpt")
    assert isinstance(info.value.__cause__, OSError)
    io.wait()  # cleared: raised once
    assert ckpt_names(tmp_path) == set()  # b was not submitted: the call raised before saving
    io.save_checkpoint({"x": 3}, tmp_path / "c.ckpt")
    io.teardown()
    assert ckpt_names(tmp_path) == {"c.ckpt"}

    io = SafeCheckpointIO(file_ops=FailOnceOps())
    io.save_checkpoint({"x": 1}, tmp_path / "d.ckpt")
    with pytest.raises(SaveFailedError):
        io.teardown()
    io.teardown()  # idempotent: the error was raised once, and nothing is left to wait for


def test_only_rank_zero_writes_and_removes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.save({"x": 1}, tmp_path / "keep.ckpt")
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    io = SafeCheckpointIO()
    io.save_checkpoint({"x": 2}, tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "keep.ckpt")
    io.teardown()
    assert ckpt_names(tmp_path) == {"keep.ckpt"}
    assert io.load_checkpoint(tmp_path / "keep.ckpt") == {"x": 1}  # every rank loads


# --- Lightning's own plugin tests (tests_pytorch/plugins/test_checkpoint_io_plugin.py), ported ---------


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_checkpoint_plugin_called(tmp_path: Path, async_save: bool) -> None:
    plugin = MagicMock(wraps=SafeCheckpointIO(async_save=async_save), spec=SafeCheckpointIO)
    ck = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = Trainer(
        default_root_dir=tmp_path,
        strategy=SingleDeviceStrategy("cpu", checkpoint_io=plugin),
        callbacks=ck,
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=0,
        limit_test_batches=1,
        **QUIET,
    )
    trainer.fit(BoringModel())
    assert ckpt_names(tmp_path) == {"epoch=1-step=2.ckpt", "last.ckpt"}
    assert ck.best_model_path == str(tmp_path / "epoch=1-step=2.ckpt")
    assert ck.last_model_path == str(tmp_path / "last.ckpt")
    assert plugin.save_checkpoint.call_count == 4
    assert plugin.remove_checkpoint.call_count == 1
    assert plugin.teardown.call_count >= 1
    trainer.test(BoringModel(), ckpt_path=ck.last_model_path)
    plugin.load_checkpoint.assert_called_with(str(tmp_path / "last.ckpt"), weights_only=None)

    plugin.reset_mock()
    ck = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = Trainer(
        default_root_dir=tmp_path,
        strategy=SingleDeviceStrategy("cpu"),
        plugins=[plugin],
        callbacks=ck,
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=0,
        limit_test_batches=1,
        **QUIET,
    )
    trainer.fit(BoringModel())
    assert ckpt_names(tmp_path) == {
        "epoch=1-step=2.ckpt",
        "last.ckpt",
        "epoch=1-step=2-v1.ckpt",
        "last-v1.ckpt",
    }
    assert ck.best_model_path == str(tmp_path / "epoch=1-step=2-v1.ckpt")
    assert ck.last_model_path == str(tmp_path / "last-v1.ckpt")
    assert plugin.save_checkpoint.call_count == 4
    assert plugin.remove_checkpoint.call_count == 1
    trainer.test(BoringModel(), ckpt_path=ck.last_model_path)
    plugin.load_checkpoint.assert_called_once()
    plugin.load_checkpoint.assert_called_with(str(tmp_path / "last-v1.ckpt"), weights_only=None)
    assert leftovers(tmp_path) == []


def test_async_checkpoint_plugin_validate_then_fit(tmp_path: Path) -> None:
    plugin = SafeCheckpointIO()
    plugin.save_checkpoint = Mock(wraps=plugin.save_checkpoint)
    plugin.remove_checkpoint = Mock(wraps=plugin.remove_checkpoint)
    plugin.teardown = Mock(wraps=plugin.teardown)
    ck = ModelCheckpoint(dirpath=tmp_path, save_top_k=2, monitor="step", mode="max")
    trainer = Trainer(
        default_root_dir=tmp_path,
        plugins=[plugin],
        callbacks=ck,
        max_epochs=3,
        limit_train_batches=1,
        limit_val_batches=0,
        **QUIET,
    )
    trainer.validate(BoringModel())  # tears the plugin down once before fit uses it again
    trainer.fit(BoringModel())
    assert plugin.save_checkpoint.call_count == 3
    assert plugin.remove_checkpoint.call_count == 1
    assert plugin.teardown.call_count == 2
    assert_exactly_best_k(tmp_path, ck)


# --- the reference issue's scenario -----------------------------------------------------------


def test_async_checkpoint_io_leaves_stale_files(tmp_path: Path) -> None:
    """Lightning's AsyncCheckpointIO: the removal reaches queued writes, which land afterwards."""
    ck = topk_run(tmp_path, AsyncCheckpointIO(SlowTorchIO(delay=0.05)), epochs=10, mib=0)
    on_disk = ckpt_names(tmp_path)
    assert len(ck.best_k_models) == 2
    assert len(on_disk) > 2, f"expected stale files from the race, got {sorted(on_disk)}"
    assert {Path(p).name for p in ck.best_k_models} < on_disk


def _scenario(directory: Path, runs: int, delay: float) -> None:
    hit = 0
    for run in range(runs):
        target = directory / f"run{run}"
        plugin = SafeCheckpointIO(queue_depth=4, file_ops=SlowOps(delay))
        ck = topk_run(target, plugin)
        assert_exactly_best_k(target, ck)
        hit += plugin.cancelled + plugin.removed_after_write
    assert hit > 0, "no removal reached a queued or writing save: the race was not exercised"


def test_reference_scenario_exactly_best_k(root_dir: Path) -> None:
    """top-k 2, improving metric, an 8 MiB model, writes slower than epochs: a few runs."""
    _scenario(root_dir, runs=3, delay=0.03)


@pytest.mark.slow
def test_reference_scenario_50_runs(root_dir: Path) -> None:
    _scenario(root_dir, runs=50, delay=0.03)


# --- loading and resuming ------------------------------------------------------------------------


class StepAtStart(Callback):
    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.start = trainer.global_step


def test_load_from_checkpoint_and_resume_last(tmp_path: Path) -> None:
    ck = ModelCheckpoint(dirpath=tmp_path, save_top_k=1, monitor="step", mode="max", save_last=True)
    kwargs: dict[str, Any] = {"limit_train_batches": 3, "limit_val_batches": 0, **QUIET}
    trainer = Trainer(
        default_root_dir=tmp_path, plugins=[SafeCheckpointIO()], callbacks=[ck], max_epochs=2, **kwargs
    )
    model = BoringModel()
    trainer.fit(model)
    best = ck.best_model_path
    loaded = BoringModel.load_from_checkpoint(best)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
    raw = torch.load(best, weights_only=True)
    assert raw["global_step"] == 6 and "optimizer_states" in raw and "loops" in raw

    ck = ModelCheckpoint(dirpath=tmp_path, save_top_k=1, monitor="step", mode="max", save_last=True)
    start = StepAtStart()
    trainer = Trainer(
        default_root_dir=tmp_path, plugins=[SafeCheckpointIO()], callbacks=[ck, start], max_epochs=4, **kwargs
    )
    trainer.fit(BoringModel(), ckpt_path="last")
    assert start.start == 6 and trainer.global_step == 12
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 12


def test_kill_9_during_a_save_leaves_last_loadable(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "lightning_crash_worker.py"), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    last = tmp_path / "last.ckpt"
    try:
        assert proc.stdout is not None
        saves_after_first_last = 0
        for line in proc.stdout:
            if line.startswith("SAVE") and last.exists():
                saves_after_first_last += 1
                if saves_after_first_last == 2:
                    break
        before = last.stat().st_mtime_ns
        deadline = time.monotonic() + 60
        # Kill while the new last.ckpt is being written: its temp file exists (or, were the
        # write not atomic, last.ckpt itself is changing).
        while time.monotonic() < deadline:
            if list(tmp_path.glob(".last.ckpt.tmp.*")) or last.stat().st_mtime_ns != before:
                break
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(60)
    loaded = torch.load(last, weights_only=True)
    assert loaded["global_step"] >= 1
    assert loaded["state_dict"]["ballast"].numel() == 16 << 20  # whole, not a torn write
    model = BoringModel.load_from_checkpoint(last, strict=False)
    assert torch.equal(model.layer.weight, loaded["state_dict"]["layer.weight"])
    # The next run's first save collects the interrupted write's temp file.
    interrupted = list(tmp_path.glob(".*.tmp.*"))
    io = SafeCheckpointIO()
    io.save_checkpoint({"global_step": 0}, tmp_path / "next.ckpt")
    io.teardown()
    assert leftovers(tmp_path) == [], interrupted
    assert torch.load(last, weights_only=True)["global_step"] == loaded["global_step"]


# --- ManagedCheckpoint ---------------------------------------------------------------------------


class Scored(BoringModel):
    """Logs ``val_score``, best at the epochs listed in ``good``."""

    def __init__(self, good: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.good = good

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().validation_step(batch, batch_idx)
        self.log("val_score", 1.0 if self.current_epoch in self.good else float(self.current_epoch + 10))
        return out


def managed_fit(
    root: Path, epochs: int, model: BoringModel, **options: Any
) -> tuple[Trainer, ManagedCheckpoint]:
    callback = ManagedCheckpoint(root, **options)
    trainer = Trainer(
        default_root_dir=root,
        callbacks=[callback],
        max_epochs=epochs,
        limit_train_batches=2,
        limit_val_batches=1,
        **QUIET,
    )
    trainer.fit(model)
    return trainer, callback


def steps_in(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step_*"))


def test_managed_retention_records_and_resume(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    retention = Retention(keep_last=1, keep_best=1, metric="val_score")
    index = tmp_path / "index.jsonl"
    trainer, cb = managed_fit(
        root, 4, Scored(good=(1,)), retention=retention, registrar=JsonlIndexRegistrar(index)
    )
    assert cb.saved_steps == [2, 4, 6, 8]
    assert trainer.checkpoint_callbacks == [cb]  # a Checkpoint callback: no default ModelCheckpoint added
    assert steps_in(root) == [4, 8]  # the best (epoch 1 = step 4) and the last
    record = read_record(root / "step_4")
    assert record.metrics["val_score"] == 1.0 and record.step == 4
    assert (root / "latest").exists()
    registered = [json.loads(line)["step"] for line in index.read_text().splitlines()]
    assert registered == sorted(registered) and {4, 8} <= set(registered) <= {
        2,
        4,
        6,
        8,
    }  # 6 may be cancelled
    weights = {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}

    model = Scored(good=(1,))
    callback = ManagedCheckpoint(root, retention=retention)
    trainer = Trainer(
        default_root_dir=root,
        callbacks=[callback],
        max_epochs=4,
        limit_train_batches=2,
        limit_val_batches=1,
        **QUIET,
    )
    trainer.fit(model)  # max_epochs reached already: loads, and trains no further
    assert callback.restored_step == 8 and trainer.global_step == 8 and trainer.current_epoch == 4
    assert callback.saved_steps == []
    for key, value in weights.items():
        assert torch.equal(model.state_dict()[key], value)


def test_managed_resume_falls_back_past_a_broken_newest(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    managed_fit(root, 2, BoringModel(), retention=Retention(keep_last=2))
    assert steps_in(root) == [2, 4]
    for f in (root / "step_4").iterdir():
        if f.suffix == ".distcp":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # the newest is damaged
    start = StepAtStart()
    callback = ManagedCheckpoint(root, retention=Retention(keep_last=2))
    trainer = Trainer(
        default_root_dir=root,
        callbacks=[callback, start],
        max_epochs=3,
        limit_train_batches=2,
        limit_val_batches=1,
        **QUIET,
    )
    trainer.fit(BoringModel())
    assert callback.restored_step == 2 and start.start == 2
    assert trainer.global_step == 6 and callback.saved_steps == [4, 6]


def test_managed_every_n_train_steps_with_a_policy(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    policy = KeepAny((KeepLast(1), KeepEvery(3)))
    trainer, cb = managed_fit(
        root, 2, BoringModel(), retention=policy, every_n_train_steps=1, every_n_epochs=None
    )
    assert cb.saved_steps == [1, 2, 3, 4] and trainer.global_step == 4
    assert steps_in(root) == [3, 4]
    assert cb.latest_step is None  # the manager is closed once fit ends
    with pytest.raises(ConfigError, match="every_n_train_steps"):
        ManagedCheckpoint(root, every_n_train_steps=-1)


def test_managed_resume_into_another_model_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    managed_fit(root, 1, BoringModel())
    with pytest.raises(UnsupportedStateError, match="does not match this model"):
        managed_fit(root, 2, Ballast(1))  # a buffer the checkpoint lacks


def test_managed_explicit_ckpt_path_wins(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    managed_fit(root, 1, BoringModel())
    ck = ModelCheckpoint(dirpath=tmp_path / "files", save_last=True)
    Trainer(callbacks=[ck], max_epochs=2, limit_train_batches=2, limit_val_batches=0, **QUIET).fit(
        BoringModel()
    )
    start = StepAtStart()
    callback = ManagedCheckpoint(root)
    trainer = Trainer(
        callbacks=[callback, start],
        max_epochs=3,
        limit_train_batches=2,
        limit_val_batches=0,
        **QUIET,
    )
    trainer.fit(BoringModel(), ckpt_path=ck.last_model_path)
    assert callback.restored_step is None and start.start == 4


def test_managed_with_ckpt_path_last_and_next_to_a_model_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, files = tmp_path / "ckpt", tmp_path / "files"
    managed_fit(root, 1, BoringModel())
    kwargs: dict[str, Any] = {"limit_train_batches": 2, "limit_val_batches": 0, **QUIET}
    callback = ManagedCheckpoint(root)
    trainer = Trainer(default_root_dir=tmp_path, callbacks=[callback], max_epochs=2, **kwargs)
    trainer.fit(BoringModel(), ckpt_path="last")  # no ModelCheckpoint: Lightning finds nothing, we resume
    assert callback.restored_step == 2 and trainer.global_step == 4

    callback = ManagedCheckpoint(root)
    ck = ModelCheckpoint(dirpath=files, save_last=True)
    trainer = Trainer(
        default_root_dir=tmp_path,
        callbacks=[callback, ck],
        plugins=[SafeCheckpointIO()],
        max_epochs=3,
        **kwargs,
    )
    trainer.fit(BoringModel())
    assert callback.restored_step == 4 and trainer.global_step == 6
    assert ckpt_names(files) == {"epoch=2-step=6.ckpt", "last.ckpt"} and steps_in(root)[-1] == 6
    assert any("a ModelCheckpoint runs next to ManagedCheckpoint" in r.getMessage() for r in caplog.records)


def _managed_run(root: Path, out: Path, kill_epoch: int) -> subprocess.CompletedProcess[str]:
    """lightning_crash_worker.py's ManagedCheckpoint run (see there), killed in ``kill_epoch``."""
    command = [sys.executable, str(HERE / "lightning_crash_worker.py"), "managed", str(root), str(out)]
    return subprocess.run(
        [*command, str(kill_epoch)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def uninterrupted_weights(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("uninterrupted")
    run = _managed_run(directory / "ckpt", directory / "out.json", -1)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((directory / "out.json").read_text())
    assert result["restored_step"] is None
    return str(result["weights"])


# By the kind of save the run resumes from: the epoch it is killed in, the step it resumes from
# (see lightning_crash_worker.py).
KILLS = {"training_epoch_end": (1, 4), "validation_end": (4, 16)}


@pytest.mark.parametrize("saved_at", list(KILLS))
def test_managed_resume_after_kill_9_is_bit_exact(
    tmp_path: Path, saved_at: str, uninterrupted_weights: str
) -> None:
    """Shuffled data and dropout: every RNG draw the resume adds or loses changes the final weights."""
    root, out = tmp_path / "ckpt", tmp_path / "out.json"
    kill_epoch, resumed_step = KILLS[saved_at]
    killed = _managed_run(root, out, kill_epoch)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    resumed = _managed_run(root, out, -1)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["restored_step"] == resumed_step
    assert result["weights"] == uninterrupted_weights


def _launch(root: Path, strategy: str, epochs: int, world: int, out: Path) -> dict[str, Any]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            WORLD_SIZE=str(world),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        if world == 1:
            for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(key)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "lightning_dist_worker.py"),
                    str(root),
                    strategy,
                    str(epochs),
                    str(out),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-4000:]
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_managed_ddp_two_ranks_then_resume_on_one(tmp_path: Path) -> None:
    """2 gloo ranks under Lightning's DDP, then a resume at world size 1.

    FSDP does not run on CPU: Lightning's accelerator connector refuses ``FSDPStrategy``
    without CUDA, and torch's FSDP raises "FSDP needs a non-CPU accelerator device".
    """
    root = tmp_path / "ckpt"
    first = _launch(root, "ddp", 2, 2, tmp_path / "a.json")
    assert first["restored_step"] is None and first["global_step"] == 4 and first["saved_steps"] == [2, 4]
    record = read_record(root / "step_4")
    assert record is not None and record.world_size == 2
    second = _launch(root, "single", 3, 1, tmp_path / "b.json")
    assert second["restored_step"] == 4 and second["global_step"] == 6 and second["saved_steps"] == [6]
    assert steps_in(root) == [4, 6]
