"""Records: round trip, atomic writes under the sidecar lock, amend, torn records, input checks."""

from __future__ import annotations

import errno
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from faults import FaultyFileOps, LockRecordingFileOps
from safeckpt import CheckpointManager
from safeckpt._format.layout import RECORD_NAME
from safeckpt._format.record import (
    COMMITTED,
    Record,
    amend_record,
    check_json_value,
    clean_metrics,
    encode,
    list_files,
    missing_or_wrong_files,
    read_record,
    write_record,
)
from safeckpt._format.tier_fields import Lineage, Part, Upload
from safeckpt._fs.lock import SidecarLock
from safeckpt._ops.maintenance import verify
from safeckpt.cli import main
from safeckpt.errors import IncompleteCheckpointError, InvalidSaveError
from stores import loc


@pytest.fixture
def ckpt(root_dir: Path) -> Path:
    """A checkpoint directory inside the root (local and NFS), with two data files."""
    path = root_dir / "step_5"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"a" * 10)
    (path / "part.bin").write_bytes(b"b" * 3)
    return path


@pytest.fixture
def lock(root_dir: Path) -> SidecarLock:
    root_dir.mkdir(exist_ok=True)
    return SidecarLock(root_dir / ".lock", timeout=30)


def a_record(**changes: Any) -> Record:
    fields: dict[str, Any] = dict(
        step=5,
        time=1_700_000_000.25,
        files={"__0_0.distcp": 10, "part.bin": 3},
        metrics={"loss": 0.5, "acc": None, "big": math.inf},
        extra={"epoch": 2, "notes": ["a", {"b": None}], "lr": 1e-4},
        world_size=4,
        pinned=False,
        registration=None,
        torch_version="2.x",
    )
    fields.update(changes)
    return Record(**fields)


CHECKSUMS = {"__0_0.distcp": {"crc32": [[0, 6, 1], [6, 4, 2]]}, "part.bin": {"crc32": [[0, 3, 3]]}}


# --- round trip ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "record",
    [
        pytest.param(a_record(), id="full"),
        pytest.param(a_record(pinned=True, registration={"status": "registered", "id": 7}), id="registered"),
        pytest.param(Record(step=0, time=0.0, files={}), id="minimal"),
        pytest.param(a_record(status="writing", metrics={}, extra={}), id="not-committed"),
        pytest.param(a_record(checksums=CHECKSUMS), id="with-checksums"),
        pytest.param(a_record(time=-3.0e7), id="before-1970"),
        pytest.param(a_record(time=1.0e17), id="beyond-gmtime"),
        pytest.param(
            a_record(local=Lineage(root="s3://b/run", root_id="ab", tier="cd", after=3)), id="local"
        ),
    ],
)
def test_record_round_trip(ckpt: Path, lock: SidecarLock, record: Record) -> None:
    write_record(loc(ckpt, FaultyFileOps()), record, lock)
    assert read_record(ckpt) == record
    assert Record.from_json(json.loads(encode(record))) == record


# The tier fields as each version wrote them (docs/tiers.md): read typed, written back as they were.
EARLIER_TIER_FIELDS = [
    pytest.param({"uploaded": {"at": 1.5, "from": "/l/step_3"}}, id="durable-first-version"),
    pytest.param(
        {"uploaded": {"at": 1.5, "from": "/l/step_3", "id": "step_3.abcdef000001"}}, id="durable-parts"
    ),
    pytest.param(
        {"uploaded": {"at": 1.5, "from": "/l/step_3", "tier": None, "seq": None}}, id="durable-tier-unknown"
    ),
    pytest.param(
        {"uploaded": {"at": 1.5, "from": "/l/step_3", "tier": "t", "seq": 4, "id": "step_3.abcdef000001"}},
        id="durable",
    ),
    pytest.param({"uploaded": {"at": 1.5, "to": "s3://b/r/step_3"}}, id="local-mark"),
    pytest.param({"part": {"id": "step_3.abcdef000001", "node": 1, "nodes": 2}}, id="part"),
    pytest.param({"local": {"root": "s3://b/r", "root_id": None, "tier": "t", "after": None}}, id="lineage"),
    pytest.param({"uploaded": {"at": 1.5, "to": "x", "seq": "7", "later": [1]}}, id="unknown-and-mistyped"),
]


