"""CheckpointManager: save, commit, restore, validation and resume decisions."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from safeckpt import (
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    InvalidSaveError,
    JsonlIndexRegistrar,
    ManagerClosedError,
    Retention,
    UnsupportedStateError,
    read_record,
)
from safeckpt._fs.atomic import read_pointer
from safeckpt._fs.fileops import FileOps
from toy import make_state, same_weights, train_step, weights

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


@pytest.fixture
def root(root_dir: Path) -> Path:
    """Every test here runs on local disk and again on the NFS-semantics filesystem."""
    return root_dir


def run(root: Path, steps: range, *, async_save: bool, save_every: int = 1, **kw: Any) -> dict[str, Any]:
    state = make_state()
    with CheckpointManager(root, async_save=async_save, **kw) as mgr:
        start = mgr.restore(state).step or 0
        assert start == steps.start
        for step in steps:
            loss = train_step(state)
            if (step + 1) % save_every == 0:
                mgr.save(step + 1, state, metrics={"loss": loss})
    return state


@pytest.mark.parametrize("async_save", MODES)
def test_round_trip_restores_every_kind_of_state(root: Path, async_save: bool) -> None:
    state = make_state()
    state["ema"] = torch.arange(6.0)
    for _ in range(3):
        train_step(state)
    with CheckpointManager(root, async_save=async_save) as mgr:
        mgr.save(3, state, metrics={"loss": 0.5}, extra={"note": "hello"})

    fresh = make_state(seed=1)
    fresh["ema"] = torch.zeros(6)
    with CheckpointManager(root, async_save=async_save) as mgr:
        assert mgr.restore(fresh).step == 3
    assert same_weights(weights(state), weights(fresh))
    moments = fresh["optim"].state_dict()["state"]
    for key, value in state["optim"].state_dict()["state"].items():
        assert torch.equal(value["exp_avg"], moments[key]["exp_avg"])
        assert torch.equal(value["exp_avg_sq"], moments[key]["exp_avg_sq"])
    assert fresh["sched"].state_dict() == state["sched"].state_dict()
    assert fresh["data"].cursor == state["data"].cursor == 3
    assert fresh["epoch"] == 3
    assert torch.equal(fresh["ema"], torch.arange(6.0))
    record = read_record(root / "step_3")
    assert record is not None and record.extra == {"note": "hello"} and record.metrics == {"loss": 0.5}


@pytest.mark.parametrize("async_save", MODES)
def test_resume_is_bit_exact(tmp_path: Path, async_save: bool) -> None:
    straight = run(tmp_path / "a", range(0, 12), async_save=async_save, save_every=4)
    run(tmp_path / "b", range(0, 6), async_save=async_save, save_every=4)  # stops after step 6
    resumed = run(tmp_path / "b", range(4, 12), async_save=async_save, save_every=4)
    assert same_weights(weights(straight), weights(resumed))
    assert resumed["data"].cursor == straight["data"].cursor


def test_resume_without_rng_state_diverges(tmp_path: Path) -> None:
    """The control for the bit-exact test: dropout masks need the RNG state."""
    straight = run(tmp_path / "a", range(0, 12), async_save=False, save_every=4)
    run(tmp_path / "b", range(0, 4), async_save=False, save_every=4, save_rng=False)
    torch.manual_seed(12345)
    resumed = run(tmp_path / "b", range(4, 12), async_save=False, save_every=4, save_rng=False)
    assert not same_weights(weights(straight), weights(resumed))


def test_checkpoint_loads_with_plain_dcp(root: Path) -> None:
    state = make_state()
    train_step(state)
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, state)
    target = {"model": make_state(seed=3)["model"].state_dict()}
    dcp.load(target, checkpoint_id=str(root / "step_1"))
    assert same_weights(target["model"], weights(state))


def test_nothing_to_resume_returns_zero_and_leaves_state(root: Path) -> None:
    state = make_state()
    before = weights(state)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state).step is None
    assert same_weights(before, weights(state))


def test_commit_layout_and_latest(root: Path) -> None:
    state = make_state()
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(5, state)
        mgr.save(10, state)
        assert mgr.latest_step == 10
    assert os.readlink(root / "latest") == "step_10"
    record = read_record(root / "step_10")
    assert record is not None and record.committed and record.step == 10
    assert set(record.files) == {".metadata", "__0_0.distcp", "train_state.rank0.safetensors"}
    for name, size in record.files.items():
        assert (root / "step_10" / name).stat().st_size == size
    assert list((root / ".staging").iterdir()) == []


class NoExchange(FileOps):
    """A filesystem without RENAME_EXCHANGE (NFS, FUSE)."""

    def exchange(self, a: Path, b: Path) -> None:
        raise OSError(errno.EINVAL, "no RENAME_EXCHANGE here")


@pytest.mark.parametrize("ops", [FileOps(), NoExchange()], ids=["exchange", "two-renames"])
def test_second_save_of_a_step_replaces_it(root: Path, ops: FileOps) -> None:
    state = make_state()
    with CheckpointManager(root, async_save=False, file_ops=ops) as mgr:
        mgr.save(7, state, metrics={"loss": 1.0})
        train_step(state)
        mgr.save(7, state, metrics={"loss": 0.5})
    record = read_record(root / "step_7")
    assert record is not None and record.metrics == {"loss": 0.5}
    fresh = make_state(seed=2)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(fresh).step == 7
    assert same_weights(weights(fresh), weights(state))
    assert list((root / ".trash").iterdir()) == []


@pytest.mark.parametrize(
    "step, message",
    [(-1, "non-negative"), (1.5, "integer"), (True, "integer"), ("3", "integer"), (None, "integer")],
    ids=["negative", "float", "bool", "str", "none"],
)
def test_bad_step_is_refused_before_anything_is_written(root: Path, step: Any, message: str) -> None:
    with CheckpointManager(root) as mgr, pytest.raises(InvalidSaveError, match=message):
        mgr.save(step, make_state())
    assert not any(root.glob("step_*"))
    assert list((root / ".staging").iterdir()) == []


@pytest.mark.parametrize("async_save", MODES)
def test_going_back_needs_overwrite(root: Path, async_save: bool) -> None:
    state = make_state()
    with CheckpointManager(root, async_save=async_save) as mgr:
        mgr.save(10, state)
        with pytest.raises(InvalidSaveError, match="overwrite=True"):
            mgr.save(5, state)
        mgr.wait()
        assert not (root / "step_5").exists()
        mgr.save(5, state, overwrite=True)
        mgr.wait()
        assert mgr.latest_step == 5
    assert os.readlink(root / "latest") == "step_5"
    assert (root / "step_10").is_dir()  # the later step is kept, not silently deleted


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(extra={"path": Path("/x")}), InvalidSaveError, "extra must be JSON"),
        (dict(metrics={"loss": "low"}), InvalidSaveError, "must be a number"),
        (dict(metrics={"loss": torch.ones(3)}), InvalidSaveError, "several elements"),
    ],
    ids=["extra-not-json", "metric-not-number", "metric-not-scalar"],
)
def test_bad_save_arguments_write_nothing(
    root: Path, kwargs: dict[str, Any], error: type, match: str
) -> None:
    state = make_state()
    with CheckpointManager(root) as mgr:
        mgr.save(1, state)
        mgr.wait()
        with pytest.raises(error, match=match):
            mgr.save(2, state, **kwargs)
        mgr.wait()
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1"]
    assert os.readlink(root / "latest") == "step_1"


def test_unsupported_state_value_is_refused(root: Path) -> None:
    state = make_state()
    state["callback"] = lambda: None
    refused = pytest.raises(UnsupportedStateError, match=r"callback is a builtins\.function")
    with CheckpointManager(root) as mgr, refused:
        mgr.save(1, state)
    assert not any(root.glob("step_*"))


def test_metric_tensor_and_nan_are_accepted(root: Path) -> None:
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, make_state(), metrics={"loss": torch.tensor(0.25), "acc": float("nan")})
    record = read_record(root / "step_1")
    assert record is not None and record.metrics == {"loss": 0.25, "acc": None}


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(max(0, path.stat().st_size - 7))


def _three_checkpoints(root: Path) -> dict[int, dict[str, torch.Tensor]]:
    state = make_state()
    saved = {}
    with CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2, 3):
            train_step(state)
            mgr.save(step, state)
            saved[step] = weights(state)
    return saved


@pytest.mark.parametrize(
    "damage",
    ["truncated-data", "record-missing", "latest-dangling", "latest-missing", "latest-garbage"],
)
def test_auto_resume_falls_back_to_newest_complete(
    root: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    saved = _three_checkpoints(root)
    expected = 2
    if damage == "truncated-data":
        _truncate(root / "step_3" / "__0_0.distcp")
    elif damage == "record-missing":
        (root / "step_3" / "metadata.json").unlink()
    elif damage == "latest-dangling":
        os.rename(root / "step_3", root / "elsewhere")
    elif damage == "latest-missing":
        (root / "latest").unlink()
        expected = 3
    elif damage == "latest-garbage":
        (root / "latest").unlink()
        (root / "latest").write_text("../../etc\n")
        expected = 3
    fresh = make_state(seed=9)
    with CheckpointManager(root) as mgr:
        # `latest` only mirrors the newest commit (damaged data is found on load): repaired at open
        newest_commit = 3 if damage == "truncated-data" else expected
        assert read_pointer(root / "latest") == f"step_{newest_commit}"
        assert mgr.restore(fresh).step == expected
    assert same_weights(weights(fresh), saved[expected])
    if damage in ("truncated-data", "record-missing"):  # damage is said; a lagging pointer is not news
        assert any(r.levelno == logging.WARNING for r in caplog.records)


def test_explicit_step_or_path_is_honoured_or_fails_loudly(root: Path) -> None:
    saved = _three_checkpoints(root)
    fresh = make_state(seed=9)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(fresh, step=1).step == 1
        assert same_weights(weights(fresh), saved[1])
        assert mgr.restore(fresh, path=root / "step_2").step == 2
        assert same_weights(weights(fresh), saved[2])
        with pytest.raises(CheckpointNotFoundError, match="no checkpoint"):
            mgr.restore(fresh, step=4)
        _truncate(root / "step_3" / "__0_0.distcp")
        with pytest.raises(IncompleteCheckpointError, match="does not match its record"):
            mgr.restore(fresh, step=3)
        with pytest.raises(ConfigError):
            mgr.restore(fresh, step=1, path=root / "step_1")
    assert same_weights(weights(fresh), saved[2])  # a refused restore loaded nothing


def test_strict_restore_names_missing_entries(root: Path) -> None:
    state = make_state()
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"model": state["model"]})
        bigger = make_state(seed=4)
        with pytest.raises(UnsupportedStateError, match="'optim'"):
            mgr.restore(bigger)
        assert mgr.restore(bigger, strict=False).step == 1
    assert same_weights(weights(bigger), weights(state))


def test_leftovers_are_collected_at_start(root: Path) -> None:
    _three_checkpoints(root)
    (root / ".staging" / "step_4.0123456789ab").mkdir(parents=True)
    (root / ".staging" / "step_4.0123456789ab" / "__0_0.distcp").write_bytes(b"partial")
    (root / ".trash").mkdir(exist_ok=True)
    (root / ".trash" / "step_0.pruned.0123456789ab").mkdir()
    with CheckpointManager(root) as mgr:
        assert mgr.restore(make_state()).step == 3
    assert list((root / ".staging").iterdir()) == []
    assert list((root / ".trash").iterdir()) == []


def test_interrupted_replacement_is_put_back(root: Path) -> None:
    """A crash between the two renames of a replacement (no RENAME_EXCHANGE) loses nothing."""
    saved = _three_checkpoints(root)
    os.rename(root / "step_3", root / ".trash" / "step_3.replaced.0123456789ab")
    fresh = make_state(seed=5)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(fresh).step == 3
    assert same_weights(weights(fresh), saved[3])


def test_retention_prunes_to_the_trash_and_keeps_latest(root: Path) -> None:
    state = make_state()
    retention = Retention(keep_last=2, keep_best=1, metric="loss", keep_every=4)
    losses = {1: 0.1, 2: 0.9, 3: 0.8, 4: 0.7, 5: 0.6, 6: 0.5, 7: 0.4}
    with CheckpointManager(root, async_save=False, retention=retention) as mgr:
        for step, loss in losses.items():
            mgr.save(step, state, metrics={"loss": loss})
        kept = {c.step: c.kept_because for c in mgr.checkpoints()}
    assert sorted(kept) == [1, 4, 6, 7]
    assert "best 1 by loss (min)" in kept[1] and "every 4" in kept[4] and "latest" in kept[7]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1", "step_4", "step_6", "step_7"]
    assert list((root / ".trash").iterdir()) == []


def test_pinned_checkpoint_survives_retention(root: Path) -> None:
    state = make_state()
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=1)) as mgr:
        mgr.save(1, state)
        mgr.pin(1)
        for step in (2, 3):
            mgr.save(step, state)
        assert [c.step for c in mgr.checkpoints()] == [1, 3]
        with pytest.raises(CheckpointNotFoundError):
            mgr.pin(2)
        mgr.unpin(1)
        assert [c.step for c in mgr.checkpoints()] == [3]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_3"]


def test_pin_set_by_another_process_is_respected(root: Path) -> None:
    """`safeckpt pin` amends the record on disk; the training job re-reads it before pruning."""
    from safeckpt._ops.maintenance import set_pinned

    state = make_state()
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=1)) as mgr:
        mgr.save(1, state)
        set_pinned(root, 1, True)
        mgr.save(2, state)
    assert (root / "step_1").is_dir()


def test_unpin_by_another_process_is_respected(root: Path) -> None:
    from safeckpt._ops.maintenance import set_pinned

    state = make_state()
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=1)) as mgr:
        mgr.save(1, state)
        mgr.pin(1)
        mgr.save(2, state)
        set_pinned(root, 1, False)
        mgr.save(3, state)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_3"]


class _Boom:
    def register(self, step: int, path: Path, record: Any) -> dict[str, Any]:
        raise RuntimeError("registry is down")


def test_a_registrar_that_raises_costs_only_the_registration(root: Path) -> None:
    with CheckpointManager(root, async_save=False, registrar=_Boom()) as mgr:
        mgr.save(1, make_state())
    record = read_record(root / "step_1")
    assert record is not None and record.committed
    assert record.registration is not None
    assert {k: record.registration[k] for k in ("status", "error")} == {
        "status": "failed",
        "error": "RuntimeError: registry is down",
    }
    with CheckpointManager(root) as mgr:
        assert mgr.restore(make_state()).step == 1


def test_jsonl_registrar_indexes_commits(root: Path, tmp_path: Path) -> None:
    index = tmp_path / "index.jsonl"
    with CheckpointManager(root, registrar=JsonlIndexRegistrar(index)) as mgr:
        mgr.save(1, make_state(), metrics={"loss": 2.0})
        mgr.save(2, make_state(), metrics={"loss": 1.0})
    lines = [json.loads(line) for line in index.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    record = read_record(root / "step_2")
    assert record is not None and record.registration is not None
    assert record.registration["status"] == "registered"
    assert record.registration["index"] == str(index)


def test_closed_manager_refuses_work_and_close_is_idempotent(root: Path) -> None:
    mgr = CheckpointManager(root)
    mgr.close()
    mgr.close()
    with pytest.raises(ManagerClosedError, match="closed"):
        mgr.save(1, make_state())
    with pytest.raises(ManagerClosedError):
        mgr.restore(make_state())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(queue_depth=0), "queue_depth"),
        (dict(retention={"keep_last": 3}), "safeckpt.Retention"),
    ],
    ids=["queue-depth", "retention-type"],
)
def test_bad_configuration_is_refused(root: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CheckpointManager(root, **kwargs)


def _open_files_under(path: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            found.append(target)
    return found


def test_close_lets_go_of_every_file_under_the_root(root: Path) -> None:
    """A file left open keeps a .nfs entry alive on NFS and makes an unmount busy."""
    with CheckpointManager(root, retention=Retention(keep_last=1)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, make_state())
        assert _open_files_under(root)  # the sidecar lock is open while the manager works
    assert _open_files_under(root) == []


def test_a_stray_file_in_staging_does_not_hold_up_close(root: Path) -> None:
    root.mkdir(parents=True)
    (root / ".staging").mkdir()
    (root / ".staging" / "junk").write_bytes(b"not a save")
    with CheckpointManager(root, drain_timeout=3600) as mgr:
        mgr.save(1, make_state())
    assert list((root / ".staging").iterdir()) == [] and list((root / ".trash").iterdir()) == []
