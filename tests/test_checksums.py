"""Integrity and one commit point: changed bytes are never loaded, a committed checkpoint is never
skipped, and everything read from a root is untrusted (issue 9)."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import pickle
import shutil
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import safeckpt
from faults import FaultyFileOps
from safeckpt import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UnsupportedStateError,
    read_record,
)
from safeckpt._dcp import safe_metadata
from safeckpt._format.catalog import scan
from safeckpt._format.checksums import FileChecksum, combine, crc32
from safeckpt._fs.atomic import read_pointer
from safeckpt._ops.maintenance import prune, verify
from safeckpt._policy.retention import Retention
from safeckpt._storage.writer import raw_path_available
from toy import make_state, same_weights, train_step, weights

pytestmark = pytest.mark.timeout(120)  # a FIFO that hangs a read must fail, not stall the run

# The raw DCP writer and reader run only with torch's private serialization helpers (on by default;
# SAFECKPT_TORCH_PRIVATE=0 runs the public fallbacks: DCP's own writer, one checksum per file).
needs_raw_storage = pytest.mark.skipif(
    not raw_path_available(), reason="per-item checksums and reads in place need the raw DCP storage path"
)


def _saves(root: Path, steps: tuple[int, ...] = (1, 2), **kw: object) -> dict[int, dict[str, torch.Tensor]]:
    state = make_state()
    saved = {}
    with CheckpointManager(root, async_save=False, **kw) as mgr:  # type: ignore[arg-type]
        for step in steps:
            train_step(state)
            mgr.save(step, state, metrics={"loss": float(step)})
            saved[step] = weights(state)
    return saved


def _flip(path: Path, offset: int | None = None) -> int:
    """Flip one byte of ``path`` (default: the middle), keeping its size; the offset flipped."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))
    return at


def _rewrite_record(step_dir: Path, **changes: object) -> None:
    path = step_dir / "metadata.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# --- checksums ------------------------------------------------------------------------------------


def test_the_checksum_is_zip_crc32_and_combines() -> None:
    data = os.urandom(1 << 20)
    assert crc32(data) == zlib.crc32(data)
    assert combine(crc32(data[:1000]), crc32(data[1000:]), len(data) - 1000) == zlib.crc32(data)


@pytest.mark.parametrize(
    ("rows", "why"),
    [
        ([[0, 4, True], [4, 6, 7]], "integers"),  # JSON true is not a CRC
        ([[0, 4.0, 1], [4, 6, 7]], "integers"),
        ([[0, 4, "1"], [4, 6, 7]], "integers"),
        ([[0, 4, 1], [5, 5, 7]], "does not follow"),  # a gap
        ([[0, -4, 1], [-4, 14, 7]], "does not follow"),
        ([[0, 4, 1 << 32], [4, 6, 7]], "does not follow"),
        ([[0, 4, 1], [4, 5, 7]], "cover 9 bytes, the file has 10"),
        ([[0, 4], [4, 6, 7]], "values to unpack"),
        ({"x": 1}, "values to unpack"),
    ],
)
def test_a_damaged_checksum_entry_is_an_incomplete_checkpoint(rows: Any, why: str) -> None:
    assert FileChecksum.from_json({"crc32": [[0, 4, 1], [4, 6, 7]]}, size=10, where="f").size == 10
    with pytest.raises(IncompleteCheckpointError, match=f"checksums recorded for f are not valid.*{why}"):
        FileChecksum.from_json({"crc32": rows}, size=10, where="f")


def test_every_file_of_a_checkpoint_is_covered_by_its_checksums(root: Path) -> None:
    _saves(root, (1,))
    record = read_record(root / "step_1")
    assert record is not None and record.checksums is not None and record.seq == 1
    assert set(record.checksums) == set(record.files)
    for name, size in record.files.items():
        checksum = FileChecksum.from_json(record.checksums[name], size=size, where=name)
        data = (root / "step_1" / name).read_bytes()
        assert [(s.offset, s.length, s.crc) for s in checksum.segments] == [
            (s.offset, s.length, zlib.crc32(data[s.offset : s.offset + s.length])) for s in checksum.segments
        ]
    if not raw_path_available():
        return  # DCP's own writer (the public fallback): one segment for the whole shard
    # the shard has one segment per DCP item, so a reader checks exactly what it reads
    size = record.files["__0_0.distcp"]
    distcp = FileChecksum.from_json(record.checksums["__0_0.distcp"], size=size, where="")
    assert len(distcp.segments) > 5


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.25, 0.5, 0.75, 0.999])
def test_verify_finds_a_flipped_byte_anywhere_in_a_shard(root: Path, fraction: float) -> None:
    _saves(root)
    shard = root / "step_2" / "__0_0.distcp"
    offset = _flip(shard, int(shard.stat().st_size * fraction))
    report = verify(root)
    assert report[1] == []
    assert report[2] and "does not match the checksum" in report[2][0], (offset, report)