@pytest.mark.parametrize("fields", EARLIER_TIER_FIELDS)
def test_tier_fields_of_earlier_records_load_and_are_written_back_as_they_were(
    ckpt: Path, lock: SidecarLock, fields: dict[str, Any]
) -> None:
    (ckpt / RECORD_NAME).write_text(json.dumps({**a_record().to_json(), **fields}))
    record = read_record(ckpt)
    assert record is not None
    for key, raw in fields.items():
        assert json.dumps(record.to_json()[key]) == json.dumps(raw)  # the same keys, order and nulls
    amend_record(loc(ckpt, FaultyFileOps()), lock, pinned=True)  # what a pin or an upload's mark does
    on_disk = json.loads((ckpt / RECORD_NAME).read_text())
    assert on_disk["pinned"] and all(json.dumps(on_disk[k]) == json.dumps(v) for k, v in fields.items())


def test_tier_fields_are_typed() -> None:
    data = {
        **a_record().to_json(),
        "uploaded": {"at": 2, "from": "/l/step_3", "tier": "t", "seq": 4, "id": "step_3.abcdef000001"},
        "part": {"id": "step_3.abcdef000001", "node": 1, "nodes": 2},
        "local": {"root": "s3://b/r", "root_id": "r00t", "tier": "t", "after": 3},
    }
    record = Record.from_json(data)
    assert record.uploaded == Upload(at=2.0, source="/l/step_3", tier="t", seq=4, save="step_3.abcdef000001")
    assert record.part == Part(save="step_3.abcdef000001", node=1, nodes=2)
    assert record.part_id == "step_3.abcdef000001"
    assert record.local == Lineage(root="s3://b/r", root_id="r00t", tier="t", after=3)
    # A value of the wrong type is no value (never a crash, never a checkpoint made unloadable).
    odd = Record.from_json({**data, "uploaded": {"at": "soon", "seq": True}, "part": {"node": "1"}})
    assert odd.uploaded is not None and odd.uploaded.at is None and odd.uploaded.seq is None
    assert odd.part is not None and odd.part.node is None and odd.part_id is not None  # a part all the same


def test_the_record_on_disk_is_readable_json(ckpt: Path, lock: SidecarLock) -> None:
    write_record(loc(ckpt, FaultyFileOps()), a_record(), lock)
    data = json.loads((ckpt / RECORD_NAME).read_text())
    assert data["status"] == COMMITTED and data["step"] == 5
    assert data["time_iso"] == "2023-11-14T22:13:20Z"
    assert list(data["files"]) == sorted(data["files"])
    record = read_record(ckpt)
    assert record is not None and record.committed and record.size == 13


def test_the_record_is_indented_for_a_reader_but_its_checksum_rows_are_compact() -> None:
    record = a_record(checksums=CHECKSUMS)
    text = encode(record).decode()
    assert json.loads(text) == record.to_json()  # the same object, key order included
    assert list(json.loads(text)) == list(record.to_json())
    assert '\n  "step": 5,\n' in text and text.endswith("\n}\n")
    assert '\n  "checksums": {"__0_0.distcp":{"crc32":[[0,6,1],[6,4,2]]},"part.bin":' in text
    assert text.count("\n") == encode(a_record()).decode().count("\n")  # the rows add no lines


