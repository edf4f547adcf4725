"""Runs of small archives (safeckpt._storage.runs): many small tensors read as one buffer per run,
checked archive by archive, and never a reason to load a changed byte or to skip a tensor."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import safeckpt._dcp.io  # noqa: F401  (filters DCP's single-process warning)
from safeckpt import CheckpointManager, CorruptCheckpointError
from safeckpt._format.checksums import combine
from safeckpt._policy.retention import Retention
from safeckpt._storage import runs as read_runs
from safeckpt._storage.torchsave.writer import expected_shape
from safeckpt._storage.writer import RawFileSystemReader, RawFileSystemWriter, raw_path_available

pytestmark = pytest.mark.skipif(
    not raw_path_available(), reason="this torch lacks the helpers; DCP's path runs"
)

SMALL = 150 + 100 + 50 + 20 + 20  # the small tensors of small_state()


def small_state() -> dict[str, torch.Tensor]:
    """Groups of small tensors of one shape each, a large one between two groups, an empty one."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    state.update({f"w{i}": torch.randn(37, generator=g) for i in range(150)})
    state["big"] = torch.randn(1 << 17, generator=g)  # 512 KiB: read straight into its target
    state.update({f"b{i}": torch.randn(4, 5, generator=g).bfloat16() for i in range(100)})
    state.update({f"s{i}": torch.tensor(i * 7 - 3, dtype=torch.int64) for i in range(50)})
    state.update({f"m{i}": torch.rand(3, generator=g) > 0.5 for i in range(20)})
    state.update({f"c{i}": torch.randn(2, dtype=torch.complex64, generator=g) for i in range(20)})
    state["empty"] = torch.empty(0, 4)
    return state