@pytest.mark.parametrize("name", ["__0_0.distcp", "train_state.rank0.safetensors", ".metadata"])
def test_a_flipped_byte_is_never_loaded(root: Path, name: str, caplog: pytest.LogCaptureFixture) -> None:
    saved = _saves(root)
    _flip(root / "step_2" / name)
    assert verify(root)[2], "verify must report the damage"
    fresh = make_state(seed=3)
    with CheckpointManager(root) as mgr:
        with pytest.raises((CorruptCheckpointError, IncompleteCheckpointError)) as info:
            mgr.restore(fresh, step=2)  # an explicit step raises
        if isinstance(info.value, CorruptCheckpointError):
            assert info.value.step == 2 and info.value.path.endswith(name)
        restored = mgr.restore(fresh)  # auto-resume falls back past it, with a warning
    assert restored.step == 1
    assert same_weights(weights(fresh), saved[1])
    assert any("falling back" in r.getMessage() or "skipping" in r.getMessage() for r in caplog.records)


def test_corruption_names_the_file_the_offset_and_the_step(root: Path) -> None:
    _saves(root)
    shard = root / "step_2" / "__0_0.distcp"
    _flip(shard)
    with CheckpointManager(root) as mgr, pytest.raises(CorruptCheckpointError) as info:
        mgr.restore(make_state(), step=2)
    error = info.value
    assert error.path == str(shard) and error.step == 2 and isinstance(error.offset, int)
    assert str(error.offset) in str(error) and "Restore another checkpoint" in str(error)


def _damaged_newest(root: Path) -> dict[str, torch.Tensor]:
    """Step 1 of ``w``; step 2 adds a large ``new`` (read straight into its place), with a byte of
    it flipped. A state to restore into, at its initial values."""
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
        mgr.save(2, {"w": torch.full((4,), 2.0), "new": torch.full((1 << 20,), 3.0)})
    _flip(root / "step_2" / "__0_0.distcp")  # the middle of the shard: inside new's bytes
    return {"w": torch.zeros(4), "new": torch.zeros(1 << 20)}


@needs_raw_storage
def test_a_fallback_names_what_the_damaged_step_filled_that_the_older_one_lacks(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = _damaged_newest(root)
    with CheckpointManager(root) as mgr:
        restored = mgr.restore(state, strict=False)
    assert restored.step == 1 and restored.missing == ("new",)
    assert torch.equal(state["w"], torch.ones(4))
    assert not torch.equal(state["new"], torch.zeros(1 << 20))  # what the warning is about
    warned = [r.getMessage() for r in caplog.records if "damaged step 2" in r.getMessage()]
    assert warned and "'new'" in warned[0] and "Set them anew" in warned[0]


def test_no_fresh_start_from_a_state_a_damaged_checkpoint_filled_in_part(root: Path) -> None:
    state = _damaged_newest(root)
    shutil.rmtree(root / "step_1")  # nothing older to fall back to
    with CheckpointManager(root) as mgr, pytest.raises(IncompleteCheckpointError) as info:
        mgr.restore(state)
    assert "holds part of a damaged checkpoint" in str(info.value) and "step(s) 2" in str(info.value)
    assert info.value.step == 2 and (root / "step_2").is_dir()  # nothing saved is removed
    with CheckpointManager(root) as mgr, pytest.raises(CorruptCheckpointError) as corrupt:
        mgr.restore(state, step=2)  # an explicit step keeps raising what it found
    assert any("step 2 filled part of it in place" in note for note in corrupt.value.__notes__)
    # damage found before anything of the state changes (the train-state file) is a fresh start
    fresh_root = root.parent / "other"
    with CheckpointManager(fresh_root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(4), "epoch": 3})
    _flip(fresh_root / "step_1" / "train_state.rank0.safetensors")
    untouched = {"w": torch.zeros(4), "epoch": 0}
    with CheckpointManager(fresh_root) as mgr:
        assert mgr.restore(untouched).step is None
    assert torch.equal(untouched["w"], torch.zeros(4)) and untouched["epoch"] == 0