@pytest.mark.parametrize("clock", [pytest.param(-3.0e7, id="1969"), pytest.param(3.0e11, id="year-11476")])
def test_a_checkpoint_saved_under_a_broken_clock_is_read_back(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], clock: float
) -> None:
    """Whatever time a host clock says, the record written then is one the reader accepts: resume
    and verify take that checkpoint instead of skipping it as invalid."""
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.zeros(3)})
        with monkeypatch.context() as patched:
            patched.setattr(time, "time", lambda: clock)
            mgr.save(2, {"w": torch.ones(3)})
    record = read_record(root / "step_2", step=2)
    assert record is not None and record.committed and record.time == clock
    assert verify(root) == {1: [], 2: []}
    state = {"w": torch.zeros(3)}
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state).step == 2
    assert torch.equal(state["w"], torch.ones(3))
    assert main(["verify", str(root)]) == 0
    assert "2 checked, 0 broken" in capsys.readouterr().out
    assert main(["ls", str(root), "--json"]) == 0
    listed = {c["step"]: c for c in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert listed[2]["status"] == "committed" and listed[2]["time"] == clock


def test_a_time_that_is_not_finite_is_refused() -> None:
    with pytest.raises(IncompleteCheckpointError, match="not a finite number"):
        Record.from_json({**GOOD, "time": math.inf})


def test_a_record_of_a_newer_format_is_refused_by_name_never_loaded_or_skipped(tmp_path: Path) -> None:
    import safeckpt
    from safeckpt.errors import NewerFormatError

    root = tmp_path / "root"
    with CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    path = root / "step_2" / RECORD_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), "format_version": 99}))
    said = r"newer safeckpt \(record format 99; this one reads formats up to 2\)\. Upgrade"
    with pytest.raises(NewerFormatError, match=said):
        read_record(root / "step_2")
    # Neither loaded as if it were older, nor stepped over to step 1 (training would go back).
    with pytest.raises(NewerFormatError, match=said):
        safeckpt.load(root)
    with pytest.raises(NewerFormatError, match=said):
        safeckpt.load(root, step=2)
    with pytest.raises(NewerFormatError, match=said):  # nor written beside, pruned or resumed
        CheckpointManager(root)
    assert main(["ls", str(root)]) != 0


def test_no_record_reads_as_none(ckpt: Path) -> None:
    assert read_record(ckpt) is None
    assert read_record(ckpt.parent / "nowhere") is None


def test_a_write_goes_through_a_temp_file_and_replace_under_the_lock(root_dir: Path, ckpt: Path) -> None:
    ops = LockRecordingFileOps(root_dir)
    write_record(loc(ckpt, ops), a_record(), ops.lock)  # type: ignore[arg-type]
    (write,) = ops.calls_of("write_file")
    (replace,) = ops.calls_of("replace")
    (tmp,) = write.paths
    assert tmp.parent == ckpt and tmp.name.startswith(f".{RECORD_NAME}.tmp.")
    assert replace.paths == (tmp, ckpt / RECORD_NAME)
    assert write.locked and replace.locked
    assert [c.op for c in ops.calls] == ["write_file", "replace", "fsync_dir"]
    assert ops.calls[-1].paths == (ckpt,)
    assert sorted(p.name for p in ckpt.iterdir()) == ["__0_0.distcp", RECORD_NAME, "part.bin"]


@pytest.mark.parametrize(
    "op,partial",
    [
        pytest.param("write_file", True, id="torn-write"),
        pytest.param("write_file", False, id="write-fails"),
        pytest.param("replace", False, id="replace-fails"),
    ],
)
def test_a_failed_write_leaves_the_old_record_and_no_temp_file(
    ckpt: Path, lock: SidecarLock, op: str, partial: bool
) -> None:
    ops = FaultyFileOps()
    old = a_record()
    write_record(loc(ckpt, ops), old, lock)
    ops.fail(op, errno.ENOSPC, partial=partial)
    with pytest.raises(OSError) as info:
        write_record(loc(ckpt, ops), a_record(pinned=True, extra={"x": "y" * 10_000}), lock)
    assert info.value.errno == errno.ENOSPC
    assert read_record(ckpt) == old
    assert sorted(p.name for p in ckpt.iterdir()) == ["__0_0.distcp", RECORD_NAME, "part.bin"]
    assert not lock.held()


# --- amend ---------------------------------------------------------------------------------------


