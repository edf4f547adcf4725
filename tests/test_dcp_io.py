"""DCP files without pickle: what safeckpt writes loads with plain DCP; what a checkpoint asks
to run is refused (and never runs: each attack would create a marker file)."""

from __future__ import annotations

import builtins
import dataclasses
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from safeckpt import CheckpointManager
from safeckpt._dcp import io as dcp_io
from safeckpt._dcp import safe_metadata
from safeckpt._dcp.io import SafeLoadPlanner, load, reader_for, save
from safeckpt._dcp.safe_metadata import METADATA_NAME, read_metadata
from safeckpt._format.checksums import FileChecksum, read_verified
from safeckpt._format.record import list_files, read_record, write_record
from safeckpt._fs.fileops import FileOps
from safeckpt._fs.lock import SidecarLock
from safeckpt._storage.reader import RawFileSystemReader
from safeckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from stores import loc


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def assert_same(
    model: nn.Module, optim: torch.optim.Optimizer, other: nn.Module, other_optim: Any, *, hyper: bool = True
) -> None:
    """The same weights and moments; and (``hyper``) the same hyper-parameters, which live in
    safeckpt's train-state file, so plain ``dcp.load`` does not bring them."""
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        mine, theirs = optim.state[p], other_optim.state[q]
        assert set(mine) == set(theirs) == {"step", "exp_avg", "exp_avg_sq"}
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), key
    if hyper:
        assert other_optim.param_groups[0]["lr"] == 0.01
        assert tuple(other_optim.param_groups[0]["betas"]) == (0.8, 0.9)


def saved_checkpoint(root: Path, step: int = 1) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    model, optim = trained()
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(step, {"model": model, "optim": optim, "epoch": 3})
    return root / f"step_{step}", model, optim


# --- compatibility ---------------------------------------------------------------------------------


def _tensors_only(tree: Any) -> Any:
    """``tree`` without its non-tensor leaves: those (an optimizer's lr, say) are in safeckpt's
    train-state file, not in DCP's files; every tensor is in DCP's."""
    if isinstance(tree, dict):
        kept = {k: _tensors_only(v) for k, v in tree.items()}
        return {k: v for k, v in kept.items() if v is not None and v != {}}
    if isinstance(tree, list):
        kept = [_tensors_only(v) for v in tree]
        return kept if any(v not in (None, {}) for v in kept) else None
    return tree if isinstance(tree, torch.Tensor) else None


def _load_into_fresh(directory: Path, loader: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    other, other_optim = fresh()
    full = {"model": get_model_state_dict(other), "optim": get_optimizer_state_dict(other, other_optim)}
    tensors = _tensors_only(full)
    loader(tensors, directory)  # fills the tensors of `full` in place
    set_model_state_dict(other, full["model"])
    set_optimizer_state_dict(other, other_optim, full["optim"])
    return other, other_optim


def test_a_safeckpt_checkpoint_loads_with_plain_dcp(root: Path) -> None:
    directory, model, optim = saved_checkpoint(root)
    other, other_optim = _load_into_fresh(directory, lambda sd, d: dcp.load(sd, checkpoint_id=d))
    assert_same(model, optim, other, other_optim, hyper=False)


def test_the_safe_reader_loads_the_same(root: Path) -> None:
    directory, model, optim = saved_checkpoint(root)
    other, other_optim = _load_into_fresh(directory, lambda sd, d: load(sd, d, None))
    assert_same(model, optim, other, other_optim, hyper=False)


def test_read_metadata_admits_what_dcp_metadata_is_made_of(root: Path) -> None:
    state = {
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "i64": torch.arange(4),
        "channels_last": torch.ones(1, 2, 2, 2).to(memory_format=torch.channels_last),
        "scalar": 3.5,
        "nested": {"list": [1, "two", (3.0,)]},
    }
    save(state, root, None)
    metadata = read_metadata(root)
    with open(root / METADATA_NAME, "rb") as f:
        assert metadata == pickle.load(f)  # the same object plain pickle would build
    target: dict[str, Any] = {
        "bf16": torch.zeros(3, dtype=torch.bfloat16),
        "i64": torch.zeros(4, dtype=torch.int64),
        "channels_last": torch.zeros(1, 2, 2, 2),
        "scalar": 0.0,
        "nested": {"list": None},
    }
    load(target, root, None)
    assert torch.equal(target["bf16"], state["bf16"]) and torch.equal(target["i64"], state["i64"])
    assert target["scalar"] == 3.5 and target["nested"] == {"list": [1, "two", (3.0,)]}


def test_the_safe_reader_is_a_filesystem_reader(root: Path) -> None:
    save({"w": torch.ones(2)}, root, None)
    reader = reader_for(root)
    metadata = reader.read_metadata()
    assert metadata.storage_meta is not None and metadata.storage_meta.load_id == reader.load_id
    target = {"w": torch.zeros(2)}
    dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner())
    assert torch.equal(target["w"], torch.ones(2))