def test_a_later_error_after_a_partly_filled_state_says_so(root: Path) -> None:
    state = _damaged_newest(root)
    with CheckpointManager(root) as mgr, pytest.raises(UnsupportedStateError) as info:
        mgr.restore(state)  # strict: step 1 lacks "new"
    assert any("step 2 filled part of it in place" in note for note in info.value.__notes__)


def test_plain_dcp_load_still_reads_a_checkpoint(root: Path) -> None:
    import torch.distributed.checkpoint as dcp

    _saves(root, (1,))
    model = make_state(seed=5)["model"]
    target = {"model": model.state_dict()}
    dcp.load(target, checkpoint_id=str(root / "step_1"))
    assert torch.equal(target["model"]["0.weight"], model.state_dict()["0.weight"])


def test_a_checkpoint_without_checksums_loads_with_a_warning(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved = _saves(root, (1,))
    _rewrite_record(root / "step_1", checksums=None, format_version=1, seq=None)
    fresh = make_state(seed=3)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(fresh).step == 1
    assert same_weights(weights(fresh), saved[1])
    assert any("cannot be verified" in r.getMessage() for r in caplog.records)


# --- one commit point -----------------------------------------------------------------------------


def test_a_kill_after_the_rename_resumes_from_the_new_checkpoint(root: Path) -> None:
    """The rename of the complete directory is the commit: a lagging `latest` does not undo it."""
    saved = _saves(root, (1,))
    state = make_state()
    ops = FaultyFileOps()
    ops.fail("symlink", errno.EIO, times=None, match="latest")  # the pointer swap fails: as if killed
    with CheckpointManager(root, async_save=False, file_ops=ops) as mgr:
        mgr.restore(state)
        train_step(state)
        mgr.save(2, state)  # committed: it does not raise for the pointer
        assert mgr.latest_step == 2
    assert read_pointer(root / "latest") == "step_1"  # the pointer lags
    fresh = make_state(seed=4)
    with CheckpointManager(root) as mgr:  # the next start repairs it
        assert read_pointer(root / "latest") == "step_2"
        assert mgr.restore(fresh).step == 2
    assert same_weights(weights(fresh), weights(state)) and not same_weights(weights(fresh), saved[1])


def test_a_rollback_is_respected(root: Path) -> None:
    _saves(root, (1, 2, 3, 4, 5))
    state = make_state(seed=2)
    with CheckpointManager(root, async_save=False) as mgr:
        assert mgr.restore(state, step=3).step == 3
        train_step(state)
        mgr.save(4, state, overwrite=True)
        retrained = weights(state)
    fresh = make_state(seed=7)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(fresh).step == 4  # the new step 4, never the abandoned step 5
    assert same_weights(weights(fresh), retrained)
    assert read_pointer(root / "latest") == "step_4"
    seqs = {e.step: e.record.seq for e in scan(root).committed.values() if e.record}
    assert seqs[4] > seqs[5]


def test_orphans_are_collected_at_open_and_only_they(root: Path) -> None:
    _saves(root, (1,))
    planted = [
        root / ".latest.tmp.0123456789ab",
        root / "step_1" / ".metadata.json.tmp.abcdef012345",
        root / "step_1" / ".metadata.tmp",
    ]
    kept = [root / "notes.txt", root / "step_1" / ".keep", root / ".latest.tmp.not-ours"]
    for path in planted + kept:
        path.write_bytes(b"x")
    with CheckpointManager(root):
        pass
    assert [p for p in planted if p.exists()] == []
    assert all(p.exists() for p in kept)


# --- confinement ----------------------------------------------------------------------------------


def _repoint_metadata(step_dir: Path, relative: str) -> None:
    """Point every storage entry of ``.metadata`` at ``relative`` and fix the record to match."""
    metadata = safe_metadata.read_metadata(step_dir)
    for index, info in list(metadata.storage_data.items()):
        metadata.storage_data[index] = type(info)(relative, info.offset, info.length)
    buffer = io.BytesIO()
    pickle.dump(metadata, buffer)
    data = buffer.getvalue()
    (step_dir / ".metadata").write_bytes(data)
    record = json.loads((step_dir / "metadata.json").read_text())
    record["files"][".metadata"] = len(data)
    record["checksums"][".metadata"] = FileChecksum.whole(data).to_json()
    (step_dir / "metadata.json").write_text(json.dumps(record))
    safe_metadata.forget_parsed()


@pytest.mark.parametrize("relative", ["../outside.bin", "/etc/passwd", "train_state.rank0.safetensors"])
def test_a_metadata_pointing_out_of_the_checkpoint_is_refused(root: Path, relative: str) -> None:
    _saves(root)
    (root / "outside.bin").write_bytes((root / "step_1" / "__0_0.distcp").read_bytes())
    _repoint_metadata(root / "step_2", relative)
    before = weights(state := make_state(seed=8))
    with CheckpointManager(root) as mgr, pytest.raises(UnsafeCheckpointError):
        mgr.restore(state, step=2)
    assert same_weights(weights(state), before), "nothing may be read before the refusal"


def test_a_record_listing_a_file_outside_is_refused(root: Path) -> None:
    _saves(root)
    (root / "secret").write_bytes(b"s" * 1234)
    record = json.loads((root / "step_2" / "metadata.json").read_text())
    record["files"]["../secret"] = 1234
    (root / "step_2" / "metadata.json").write_text(json.dumps(record))
    with pytest.raises(UnsafeCheckpointError):
        read_record(root / "step_2")
    report = verify(root)
    assert report[2] and "1234" not in " ".join(report[2])  # nothing about the outside file leaks
    with CheckpointManager(root) as mgr:
        assert mgr.restore(make_state()).step == 1  # auto-resume steps over it


# --- untrusted roots ------------------------------------------------------------------------------


@pytest.mark.parametrize("which", [".trash", ".staging"])
def test_a_symlinked_trash_or_staging_is_refused_and_nothing_outside_is_deleted(
    root: Path, tmp_path: Path, which: str
) -> None:
    _saves(root, (1,))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "step_9.pruned.0123456789ab").mkdir()
    (victim / "precious").write_bytes(b"keep me")
    shutil.rmtree(root / which)
    (root / which).symlink_to(victim)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"), CheckpointManager(root) as mgr:
        mgr.save(2, make_state())
    with pytest.raises(UnsafeCheckpointError):
        prune(root, Retention(keep_last=1))
    assert sorted(p.name for p in victim.iterdir()) == ["precious", "step_9.pruned.0123456789ab"]