@pytest.fixture
def copied(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many archives each run copied into their targets."""
    counts: list[int] = []
    real = read_runs.PlannedRun.copy_out

    def counting(self: read_runs.PlannedRun, guessed: list[bool]) -> None:
        counts.append(sum(guessed))
        real(self, guessed)

    monkeypatch.setattr(read_runs.PlannedRun, "copy_out", counting)
    return counts


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_small_tensors_restore_bit_exact_through_runs(tmp_path: Path, copied: list[int]) -> None:
    saved = small_state()
    with CheckpointManager(tmp_path / "run", async_save=False, retention=Retention()) as mgr:
        mgr.save(1, {"model": saved})
        target = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
        before = {k: v.data_ptr() for k, v in target["model"].items()}
        mgr.restore(target)
    for name, value in saved.items():
        assert _same_bits(target["model"][name], value), name
        assert target["model"][name].data_ptr() == before[name], f"{name} was not filled in place"
    assert sum(copied) == SMALL, "every small tensor went through a run"
    assert len(copied) >= 5, "one run per shape at least"


def test_a_run_converts_into_targets_of_another_dtype_and_strides(tmp_path: Path, copied: list[int]) -> None:
    """Plain ``dcp.load`` semantics: each target gets ``copy_`` of the saved tensor."""
    saved = {f"w{i}": torch.randn(6, 5) for i in range(40)}
    dcp.save(saved, storage_writer=RawFileSystemWriter(tmp_path), no_dist=True)
    wide = {name: torch.zeros(5, 6, dtype=torch.float64) for name in saved}
    loaded = {name: w.t() for name, w in wide.items()}  # non-contiguous views, float64
    dcp.load(loaded, storage_reader=RawFileSystemReader(tmp_path), no_dist=True)
    for name, value in saved.items():
        assert torch.equal(wide[name].t(), value.double()), name
    assert sum(copied) == len(saved)


def _archive_offset(directory: Path, fqn: str) -> int:
    metadata = FileSystemReader(directory).read_metadata()
    (info,) = [s for i, s in metadata.storage_data.items() if i.fqn == fqn]
    return int(info.offset)


@pytest.mark.parametrize("where", ["data", "prefix", "tail CRC", "last byte"])
def test_a_changed_byte_of_one_archive_in_a_run_is_never_loaded(
    tmp_path: Path, copied: list[int], where: str
) -> None:
    """The layout check ignores the data and the tail's CRC fields: the archive's own CRC32 covers
    every byte, and a changed prefix sends the archive down the slow path, which checks it too."""
    saved = small_state()
    root = tmp_path / "run"
    with CheckpointManager(root, async_save=False, retention=Retention()) as mgr:
        mgr.save(1, {"model": saved})
    step = root / "step_1"
    fqn = "model.w75"  # the middle of the first run
    offset = _archive_offset(step, fqn)
    shape = expected_shape(torch.float32, (37,))
    assert shape is not None
    data = shape.record.start
    at = {
        "data": data + 40,
        "prefix": 100,
        "tail CRC": data + shape.record.size + shape.masks[0][0],
        "last byte": shape.length - 1,
    }[where]
    shard = step / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[offset + at] ^= 0x5A
    shard.write_bytes(bytes(raw))
    target = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
    with CheckpointManager(root, retention=Retention()) as mgr, pytest.raises(CorruptCheckpointError) as info:
        mgr.restore(target, step=1)
    assert info.value.offset == offset and info.value.path == str(shard)
    assert copied == [], "nothing was copied out of the run that held the changed archive"


def _rows(shape: Any, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``n`` archives of ``shape`` (float32, 37 values) as one run buffer, and their tensors."""
    tensors = [torch.randn(37) for _ in range(n)]
    rows = []
    for t in tensors:
        row = bytearray(shape.prefix) + bytearray(t.numpy().tobytes()) + bytearray(shape.template)
        rows.append(torch.frombuffer(row, dtype=torch.uint8))
    return torch.cat(rows), tensors


def test_a_row_laid_out_otherwise_is_left_to_the_caller_and_the_others_are_copied() -> None:
    shape = expected_shape(torch.float32, (37,))
    assert shape is not None
    buffer, tensors = _rows(shape, 4)
    targets = [torch.zeros(37) for _ in tensors]
    run = read_runs.PlannedRun(0, shape, [None] * 4, targets)
    run.buffer.copy_(buffer)
    tail = len(shape.prefix) + shape.record.size
    run.rows()[1, 3] ^= 1  # a prefix byte
    run.rows()[2, tail + shape.masks[0][0]] ^= 1  # a CRC field of the tail: ignored by the layout check
    run.rows()[3, tail + shape.masks[0][1]] ^= 1  # the first byte after it: not ignored
    guessed = run.as_guessed()
    assert guessed == [True, False, True, False]
    run.copy_out(guessed)
    assert torch.equal(targets[0], tensors[0]) and torch.equal(targets[2], tensors[2])
    assert not targets[1].any() and not targets[3].any(), "a row left to the caller is not copied"


def test_checksums_are_one_per_archive() -> None:
    import zlib

    shape = expected_shape(torch.float32, (37,))
    assert shape is not None
    buffer, _ = _rows(shape, 3)
    run = read_runs.PlannedRun(0, shape, [None] * 3, [torch.zeros(37) for _ in range(3)])
    run.buffer.copy_(buffer)
    raw = buffer.numpy().tobytes()
    n = shape.length
    assert run.checksums() == [zlib.crc32(raw[i * n : (i + 1) * n]) for i in range(3)]


def test_only_dense_layouts_of_viewable_dtypes_go_in_runs() -> None:
    dense = expected_shape(torch.float32, (4, 5))
    assert dense is not None and read_runs.runs_as(dense.layout)
    transposed = type(dense.layout)(torch.empty(5, 4, device="meta").t(), "0", torch.float32, 80)
    assert not read_runs.runs_as(transposed)
    narrowed = type(dense.layout)(torch.empty(8, device="meta")[2:6], "0", torch.float32, 32)
    assert not read_runs.runs_as(narrowed)


def test_archives_of_one_length_but_two_layouts_in_one_run_all_load_right(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copied: list[int]
) -> None:
    """float32 and int32 tensors of 8 values have archives of the same length. Guessed by length
    alone (no guess from the metadata), a run holds both; the rows of the other layout are read
    again on their own, and every tensor loads as saved (the ints converted, not their bits)."""
    from safeckpt._storage.torchsave import shapes as archive_shapes

    state = {
        f"{kind}{i}": torch.arange(8, dtype=dtype) + i
        for i in range(12)
        for kind, dtype in (("f", torch.float32), ("i", torch.int32))
    }
    dcp.save(state, storage_writer=RawFileSystemWriter(tmp_path), no_dist=True)
    monkeypatch.setattr(archive_shapes, "expected_shape", lambda *_: None)
    loaded = {name: torch.zeros(8) for name in state}
    dcp.load(loaded, storage_reader=RawFileSystemReader(tmp_path), no_dist=True)
    for name, value in state.items():
        assert torch.equal(loaded[name], value.float()), name
    assert copied and 0 < sum(copied) < len(state) - 1, "one run, holding rows of both layouts"


def test_parameters_and_tensors_that_require_grad_are_filled_in_place_through_runs(
    tmp_path: Path, copied: list[int]
) -> None:
    saved = {f"w{i}": torch.randn(4, 3) for i in range(12)} | {f"g{i}": torch.randn(5) for i in range(12)}
    saved["gbig"] = torch.randn(1 << 17)  # read straight into its target, outside any run
    with CheckpointManager(tmp_path / "run", async_save=False, retention=Retention()) as mgr:
        mgr.save(1, {"model": saved})
        params = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in saved.items() if k[0] == "w"}
        grads = {k: torch.zeros_like(v).requires_grad_() for k, v in saved.items() if k[0] == "g"}
        target = {"model": params | grads}
        before = {k: v.data_ptr() for k, v in target["model"].items()}
        mgr.restore(target)
    for name, value in saved.items():
        got = target["model"][name]
        assert got.data_ptr() == before[name] and got.requires_grad, name
        assert torch.equal(got.detach(), value), name
    assert type(target["model"]["w0"]) is torch.nn.Parameter
    assert sum(copied) == len(saved) - 1, "both kinds of small tensor went through runs"
    # Copied into a target of another dtype (plain dcp.load semantics), as DCP's own reader does.
    dcp.save({"wide": saved["gbig"]}, storage_writer=RawFileSystemWriter(tmp_path / "dcp"), no_dist=True)
    wide = torch.zeros(1 << 17, dtype=torch.float64, requires_grad=True)
    dcp.load({"wide": wide}, storage_reader=RawFileSystemReader(tmp_path / "dcp"), no_dist=True)
    assert wide.requires_grad and torch.equal(wide.detach(), saved["gbig"].double())