# --- malicious .metadata ---------------------------------------------------------------------------


class Attack:
    """Unpickling this object runs ``call(*args)``."""

    def __init__(self, call: Any, *args: Any) -> None:
        self.call, self.args = call, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.call, self.args)


def attacks(marker: Path) -> dict[str, Any]:
    return {
        "os.system": Attack(os.system, f"touch {marker}"),
        "builtins.eval": Attack(builtins.eval, f"open({str(marker)!r}, 'w').write('pwned')"),
        "builtins.exec": Attack(builtins.exec, f"open({str(marker)!r}, 'w').write('pwned')"),
    }


ATTACKS = ["os.system", "builtins.eval", "builtins.exec"]
PROTOCOLS = [0, 2, pickle.HIGHEST_PROTOCOL]


def test_the_attacks_work_on_plain_pickle(tmp_path: Path) -> None:
    # A control: each payload really runs its code when unpickled without restrictions.
    for name in ATTACKS:
        marker = tmp_path / f"marker-{name}"
        pickle.loads(pickle.dumps(attacks(marker)[name]))
        assert marker.exists(), name


def plant_metadata(directory: Path, payload: bytes) -> None:
    """Replace a checkpoint's .metadata, and its record's sizes too, as an attacker would."""
    (directory / METADATA_NAME).write_bytes(payload)
    record = read_record(directory)
    assert record is not None
    lock = SidecarLock(directory.parent / ".lock")
    files = list_files(loc(directory))
    checksums = dict(record.checksums or {})
    # consistent, so only the restricted unpickler stops it
    checksums[METADATA_NAME] = FileChecksum.whole(payload).to_json()
    amended = dataclasses.replace(record, files=files, checksums=checksums)
    write_record(loc(directory, FileOps()), amended, lock)
    safe_metadata.forget_parsed()


@pytest.mark.parametrize("name", ATTACKS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_malicious_metadata_is_refused_and_never_runs(tmp_path: Path, name: str, protocol: int) -> None:
    marker = tmp_path / "marker"
    directory = tmp_path / "ckpt"
    save({"w": torch.ones(2)}, directory, None)
    (directory / METADATA_NAME).write_bytes(pickle.dumps(attacks(marker)[name], protocol=protocol))
    with pytest.raises(UnsafeCheckpointError) as info:
        read_metadata(directory)
    message = str(info.value)
    assert str(directory / METADATA_NAME) in message
    assert "refuses to load it" in message and "could run code" in message
    assert info.value.path == str(directory / METADATA_NAME)
    with pytest.raises(UnsafeCheckpointError):
        load({"w": torch.zeros(2)}, directory, None)
    assert not marker.exists()


def test_an_attack_hidden_inside_real_metadata_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    save({"w": torch.ones(2)}, tmp_path / "ckpt", None)
    metadata = read_metadata(tmp_path / "ckpt")
    metadata.planner_data = {"w": attacks(marker)["builtins.eval"]}
    (tmp_path / "ckpt" / METADATA_NAME).write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match=r"builtins\.eval"):
        read_metadata(tmp_path / "ckpt")
    assert not marker.exists()