def test_amend_changes_only_what_it_is_given(root_dir: Path, ckpt: Path) -> None:
    ops = LockRecordingFileOps(root_dir)
    write_record(loc(ckpt, ops), a_record(), ops.lock)  # type: ignore[arg-type]
    amended = amend_record(loc(ckpt, ops), ops.lock, pinned=True)  # type: ignore[arg-type]
    assert amended == a_record(pinned=True) == read_record(ckpt)
    assert all(c.locked for c in ops.calls_of("write_file", "replace"))


def test_amend_rereads_the_record_under_the_lock(ckpt: Path, lock: SidecarLock) -> None:
    ops = FaultyFileOps()
    write_record(loc(ckpt, ops), a_record(), lock)
    result: dict[str, Any] = {}

    def amend() -> None:
        result["record"] = amend_record(loc(ckpt, ops), lock, registration={"status": "registered"})

    with lock:  # another writer (a `safeckpt pin`, say) holds the lock ...
        amender = threading.Thread(target=amend)
        amender.start()
        amender.join(0.2)
        assert amender.is_alive(), "amend_record did not wait for the sidecar lock"
        write_record(loc(ckpt, ops), a_record(pinned=True), lock)  # ... and changes the record
    amender.join()
    # The amend saw the change made while it waited: it read the record after taking the lock.
    expected = a_record(pinned=True, registration={"status": "registered"})
    assert result["record"] == expected == read_record(ckpt)


def test_amend_without_a_record_is_an_incomplete_checkpoint(ckpt: Path, lock: SidecarLock) -> None:
    with pytest.raises(IncompleteCheckpointError, match="no record to amend") as info:
        amend_record(loc(ckpt, FaultyFileOps()), lock, pinned=True)
    assert info.value.path == str(ckpt)
    assert not lock.held()


# --- torn and invalid records -----------------------------------------------------------------------

GOOD = json.loads(encode(a_record()))


def _without(key: str) -> dict[str, Any]:
    return {k: v for k, v in GOOD.items() if k != key}


BAD_RECORDS = [
    pytest.param(encode(a_record())[:40], id="truncated"),
    pytest.param(b"", id="empty"),
    pytest.param(b"\xff\xfe\x00garbage", id="binary"),
    pytest.param(b"[1, 2]", id="not-an-object"),
    pytest.param(b"null", id="null"),
    pytest.param(json.dumps(_without("files")).encode(), id="no-files"),
    pytest.param(json.dumps(_without("step")).encode(), id="no-step"),
    pytest.param(json.dumps(_without("time")).encode(), id="no-time"),
    pytest.param(json.dumps(_without("status")).encode(), id="no-status"),
    pytest.param(json.dumps({**GOOD, "step": "5"}).encode(), id="step-a-string"),
    pytest.param(json.dumps({**GOOD, "step": True}).encode(), id="step-a-bool"),
    pytest.param(json.dumps({**GOOD, "step": 5.0}).encode(), id="step-a-float"),
    pytest.param(json.dumps({**GOOD, "time": "noon"}).encode(), id="time-not-a-number"),
    pytest.param(json.dumps({**GOOD, "files": {"a": "10"}}).encode(), id="size-a-string"),
    pytest.param(json.dumps({**GOOD, "files": ["a"]}).encode(), id="files-a-list"),
    pytest.param(json.dumps({**GOOD, "metrics": {"loss": "low"}}).encode(), id="metric-a-string"),
    pytest.param(json.dumps({**GOOD, "metrics": ["loss"]}).encode(), id="metrics-a-list"),
    pytest.param(json.dumps({**GOOD, "world_size": None}).encode(), id="world-size-null"),
]


@pytest.mark.parametrize("raw", BAD_RECORDS)
def test_a_torn_or_invalid_record_is_an_incomplete_checkpoint(ckpt: Path, raw: bytes) -> None:
    (ckpt / RECORD_NAME).write_bytes(raw)
    with pytest.raises(IncompleteCheckpointError) as info:
        read_record(ckpt)
    message = str(info.value)
    assert str(ckpt / RECORD_NAME) in message
    assert "restore another step" in message.lower()
    assert info.value.path == str(ckpt / RECORD_NAME)