def test_inference_tensors_are_filled_as_dcp_fills_them(tmp_path: Path) -> None:
    """``copy_`` into an inference tensor is refused outside inference mode, into its view it is not."""
    saved = {f"w{i}": torch.randn(3, 4) for i in range(12)}
    with CheckpointManager(tmp_path / "run", async_save=False, retention=Retention()) as mgr:
        mgr.save(1, {"model": saved})
        with torch.inference_mode():
            bases = {k: torch.zeros(4, 3) for k in saved}
            targets = {"model": {k: b.t() for k, b in bases.items()}}  # not contiguous: copied
            straight = {"model": {k: torch.zeros(3, 4) for k in saved}}  # through a run
        mgr.restore(targets)
        mgr.restore(straight)
    for k, value in saved.items():
        assert torch.equal(bases[k].t(), value) and torch.equal(straight["model"][k], value), k


def test_conjugate_and_negative_views_are_filled_as_dcp_fills_them(tmp_path: Path, copied: list[int]) -> None:
    """``_foreach_copy_`` refuses conjugate and negative views; such targets take the batch path."""
    cases = {
        "conj": (torch.complex64, torch.Tensor.conj),
        "neg": (torch.float32, lambda base: base.conj().imag),  # a float view with the negative bit
    }
    for name, (dtype, view) in cases.items():
        directory = tmp_path / name
        saved = {f"t{i}": torch.randn(3, dtype=dtype) for i in range(16)}
        dcp.save(saved, storage_writer=RawFileSystemWriter(directory), no_dist=True)
        filled = []
        for reader in (RawFileSystemReader(directory), FileSystemReader(directory)):
            bases = {k: torch.zeros(3, dtype=torch.complex64) for k in saved}
            dcp.load({k: view(b) for k, b in bases.items()}, storage_reader=reader, no_dist=True)
            filled.append(bases)
        for k in saved:
            assert torch.equal(filled[0][k], filled[1][k]) and filled[0][k].any(), (name, k)
    assert copied == [], "no run took a view that _foreach_copy_ refuses"