@pytest.mark.parametrize(
    "module,name",
    [
        ("torch", "load"),
        ("torch.serialization", "load"),
        ("torch.distributed.checkpoint.metadata", "dataclass"),  # a function in an admitted module
        ("torch.distributed.checkpoint.metadata", "Metadata.__init__"),
        ("torch", "Size.__class__"),
        ("pathlib", "Path.write_text"),
        ("collections", "namedtuple"),
        ("copyreg", "_reconstructor"),
        ("subprocess", "Popen"),
    ],
)
def test_only_dcp_metadata_globals_are_admitted(tmp_path: Path, module: str, name: str) -> None:
    # GLOBAL opcode (protocol 0), naming the global directly.
    payload = f"c{module}\n{name}\n.".encode()
    (tmp_path / METADATA_NAME).write_bytes(payload)
    with pytest.raises(UnsafeCheckpointError, match=re.escape(f"asks to load {module}.{name},")):
        read_metadata(tmp_path)


def test_a_malicious_metadata_is_refused_by_restore(root: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    saved_checkpoint(root, step=1)
    directory, _, _ = saved_checkpoint(root, step=2)
    plant_metadata(directory, pickle.dumps(attacks(marker)["os.system"]))
    model, optim = fresh()
    with CheckpointManager(root, async_save=False) as mgr:
        with pytest.raises(UnsafeCheckpointError, match="could run code"):
            mgr.restore({"model": model, "optim": optim, "epoch": 0}, step=2)
        # step 2 is the newest commit: auto-resume refuses it too rather than loading it.
        with pytest.raises(UnsafeCheckpointError):
            mgr.restore({"model": model, "optim": optim, "epoch": 0})
        assert mgr.restore({"model": model, "optim": optim, "epoch": 0}, step=1).step == 1
    assert not marker.exists()


# --- malicious non-tensor values (BYTE_IO items) -------------------------------------------------------


@pytest.mark.parametrize("name", ATTACKS)
def test_a_malicious_value_is_refused_by_the_planner(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "marker"
    directory = tmp_path / "ckpt"
    # DCP saves a non-tensor value with torch.save: a crafted checkpoint can hold any pickle there.
    save({"lr": attacks(marker)[name], "w": torch.ones(2)}, directory, None)
    read_metadata(directory)  # the metadata itself is clean
    target = {"lr": 0.0, "w": torch.zeros(2)}
    with pytest.raises(UnsafeCheckpointError) as info:
        load(target, directory, None)
    assert "'lr'" in str(info.value) and "will not unpickle it" in str(info.value)
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, Exception)
    assert not marker.exists()
    assert target["lr"] == 0.0


def test_what_is_parsed_is_kept_within_a_read_and_forgotten_after_it(root: Path) -> None:
    directory, _, _ = saved_checkpoint(root)
    record = read_record(directory)
    outside = read_metadata(directory, record=record)
    assert read_metadata(directory, record=record) is not outside  # nothing held between reads
    assert safe_metadata.checksums_of(record, directory) is not safe_metadata.checksums_of(record, directory)
    with safe_metadata.parsed_kept():
        first, checksums = (
            read_metadata(directory, record=record),
            safe_metadata.checksums_of(record, directory),
        )
        with safe_metadata.parsed_kept():  # nested: the same
            assert read_metadata(directory, record=record) is first
        assert read_metadata(directory, record=record) is first  # kept: a restore asks several times
        assert safe_metadata.checksums_of(record, directory) is checksums
        safe_metadata.forget_parsed()  # as a new process starts (benchmarks)
        again = read_metadata(directory, record=record)
        assert again is not first and again.state_dict_metadata == first.state_dict_metadata
        assert safe_metadata.checksums_of(record, directory) is not checksums
    assert not safe_metadata._last_parsed and not safe_metadata._parsed_checksums  # the outermost scope ended


def test_a_verified_read_is_kept_only_for_its_checksum_and_only_inside_a_scope(tmp_path: Path) -> None:
    path = loc(tmp_path / "f")
    (tmp_path / "f").write_bytes(b"one")
    one = FileChecksum.whole(b"one")
    assert read_verified(path, size=3, checksum=one, step=1) == b"one"
    (tmp_path / "f").write_bytes(b"ONE")
    with pytest.raises(CorruptCheckpointError):  # outside a scope: read every time
        read_verified(path, size=3, checksum=one, step=1)
    (tmp_path / "f").write_bytes(b"one")
    with safe_metadata.parsed_kept():
        assert read_verified(path, size=3, checksum=one, step=1) == b"one"
        (tmp_path / "f").unlink()
        assert read_verified(path, size=3, checksum=one, step=1) == b"one"  # the bytes it promised, kept
        (tmp_path / "f").write_bytes(b"two")  # replaced, with a record of its own: read anew
        assert read_verified(path, size=3, checksum=FileChecksum.whole(b"two"), step=2) == b"two"
        assert read_verified(path, size=3, checksum=None, step=2) == b"two"
        (tmp_path / "f").write_bytes(b"xxx")
        assert read_verified(path, size=3, checksum=None, step=2) == b"xxx"  # nothing promised: never kept
    with pytest.raises(CorruptCheckpointError):  # the scope ended: nothing kept
        read_verified(path, size=3, checksum=one, step=1)


def test_a_restore_or_load_keeps_nothing_parsed_after_it(root: Path) -> None:
    state = {"w": torch.arange(6.0), "n": {"b": torch.ones(3)}}
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, state)
        unpickled = []
        real = safe_metadata._unpickle_metadata
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(safe_metadata, "_unpickle_metadata", lambda *a: unpickled.append(1) or real(*a))
            target = {"w": torch.zeros(6), "n": {"b": torch.zeros(3)}}
            assert mgr.restore(target).step == 1 and torch.equal(target["w"], state["w"])
            assert unpickled == [1]  # once, though verify, the key check and the reader all read it
            assert not safe_metadata._last_parsed and not safe_metadata._parsed_checksums
            loaded = mgr.load()
            assert torch.equal(loaded["n"]["b"], state["n"]["b"]) and unpickled == [1, 1]
            assert not safe_metadata._last_parsed and not safe_metadata._parsed_checksums