def test_from_json_names_its_source() -> None:
    with pytest.raises(IncompleteCheckpointError, match="not a valid safeckpt record") as info:
        Record.from_json({"step": 1}, path="/x/metadata.json")
    assert info.value.path == "/x/metadata.json"
    assert "'files'" in str(info.value) or "files" in str(info.value)


# --- files -----------------------------------------------------------------------------------------


def test_list_files_lists_everything_but_the_record(ckpt: Path, lock: SidecarLock) -> None:
    write_record(loc(ckpt, FaultyFileOps()), a_record(), lock)
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "nested").write_bytes(b"x")  # a checkpoint is flat: a directory is no part of it
    (ckpt / ".metadata.json.tmp.0123456789ab").write_bytes(b"{")  # an interrupted amend's temp file
    assert list_files(ckpt) == {"__0_0.distcp": 10, "part.bin": 3}


FILE_PROBLEMS = [
    pytest.param({}, [], id="complete"),
    pytest.param({"extra_file_on_disk": None}, [], id="unlisted-file-is-fine"),
    pytest.param({"__0_0.distcp": "delete"}, ["__0_0.distcp is missing"], id="missing"),
    pytest.param({"part.bin": b"bb"}, ["part.bin has 2 bytes, the record says 3"], id="shorter"),
    pytest.param({"__0_0.distcp": b"a" * 11}, ["__0_0.distcp has 11 bytes, the record says 10"], id="longer"),
    pytest.param(
        {"__0_0.distcp": "delete", "part.bin": b""},
        ["__0_0.distcp is missing", "part.bin has 0 bytes, the record says 3"],
        id="two-problems-in-order",
    ),
    pytest.param({"part.bin": "fifo"}, ["part.bin is not a regular file"], id="a-fifo-is-not-read"),
]


@pytest.mark.parametrize("damage,expected", FILE_PROBLEMS)
def test_missing_or_wrong_files(ckpt: Path, damage: dict[str, Any], expected: list[str]) -> None:
    record = a_record()
    for rel, what in damage.items():
        path = ckpt / rel
        if what == "delete":
            path.unlink()
        elif what == "fifo":
            path.unlink()
            try:
                os.mkfifo(path)
            except OSError as e:  # the NFS-semantics FUSE filesystem has no FIFOs
                pytest.skip(f"no FIFOs on this filesystem ({e})")
        elif what is None:
            path.write_bytes(b"?")
        else:
            path.write_bytes(what)
    assert missing_or_wrong_files(ckpt, record) == expected


# --- input checks -------------------------------------------------------------------------------------


GOOD_METRICS = [
    pytest.param({"loss": 1}, {"loss": 1.0}, id="int"),
    pytest.param({"loss": 0.25}, {"loss": 0.25}, id="float"),
    pytest.param({"loss": float("nan")}, {"loss": None}, id="nan-becomes-none"),
    pytest.param({"loss": -math.inf}, {"loss": -math.inf}, id="inf"),
    pytest.param({"loss": np.float32(0.5), "n": np.int64(3)}, {"loss": 0.5, "n": 3.0}, id="numpy-scalars"),
    pytest.param({"loss": torch.tensor(0.5)}, {"loss": 0.5}, id="0d-tensor"),
    pytest.param({"loss": torch.tensor([0.5])}, {"loss": 0.5}, id="one-element-tensor"),
    pytest.param({"loss": torch.tensor(float("nan"))}, {"loss": None}, id="nan-tensor"),
    pytest.param(None, {}, id="none"),
    pytest.param({}, {}, id="empty"),
]


@pytest.mark.parametrize("metrics,expected", GOOD_METRICS)
def test_clean_metrics(metrics: Any, expected: dict[str, float | None]) -> None:
    cleaned = clean_metrics(metrics)
    assert cleaned == expected
    assert all(v is None or type(v) is float for v in cleaned.values())