@pytest.mark.parametrize("name", ["metadata.json", ".metadata", "train_state.rank0.safetensors"])
def test_a_fifo_in_a_checkpoint_is_an_error_never_a_hang(root: Path, name: str) -> None:
    _saves(root)
    path = root / "step_2" / name
    path.unlink()
    os.mkfifo(path)
    assert verify(root)[2]  # reported, not hung
    assert scan(root).latest_step in (1, 2)
    with CheckpointManager(root) as mgr:
        with pytest.raises((UnsafeCheckpointError, IncompleteCheckpointError)):
            mgr.restore(make_state(), step=2)
        assert mgr.restore(make_state()).step == 1
        if name == "metadata.json":  # no record: never a commit, so nothing to move aside
            assert (root / "step_2").is_dir()
        else:  # a commit auto-resume stepped over is moved aside; an explicit step says where it went
            with pytest.raises(CheckpointNotFoundError, match="moved it aside"):
                mgr.restore(make_state(), step=2)
    prune(root, Retention(keep_last=5))  # does not hang either


def test_a_record_of_another_step_is_not_believed(root: Path) -> None:
    _saves(root)
    _rewrite_record(root / "step_2", step=99)
    with CheckpointManager(root) as mgr:
        with pytest.raises(IncompleteCheckpointError, match="step 99"):
            mgr.restore(make_state(), step=2)
        assert mgr.restore(make_state()).step == 1