# --- damaged metadata -----------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 1, 0.5, -1], ids=["empty", "one-byte", "half", "all-but-one"])
def test_a_truncated_metadata_is_an_incomplete_checkpoint(tmp_path: Path, keep: float) -> None:
    save({"w": torch.ones(2), "b": 1.5}, tmp_path, None)
    raw = (tmp_path / METADATA_NAME).read_bytes()
    cut = int(len(raw) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(raw) + keep)
    (tmp_path / METADATA_NAME).write_bytes(raw[:cut])
    with pytest.raises(IncompleteCheckpointError) as info:
        read_metadata(tmp_path)
    assert "is not readable DCP metadata" in str(info.value) and "Restore another one" in str(info.value)
    assert info.value.path == str(tmp_path / METADATA_NAME)


def test_a_missing_metadata_is_an_incomplete_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(IncompleteCheckpointError, match=r"has no \.metadata"):
        read_metadata(tmp_path)


def test_metadata_that_is_not_dcp_metadata_is_refused(tmp_path: Path) -> None:
    (tmp_path / METADATA_NAME).write_bytes(pickle.dumps(torch.Size([1, 2])))
    with pytest.raises(IncompleteCheckpointError, match="holds a Size, not DCP metadata"):
        read_metadata(tmp_path)


# --- whole-tensor load plans ------------------------------------------------------------------


def _plans(state: dict[str, Any], directory: Path) -> tuple[Any, Any]:
    """(safeckpt's local plan, DCP's) for loading ``directory`` into ``state``."""
    metadata = read_metadata(directory)
    ours, theirs = SafeLoadPlanner(), SafeLoadPlanner()
    ours.set_up_planner(state, metadata, True)
    theirs.set_up_planner(state, metadata, True)
    return ours.create_local_plan(), super(SafeLoadPlanner, theirs).create_local_plan()