BAD_METRICS = [
    pytest.param({1: 0.5}, "metric names must be strings, got 1", id="int-name"),
    pytest.param({"loss": "0.5"}, "metric 'loss' must be a number, got str", id="string"),
    pytest.param({"loss": True}, "metric 'loss' must be a number, got bool", id="bool"),
    pytest.param({"loss": None}, "metric 'loss' must be a number, got NoneType", id="none"),
    pytest.param({"loss": [0.5]}, "metric 'loss' must be a number, got list", id="list"),
    pytest.param({"loss": 1 + 2j}, "metric 'loss' must be a number, got complex", id="complex"),
    pytest.param({"loss": torch.ones(3)}, "metric 'loss' must be a number, got a tensor", id="tensor"),
    pytest.param({"loss": np.ones(2)}, "metric 'loss' must be a number, got a tensor", id="ndarray"),
    pytest.param({"loss": np.bool_(True)}, "metric 'loss' must be a number, got bool", id="numpy-bool"),
    pytest.param({"loss": 10**400}, "metric 'loss' is too large for a float", id="huge-int"),
    pytest.param([("loss", 0.5)], "metrics must be a dict of name -> number, got list", id="not-a-dict"),
    pytest.param("loss", "metrics must be a dict of name -> number, got str", id="a-string"),
]


@pytest.mark.parametrize("metrics,message", BAD_METRICS)
def test_bad_metrics_are_refused_with_a_clear_error(metrics: Any, message: str) -> None:
    with pytest.raises(InvalidSaveError) as info:
        clean_metrics(metrics)
    assert message in str(info.value)
    assert "nothing was written" in str(info.value).lower()


def _deep(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def _cycle() -> dict[str, Any]:
    value: dict[str, Any] = {"a": []}
    value["a"].append(value)
    return value


@pytest.mark.parametrize(
    "value",
    [
        pytest.param({"a": [1, 2.5, "x", None, True, {"b": float("nan")}]}, id="nested"),
        pytest.param({"t": (1, 2)}, id="tuple-as-list"),
        pytest.param({}, id="empty"),
        pytest.param({"shared": [[1], [1]]}, id="plain-lists"),
    ],
)
def test_json_values_pass(value: Any) -> None:
    check_json_value(value, "extra")


BAD_JSON = [
    pytest.param({"a": {1, 2}}, "extra['a']", "set", id="set"),
    pytest.param({"a": [1, object()]}, "extra['a'][1]", "object", id="object-in-list"),
    pytest.param({"a": {"b": b"bytes"}}, "extra['a']['b']", "bytes", id="bytes"),
    pytest.param({"t": torch.zeros(2)}, "extra['t']", "Tensor", id="tensor"),
    pytest.param({"p": Path("/x")}, "extra['p']", "PosixPath", id="path"),
    pytest.param({(1, 2): "tuple key"}, "the key (1, 2) of extra", "keys must be", id="tuple-key"),
    pytest.param(_cycle(), "extra['a'][0]", "Circular reference", id="cycle"),
    pytest.param({"a": _deep(100_000)}, "extra", "recursion", id="too-deep"),
]


@pytest.mark.parametrize("value,where,why", BAD_JSON)
def test_non_json_values_are_refused_naming_where(value: Any, where: str, why: str) -> None:
    with pytest.raises(InvalidSaveError) as info:
        check_json_value(value, "extra")
    message = str(info.value)
    assert f"but {where} is not" in message
    assert why in message
    assert "nothing was written" in message


def test_list_files_leaves_out_nfs_silly_rename_files(tmp_path: Path) -> None:
    (tmp_path / "__0_0.distcp").write_bytes(b"abc")
    (tmp_path / ".nfs000000000001").write_bytes(b"old copy still open elsewhere")
    (tmp_path / ".fuse_hidden0000000a00000001").write_bytes(b"same, on FUSE")
    assert list_files(tmp_path) == {"__0_0.distcp": 3}