def _record_checksums(step: Path) -> tuple[dict[str, Any], list[list[int]]]:
    record = json.loads((step / "metadata.json").read_text())
    return record, record["checksums"]["__0_0.distcp"]["crc32"]


def _write_record_checksums(step: Path, record: dict[str, Any], rows: list[list[int]]) -> None:
    record["checksums"]["__0_0.distcp"]["crc32"] = rows
    (step / "metadata.json").write_text(json.dumps(record))


def test_a_run_checks_a_whole_file_checksum_before_it_reads(tmp_path: Path, copied: list[int]) -> None:
    """A file recorded with one segment (written by DCP's own writer) is checked whole, once. Every
    archive is in the one run here: nothing else reads the file."""
    saved = {f"w{i}": torch.randn(37) for i in range(150)}
    root = tmp_path / "run"
    with CheckpointManager(root, async_save=False, retention=Retention()) as mgr:
        mgr.save(1, {"model": saved})
    step = root / "step_1"
    shard = step / "__0_0.distcp"
    record, _ = _record_checksums(step)
    raw = bytearray(shard.read_bytes())
    _write_record_checksums(step, record, [[0, len(raw), zlib.crc32(raw)]])
    with CheckpointManager(root, retention=Retention()) as mgr:  # unchanged: it loads through runs
        target = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
        mgr.restore(target, step=1)
    assert all(torch.equal(target["model"][k], v) for k, v in saved.items())
    assert copied == [len(saved)]
    copied.clear()
    shape = expected_shape(torch.float32, (37,))
    assert shape is not None
    raw[_archive_offset(step, "model.w75") + shape.record.start + 10] ^= 0x5A  # in the tensor's bytes
    shard.write_bytes(bytes(raw))
    with CheckpointManager(root, retention=Retention()) as mgr, pytest.raises(CorruptCheckpointError):
        mgr.restore({"model": {k: torch.zeros_like(v) for k, v in saved.items()}}, step=1)
    assert copied == []


def test_a_record_whose_segments_do_not_match_the_run_is_refused(tmp_path: Path, copied: list[int]) -> None:
    """Two archives of a run under one recorded segment: the run cannot check them one by one, and
    the archive without a segment of its own is an error, not an unchecked load."""
    saved = small_state()
    root = tmp_path / "run"
    with CheckpointManager(root, async_save=False, retention=Retention()) as mgr:
        mgr.save(1, {"model": saved})
    step = root / "step_1"
    record, rows = _record_checksums(step)
    at = next(i for i, row in enumerate(rows) if row[0] == _archive_offset(step, "model.w75"))
    (o1, l1, c1), (_, l2, c2) = rows[at], rows[at + 1]
    merged = [o1, l1 + l2, combine(c1, c2, l2)]  # still the right CRC of those bytes
    _write_record_checksums(step, record, [*rows[:at], merged, *rows[at + 2 :]])
    with CheckpointManager(root, retention=Retention()) as mgr, pytest.raises(CorruptCheckpointError) as info:
        mgr.restore({"model": {k: torch.zeros_like(v) for k, v in saved.items()}}, step=1)
    assert "no checksum was recorded" in str(info.value)
    assert copied == []