def test_a_whole_tensor_plan_is_the_one_dcp_makes(tmp_path: Path) -> None:
    state = {
        "w": torch.randn(3, 4),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "ints": torch.arange(7, dtype=torch.int16),
        "nested": {"a": torch.randn(2, 2, 2), "b": [torch.ones(5), torch.zeros(1)]},
    }
    save(state, tmp_path, None)
    target = {k: v for k, v in state.items()}
    ours, theirs = _plans(target, tmp_path)
    # Field by field: ours are tuples of ReadItem's fields, not ReadItems (cheaper to make).
    fields = [f.name for f in dataclasses.fields(ReadItem)]
    assert [tuple(getattr(i, f) for f in fields) for i in ours.items] == [
        tuple(getattr(i, f) for f in fields) for i in theirs.items
    ]
    assert len(ours.items) == 6  # none for the empty tensor, as DCP
    for a, b in zip(ours.items, theirs.items, strict=True):
        assert (a.dest_index.index, a.storage_index.index) == (b.dest_index.index, b.storage_index.index)
        assert type(a.lengths) is type(b.lengths) and type(a.dest_offsets) is type(b.dest_offsets)


def test_anything_but_whole_plain_tensors_is_planned_by_dcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save({"w": torch.randn(4, 4), "v": torch.randn(3)}, tmp_path, None)
    metadata = read_metadata(tmp_path)
    assert dcp_io._whole_tensor_plan({"w": torch.zeros(4, 4), "v": torch.zeros(3)}, metadata) is not None
    assert dcp_io._whole_tensor_plan({"w": torch.zeros(4, 4)}, metadata) is None  # partial
    assert dcp_io._whole_tensor_plan({"w": torch.zeros(4, 4), "x": torch.zeros(3)}, metadata) is None
    assert dcp_io._whole_tensor_plan({"w": torch.zeros(2, 8), "v": torch.zeros(3)}, metadata) is None
    assert dcp_io._whole_tensor_plan({"w": torch.zeros(4, 4), "v": 3}, metadata) is None
    with pytest.raises(ValueError, match="Size mismatch"):  # DCP's own error, as before
        _plans({"w": torch.zeros(2, 8), "v": torch.zeros(3)}, tmp_path)
    asked = []
    real = dcp_io.DefaultLoadPlanner.create_local_plan
    monkeypatch.setattr(
        dcp_io.DefaultLoadPlanner, "create_local_plan", lambda self: (asked.append(1), real(self))[1]
    )
    loaded = {"w": torch.zeros(4, 4), "v": torch.zeros(3)}
    load(loaded, tmp_path, None)
    assert asked == [] and loaded["w"].abs().sum() > 0  # planned here, loaded right


def test_a_restore_in_one_process_reads_whole_tensors_without_dcp_load(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, model, optim = saved_checkpoint(root)
    calls: list[int] = []
    real = dcp.load
    monkeypatch.setattr(dcp_io.dcp, "load", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    other, other_optim = fresh()
    weights = [p.data_ptr() for p in other.parameters()]
    with CheckpointManager(root) as mgr:
        assert mgr.restore({"model": other, "optim": other_optim, "epoch": 0}).step == 1
    assert_same(model, optim, other, other_optim)
    assert [p.data_ptr() for p in other.parameters()] == weights  # in place
    assert calls == []  # read as planned here
    # Part of the checkpoint (a plan DCP makes: not every saved tensor is asked for) is dcp.load's.
    part, _ = fresh()
    with CheckpointManager(root) as mgr:
        mgr.restore({"model": part, "optim": torch.optim.AdamW(part.parameters())}, include=["model"])
    assert calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), part.parameters(), strict=True))