# Any finite number is a time the writer may have written (a host clock before 1970, or far
# ahead): the reader accepts it (tests/test_record.py). Only a time that is no number is invalid.
@pytest.mark.parametrize("time_value", ["soon", float("nan"), True])
def test_a_record_with_an_impossible_time_is_invalid_not_a_crash(root: Path, time_value: object) -> None:
    _saves(root)
    path = root / "step_2" / "metadata.json"
    data = json.loads(path.read_text())
    data["time"] = time_value
    path.write_text(json.dumps(data))  # (NaN written as the non-JSON token, as a careless editor would)
    with pytest.raises(IncompleteCheckpointError):
        read_record(root / "step_2")
    with CheckpointManager(root) as mgr:
        assert mgr.restore(make_state()).step == 1
        mgr.pin(1)  # pins and listing still work


def test_records_are_strict_json_and_non_finite_metrics_round_trip(root: Path) -> None:
    state = make_state()
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, state, metrics={"up": float("inf"), "down": float("-inf")}, extra={"x": float("nan")})
    text = (root / "step_1" / "metadata.json").read_text()

    def refuse(token: str) -> None:
        raise AssertionError(f"{token} is not JSON")

    json.loads(text, parse_constant=refuse)
    record = read_record(root / "step_1")
    assert record is not None and record.metrics == {"up": float("inf"), "down": float("-inf")}
    assert str(record.extra["x"]) == "nan"