def test_archives_of_one_length_but_two_dtypes_are_not_mixed_in_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copied: list[int]
) -> None:
    """With DCP's metadata the reader knows each archive's dtype: float32 and int32 tensors of 37
    values (archives of one length) alternate, and no archive is guessed wrong and read again."""
    from safeckpt._storage import reader as raw_reader

    state = {
        f"{kind}{i}": torch.arange(37, dtype=dtype) + i
        for i in range(40)
        for kind, dtype in (("f", torch.float32), ("i", torch.int32))
    }
    dcp.save(state, storage_writer=RawFileSystemWriter(tmp_path), no_dist=True)
    read_alone: list[int] = []
    real = raw_reader.RawFileSystemReader._read_archive

    def counting(self: Any, fd: int, offset: int, *args: Any) -> None:
        read_alone.append(offset)
        real(self, fd, offset, *args)

    monkeypatch.setattr(raw_reader.RawFileSystemReader, "_read_archive", counting)
    loaded = {name: torch.zeros(37, dtype=value.dtype) for name, value in state.items()}
    dcp.load(loaded, storage_reader=RawFileSystemReader(tmp_path), no_dist=True)
    assert all(torch.equal(loaded[name], value) for name, value in state.items())
    assert read_alone == [] and copied == []


def test_targets_a_run_cannot_take_are_found_without_scanning_the_run_again_and_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copied: list[int]
) -> None:
    """Where the targets cannot take a run (CUDA tensors, conjugate views), every archive of the
    batches is asked whether a run starts there: each asking looks at a few archives, not at the
    whole run after it (which made a restore of n such tensors cost n * n / 2 checks)."""
    from safeckpt._storage.torchsave import shapes as archive_shapes

    n = 600
    saved = {f"c{i}": torch.randn(3, dtype=torch.complex64) for i in range(n)}
    dcp.save(saved, storage_writer=RawFileSystemWriter(tmp_path), no_dist=True)
    guesses = [0]
    real = archive_shapes.ArchiveShapes.guess

    def counting(self: Any, *args: Any) -> Any:
        guesses[0] += 1
        return real(self, *args)

    monkeypatch.setattr(archive_shapes.ArchiveShapes, "guess", counting)
    bases = {k: torch.zeros(3, dtype=torch.complex64) for k in saved}
    views = {k: b.conj() for k, b in bases.items()}
    dcp.load(views, storage_reader=RawFileSystemReader(tmp_path), no_dist=True)
    assert all(torch.equal(bases[k], saved[k].conj()) for k in saved)
    assert copied == []
    assert guesses[0] < 12 * n, guesses[0]


def test_small_archives_between_large_ones_are_guessed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bias after each weight (a model's usual order): no run can start at a small archive whose
    neighbours are large, and the reader sees that from the offsets, without guessing the
    neighbours' shapes (it guessed every archive about twice)."""
    from safeckpt._storage.torchsave import shapes as archive_shapes

    saved: dict[str, torch.Tensor] = {}
    for i in range(100):
        saved[f"w{i}"], saved[f"b{i}"] = torch.randn(256, 256), torch.randn(16)
    dcp.save(saved, storage_writer=RawFileSystemWriter(tmp_path), no_dist=True)
    guesses = [0]
    real = archive_shapes.ArchiveShapes.guess

    def counting(self: Any, *args: Any) -> Any:
        guesses[0] += 1
        return real(self, *args)

    monkeypatch.setattr(archive_shapes.ArchiveShapes, "guess", counting)
    loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(loaded, storage_reader=RawFileSystemReader(tmp_path), no_dist=True)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert guesses[0] <= len(saved), guesses[0]