def test_an_unexpected_error_while_reading_whole_tensors_fails_the_restore_as_dcp_load_does(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved_checkpoint(root)

    def failing(*_: Any) -> None:
        raise OSError(5, "Input/output error")

    failures = {}
    for io in ("raw", "torch"):  # whole tensors read here, and through dcp.load
        monkeypatch.setenv("SAFECKPT_DCP_IO", io)
        monkeypatch.setattr(RawFileSystemReader, "_read_file", failing)
        monkeypatch.setattr(FileSystemReader, "read_data", failing)
        monkeypatch.setattr(RawFileSystemReader, "_read_file_public", failing)  # torch privates off
        other, other_optim = fresh()
        with CheckpointManager(root) as mgr, pytest.raises(IncompleteCheckpointError) as raised:
            mgr.restore({"model": other, "optim": other_optim, "epoch": 0}, step=1)
        failures[io] = raised.value
    for error in failures.values():
        assert "loading step 1" in str(error) and "Input/output error" in str(error)
        assert error.step == 1


@pytest.mark.parametrize("damage", ["no storage data", "chunks not a list"])
def test_a_metadata_the_whole_tensor_plan_cannot_read_fails_as_dcp_load_does(root: Path, damage: str) -> None:
    directory, _, _ = saved_checkpoint(root)
    metadata = read_metadata(directory)
    if damage == "no storage data":
        metadata.storage_data = None
    else:
        next(iter(metadata.state_dict_metadata.values())).chunks = None
    plant_metadata(directory, pickle.dumps(metadata))
    other, other_optim = fresh()
    with CheckpointManager(root) as mgr, pytest.raises(IncompleteCheckpointError, match="loading step 1"):
        mgr.restore({"model": other, "optim": other_optim, "epoch": 0}, step=1)


def test_the_flattening_of_a_nested_state_is_dcps() -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from safeckpt._dcp.nesting import flatten_nested, nest_for_dcp

    flat = {
        "step": torch.tensor(3),
        "model.w": torch.randn(2, 3),
        "model.layers.0.b": torch.randn(3),
        "optim.state.model%2Ew.exp_avg": torch.randn(2, 3),
        "é x/y": torch.randn(1),
        "p": nn.Parameter(torch.randn(2)),
    }
    nested = nest_for_dcp(flat)
    ours = flatten_nested(nested)
    assert ours is not None
    theirs = flatten_state_dict(nested)
    assert list(ours[0]) == list(theirs[0]) and ours[1] == theirs[1]
    assert all(ours[0][k] is theirs[0][k] for k in theirs[0])


@pytest.mark.parametrize(
    "nested",
    [
        {"a": torch.empty(2, device="meta")},  # DCP materializes meta tensors
        {"a": {1: torch.ones(1)}},
        {1: torch.ones(1)},
        {"a": [torch.ones(1)]},
        {"a": {}},
        {"a": {"b": 3}},
        {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}},  # DCP raises its own error
        {"a": {"b": {"c": torch.ones(1)}}},
    ],
    ids=["meta", "int-key", "int-top-key", "list", "empty", "non-tensor", "duplicate", "deeper"],
)
def test_any_other_shape_is_flattened_by_dcp(nested: dict[Any, Any]) -> None:
    from safeckpt._dcp.nesting import flatten_nested

    assert flatten_nested(nested) is None


def test_the_planner_resolves_whole_tensors_itself_and_everything_else_as_dcp_does() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    state = {"w": torch.zeros(4, 6), "p": nn.Parameter(torch.zeros(3)), "s": torch.zeros(())}
    ours, theirs = SafeLoadPlanner(), DefaultLoadPlanner()
    ours.set_up_planner(state)
    theirs.set_up_planner(state)

    def item(fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...], index_offset: Any = None) -> Any:
        index = MetadataIndex(fqn, index_offset if index_offset is not None else [0] * len(lengths), 0)
        zeros = torch.Size([0] * len(lengths))
        return ReadItem(LoadItemType.TENSOR, index, torch.Size(offsets), index, zeros, torch.Size(lengths))

    for read in (item("w", (0, 0), (4, 6)), item("p", (0,), (3,)), item("s", (), ())):
        assert ours.resolve_tensor(read) is state[read.dest_index.fqn]  # the whole tensor itself
    for read in (item("w", (1, 0), (2, 6)), item("w", (0, 0), (4, 3)), item("p", (1,), (2,))):
        mine, dcps = ours.resolve_tensor(read), theirs.resolve_tensor(read)
        assert (mine.shape, mine.stride(), mine.data_ptr()) == (dcps.shape, dcps.stride(), dcps.data_ptr())
    for planner in (ours, theirs):  # a shard offset on a plain tensor, and a key the state lacks
        with pytest.raises(ValueError):
            planner.resolve_tensor(item("w", (0, 0), (4, 6), index_offset=[2, 0]))
        with pytest.raises(ValueError):  # zeros, but not of the tensor's rank
            planner.resolve_tensor(item("w", (0, 0), (4, 6), index_offset=[0]))
        with pytest.raises(ValueError):
            planner.resolve_tensor(item("x", (0,), (3,)))