def test_a_directory_named_latest_does_not_break_saving(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    root.mkdir(parents=True)
    (root / "latest").mkdir()
    (root / "latest" / "user-file").write_bytes(b"mine")
    state = make_state()
    with CheckpointManager(root, async_save=False) as mgr:
        train_step(state)
        mgr.save(1, state)  # commits without raising
        train_step(state)
        mgr.save(2, state)
    with CheckpointManager(root) as mgr:  # the next start repairs `latest`, keeping what was there
        assert read_pointer(root / "latest") == "step_2"
        assert mgr.restore(make_state()).step == 2
    kept = [p for p in root.iterdir() if p.name.startswith("latest.not-a-pointer")]
    assert len(kept) == 1 and (kept[0] / "user-file").read_bytes() == b"mine"


def test_a_latest_that_is_a_fifo_is_treated_as_missing(root: Path) -> None:
    _saves(root)
    (root / "latest").unlink()
    os.mkfifo(root / "latest")
    assert read_pointer(root / "latest") is None
    with CheckpointManager(root) as mgr:
        assert mgr.restore(make_state()).step == 2
    assert read_pointer(root / "latest") == "step_2"


def test_verification_can_be_switched_off(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _saves(root)
    shard = root / "step_2" / "__0_0.distcp"
    record = read_record(root / "step_2")
    assert record is not None
    # flip a byte inside a tensor's data, not a header: the load itself then still works
    size = record.files["__0_0.distcp"]
    checksum = FileChecksum.from_json(record.checksums["__0_0.distcp"], size=size, where="")
    big = max(checksum.segments, key=lambda s: s.length)
    _flip(shard, big.offset + big.length // 2)
    monkeypatch.setenv("SAFECKPT_VERIFY", "0")
    with CheckpointManager(root) as mgr:
        assert mgr.restore(make_state(), step=2).step == 2  # loads the changed bytes, as asked
    monkeypatch.delenv("SAFECKPT_VERIFY")
    with CheckpointManager(root) as mgr, pytest.raises(CorruptCheckpointError):
        mgr.restore(make_state(), step=2)


def test_logging_names_no_unverifiable_warning_for_new_checkpoints(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _saves(root, (1,))
    with caplog.at_level(logging.WARNING), CheckpointManager(root) as mgr:
        mgr.restore(make_state())
    assert not any("cannot be verified" in r.getMessage() for r in caplog.records)


def _rewrite_train_state(step_dir: Path, change: Any) -> None:
    """Edit the JSON document of rank 0's train-state file and fix size and checksum in the record,
    as someone who can write the root could: only validation against the state can catch it."""
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    path = step_dir / "train_state.rank0.safetensors"
    blob = path.read_bytes()
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
    document = json.loads(header["__metadata__"]["safeckpt.train_state"])
    change(document)
    data = st_save(st_load(blob), metadata={"safeckpt.train_state": json.dumps(document)})
    path.write_bytes(data)
    record = json.loads((step_dir / "metadata.json").read_text())
    record["files"][path.name] = len(data)
    record["checksums"][path.name] = FileChecksum.whole(data).to_json()
    (step_dir / "metadata.json").write_text(json.dumps(record))


def _replace_model_by_a_value(document: Any) -> None:
    document["values"].append("pwned")
    for entry in document["tree"]["D"]:
        if entry[0] == "model":
            entry[1] = {"V": len(document["values"]) - 1}


def _break_a_node(document: Any) -> None:
    for entry in document["tree"]["D"]:
        if entry[0] == "sched":
            entry[1] = {"Q": 1}


@pytest.mark.parametrize(
    "change", [_replace_model_by_a_value, _break_a_node], ids=["value-for-model", "bad-node"]
)
def test_a_tampered_train_state_touches_nothing(root: Path, change: Any) -> None:
    _saves(root)
    _rewrite_train_state(root / "step_2", change)
    state = make_state(seed=6)
    model, before = state["model"], weights(state)
    sched_before = state["sched"].state_dict()
    with CheckpointManager(root) as mgr:
        with pytest.raises(CheckpointError):
            mgr.restore(state, step=2)
        assert state["model"] is model and same_weights(weights(state), before)
        assert state["sched"].state_dict() == sched_before
        assert mgr.restore(state, step=1).step == 1  # and the state still loads a sound checkpoint
    assert state["model"] is model


def test_a_newer_train_state_format_is_refused_by_name_and_never_skipped(root: Path) -> None:
    from safeckpt import NewerFormatError

    _saves(root)
    _rewrite_train_state(root / "step_2", lambda document: document.update(format=99))
    state = make_state(seed=6)
    before = weights(state)
    with CheckpointManager(root) as mgr:
        # auto-resume does not fall back to step 1: that would undo training without a word
        with pytest.raises(NewerFormatError, match=r"newer safeckpt \(train-state format 99.*Upgrade"):
            mgr.restore(state)
        assert same_weights(weights(state), before)
        with pytest.raises(NewerFormatError):
            safeckpt.load(root)
        assert mgr.restore(state, step=1).step == 1


@pytest.mark.parametrize("stale", [1, 4, 5])
def test_a_small_file_read_that_meets_a_replacement_elsewhere_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stale: int
) -> None:
    from safeckpt._fs import safe_open as integrity

    path = tmp_path / "metadata.json"
    path.write_bytes(b"{}")
    real, calls = integrity.open_regular, []

    def stale_at_first(p: Path) -> Any:
        calls.append(p)
        if len(calls) <= stale:
            raise OSError(errno.ESTALE, "Stale file handle", str(p))
        return real(p)

    monkeypatch.setattr(integrity, "open_regular", stale_at_first)
    if stale < 5:
        assert integrity.read_small(path, limit=100, what="record") == b"{}"
        assert len(calls) == stale + 1
    else:  # still stale after 5 tries: the error is the caller's
        with pytest.raises(OSError) as raised:
            integrity.read_small(path, limit=100, what="record")
        assert raised.value.errno == errno.ESTALE and len(calls) == 5


def test_segments_are_found_alone_and_as_runs_of_one_length() -> None:
    from safeckpt._format.checksums import Segment

    checksum = FileChecksum(
        (Segment(0, 10, 1), Segment(10, 5, 2), Segment(15, 5, 3), Segment(20, 5, 4), Segment(25, 7, 5))
    )
    assert checksum.segment_at(10, 5) == Segment(10, 5, 2)
    assert checksum.segment_at(10, 6) is None and checksum.segment_at(11, 5) is None
    assert checksum.segment_at(32, 0) is None  # past the end
    assert checksum.run_at(10, 5, 3) == (Segment(10, 5, 2), Segment(15, 5, 3), Segment(20, 5, 4))
    assert checksum.run_at(10, 5, 4) is None, "the fourth is 7 bytes long"
    assert checksum.run_at(20, 5, 3) is None, "there are only two segments from there"
    assert checksum.run_at(0, 10, 1) == (Segment(0, 10, 1),)
