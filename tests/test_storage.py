"""The raw DCP storage writer and reader: the files are the ones ``FileSystemWriter`` writes
(plain ``dcp.load`` and ``torch.load`` read them), values round-trip, and reading never runs
code from the checkpoint."""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import safeckpt._dcp.io  # noqa: F401  (filters DCP's single-process warning)
from safeckpt._dcp.io import SafeLoadPlanner, reader_for
from safeckpt._storage import prefetch as early_read
from safeckpt._storage import writer as storage
from safeckpt._storage.torchsave import reader as archive_read
from safeckpt._storage.torchsave import shapes as archive_shapes
from safeckpt._storage.torchsave import writer as archive
from safeckpt._storage.writer import RawFileSystemReader, RawFileSystemWriter, raw_path_available

pytestmark = pytest.mark.skipif(
    not raw_path_available(), reason="this torch lacks the helpers; DCP's path runs"
)


def sample() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "f32": torch.randn(3, 5),
        "i64": torch.arange(10, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "bf16": torch.randn(7).bfloat16(),
        "f16": torch.randn(2, 2, 3).half(),
        "bool": torch.rand(9) > 0.5,
        "u8": torch.randint(0, 255, (33,), dtype=torch.uint8),
        "transposed": torch.randn(4, 6).t(),  # non-standard strides over its whole storage
        "view": torch.randn(20)[3:9],  # part of a larger storage: saved as a copy
        "empty": torch.empty(0, 3),
        "big": torch.randn(600_000),  # over the threshold for the parallel checksum
        "step": 3,
        "names": ["a", "b"],
    }


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def assert_equal(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype, key
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


def save_raw(state: dict[str, Any], path: Path, **kwargs: Any) -> None:
    dcp.save(state, storage_writer=RawFileSystemWriter(path, **kwargs), no_dist=True)


def archives(path: Path) -> dict[str, bytes]:
    """Each item's bytes in the checkpoint at ``path``, by fully qualified name."""
    metadata = FileSystemReader(path).read_metadata()
    out = {}
    for index, info in metadata.storage_data.items():
        data = (path / info.relative_path).read_bytes()
        out[index.fqn] = data[info.offset : info.offset + info.length]
    return out


def test_plain_dcp_load_reads_it(tmp_path: Path) -> None:
    state = sample()
    save_raw(state, tmp_path / "ckpt")
    loaded = zeros_like(state)
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert_equal(loaded, state)


@pytest.mark.parametrize("reader", [RawFileSystemReader, FileSystemReader], ids=["raw-reader", "dcp-reader"])
@pytest.mark.parametrize("writer", [RawFileSystemWriter, FileSystemWriter], ids=["raw-writer", "dcp-writer"])
def test_round_trip_every_combination(tmp_path: Path, writer: type, reader: type) -> None:
    state = sample()
    dcp.save(state, storage_writer=writer(tmp_path), no_dist=True)
    loaded = zeros_like(state)
    loaded["transposed"] = torch.zeros(4, 6).t()  # a non-contiguous destination: read, then copied
    dcp.load(loaded, storage_reader=reader(tmp_path), no_dist=True)
    assert_equal(loaded, state)


def test_same_bytes_as_torch_save_but_the_serialization_id(tmp_path: Path) -> None:
    state = sample()
    save_raw(state, tmp_path / "raw")
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    ours, theirs = archives(tmp_path / "raw"), archives(tmp_path / "dcp")
    assert ours.keys() == theirs.keys()
    for fqn, data in ours.items():
        assert len(data) == len(theirs[fqn]), fqn
        if not isinstance(state[fqn], torch.Tensor):
            assert data == theirs[fqn], fqn
            continue
        a, b = zipfile.ZipFile(io.BytesIO(data)), zipfile.ZipFile(io.BytesIO(theirs[fqn]))
        assert [(i.filename, i.header_offset, i.file_size) for i in a.infolist()] == [
            (i.filename, i.header_offset, i.file_size) for i in b.infolist()
        ], fqn
        for info in a.infolist():
            if not info.filename.endswith("serialization_id"):
                assert a.read(info) == b.read(info), (fqn, info.filename)


def _data_start(archive: bytes, info: zipfile.ZipInfo) -> int:
    """Where a member's data starts: after its local header (whose extra field holds the padding)."""
    name_len, extra_len = struct.unpack_from("<HH", archive, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


def test_archives_are_valid_zips_that_torch_load_reads(tmp_path: Path) -> None:
    state = sample()
    save_raw(state, tmp_path)
    for fqn, data in archives(tmp_path).items():
        if not isinstance(state[fqn], torch.Tensor):
            continue
        assert zipfile.ZipFile(io.BytesIO(data)).testzip() is None, fqn  # every CRC32 is right
        loaded = torch.load(io.BytesIO(data), weights_only=True)
        assert torch.equal(loaded, state[fqn]), fqn
        for info in zipfile.ZipFile(io.BytesIO(data)).infolist():
            assert _data_start(data, info) % 64 == 0, (fqn, info.filename)  # aligned, as torch.save aligns


@pytest.mark.parametrize("options", [{"thread_count": 3}, {"single_file_per_rank": False}], ids=str)
def test_file_layout_options(tmp_path: Path, options: dict[str, Any]) -> None:
    state = sample()
    save_raw(state, tmp_path, **options)
    assert len(list(tmp_path.glob("*.distcp"))) > 1
    for reader in (RawFileSystemReader, FileSystemReader):
        loaded = zeros_like(state)
        dcp.load(loaded, storage_reader=reader(tmp_path), no_dist=True)
        assert_equal(loaded, state)


def test_files_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    save_raw(sample(), tmp_path, thread_count=2)
    assert len(synced) >= 3  # two data files and .metadata


def test_a_tensor_of_4_gib_or_more_goes_through_torch_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage, "_ZIP32_LIMIT", 100)  # every tensor of 100 bytes or more
    state = sample()
    save_raw(state, tmp_path)
    loaded = zeros_like(state)
    dcp.load(loaded, storage_reader=RawFileSystemReader(tmp_path), no_dist=True)
    assert_equal(loaded, state)


def test_without_the_private_helpers_dcp_code_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archive, "_torch_save_records", None)
    state = sample()
    save_raw(state, tmp_path)
    loaded = zeros_like(state)
    dcp.load(loaded, storage_reader=RawFileSystemReader(tmp_path), no_dist=True)
    assert_equal(loaded, state)


def test_byte_items_go_through_the_planners_load_bytes(tmp_path: Path) -> None:
    state = sample()
    save_raw(state, tmp_path)
    seen: list[str] = []

    class Spy(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            seen.append(read_item.dest_index.fqn)
            super().load_bytes(read_item, value)

    loaded = zeros_like(state)
    dcp.load(loaded, storage_reader=RawFileSystemReader(tmp_path), planner=Spy(), no_dist=True)
    assert sorted(seen) == ["names", "step"]
    assert_equal(loaded, state)


def test_works_under_safeckpts_restricted_reader_and_planner(tmp_path: Path) -> None:
    """The proposed wiring: dcp_io's reader (restricted .metadata) on top of the raw reader."""

    state = sample()
    save_raw(state, tmp_path)
    loaded = zeros_like(state)
    reader = reader_for(tmp_path)
    assert isinstance(reader, RawFileSystemReader)
    dcp.load(loaded, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    assert_equal(loaded, state)


class _Attack:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (str(self.marker),))


def _plant(path: Path, fqn: str, payload: bytes) -> None:
    """Overwrite ``data.pkl`` of ``fqn``'s archive with ``payload`` (padded to the same length)."""
    info = next(i for idx, i in FileSystemReader(path).read_metadata().storage_data.items() if idx.fqn == fqn)
    file = path / info.relative_path
    data = bytearray(file.read_bytes())
    archive = zipfile.ZipFile(io.BytesIO(bytes(data[info.offset : info.offset + info.length])))
    member = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    start = info.offset + _data_start(bytes(data[info.offset : info.offset + info.length]), member)
    assert len(payload) <= member.file_size
    data[start : start + member.file_size] = payload.ljust(member.file_size, b".")  # after STOP: ignored
    file.write_bytes(bytes(data))


def test_a_planted_pickle_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    save_raw(sample(), tmp_path / "ckpt")
    _plant(tmp_path / "ckpt", "f32", pickle.dumps(_Attack(marker), protocol=2))
    loaded = zeros_like(sample())
    with pytest.raises(BaseException, match=r"(?i)unpickl|weights"):
        dcp.load(loaded, storage_reader=RawFileSystemReader(tmp_path / "ckpt"), no_dist=True)
    assert not marker.exists()


def test_layout_comes_from_the_weights_only_unpickler(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(pickle.UnpicklingError):
        archive_read._read_layout(pickle.dumps(_Attack(marker), protocol=2))
    assert not marker.exists()


def test_a_truncated_file_is_an_error_not_garbage(tmp_path: Path) -> None:
    state = sample()
    save_raw(state, tmp_path)
    data_file = next(tmp_path.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])
    with pytest.raises(BaseException):  # noqa: B017  (DCP wraps it in its CheckpointException)
        dcp.load(zeros_like(state), storage_reader=RawFileSystemReader(tmp_path), no_dist=True)


def test_writing_into_a_stream_at_an_offset() -> None:
    stream = io.BytesIO()
    stream.write(b"x" * 1000)
    tensor = torch.randn(100, 7)
    length = archive.write_tensor_archive(stream, tensor)
    written = stream.getvalue()[1000:]
    assert len(written) == length
    assert torch.equal(torch.load(io.BytesIO(written), weights_only=True), tensor)


def test_a_changed_private_helper_disables_the_fast_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def changed(*args: Any) -> None:
        raise TypeError("_save() takes 4 positional arguments but 5 were given")

    monkeypatch.setattr(archive, "_torch_save_records", changed)
    monkeypatch.setattr(archive, "_version_cache", [])  # probe again
    assert not raw_path_available()
    state = sample()
    save_raw(state, tmp_path)
    loaded = zeros_like(state)
    dcp.load(loaded, storage_reader=RawFileSystemReader(tmp_path), no_dist=True)
    assert_equal(loaded, state)


@pytest.mark.parametrize("writer", [RawFileSystemWriter, FileSystemWriter], ids=["raw-writer", "dcp-writer"])
def test_the_front_to_back_walk_agrees_with_the_zip_directory(tmp_path: Path, writer: type) -> None:
    """The reader finds a tensor from its archive's head, then checks the central directory."""
    state = sample()
    dcp.save(state, storage_writer=writer(tmp_path), no_dist=True)
    metadata = FileSystemReader(tmp_path).read_metadata()
    for index, info in metadata.storage_data.items():
        if not isinstance(state[index.fqn], torch.Tensor):
            continue
        fd = os.open(tmp_path / info.relative_path, os.O_RDONLY)
        try:
            parsed = archive_read._Archive(fd, info.offset, info.length)
            walked, listed = parsed.walk(), parsed.directory()
        finally:
            os.close(fd)
        assert walked, index.fqn
        for name, record in walked.items():
            if record.size >= 0:
                assert record == listed[name], (index.fqn, name)
            else:  # the walk stops at the record that runs past the head: the tensor's bytes
                assert (record.header, record.start) == (listed[name].header, listed[name].start)


@pytest.mark.parametrize("write_io, read_io", [("torch", "raw"), ("raw", "torch")])
def test_the_dcp_io_switch_reads_what_the_other_path_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_io: str, read_io: str
) -> None:
    from safeckpt import CheckpointManager

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("SAFECKPT_DCP_IO=torch must not use safeckpt._storage.writer")

    state = {"w": torch.arange(1000.0), "m": torch.nn.Linear(8, 4)}
    if write_io == "torch":
        monkeypatch.setattr(RawFileSystemWriter, "write_data", refuse)
    monkeypatch.setenv("SAFECKPT_DCP_IO", write_io)
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as mgr:
        mgr.save(1, state)
    fresh = {"w": torch.zeros(1000), "m": torch.nn.Linear(8, 4)}
    monkeypatch.undo()
    if read_io == "torch":
        monkeypatch.setattr(RawFileSystemReader, "read_data", refuse)
    monkeypatch.setenv("SAFECKPT_DCP_IO", read_io)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(fresh).step == 1
    assert torch.equal(fresh["w"], state["w"])
    assert torch.equal(fresh["m"].weight, state["m"].weight)


def _same_shape_state(n: int = 12) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.randn(64, 16) for i in range(n)}


@pytest.mark.parametrize("guessed", [True, False], ids=["from-metadata", "from-the-first"])
def test_archives_of_one_shape_are_parsed_in_full_at_most_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, guessed: bool
) -> None:
    """Layers repeat their shapes. The reader guesses an archive's shape from DCP's metadata (the
    archive a tensor of that dtype and size makes), or else from the first archive of its length,
    parsed in full; every other archive is checked against the guess, not parsed."""
    state = _same_shape_state()
    dcp.save(state, storage_writer=RawFileSystemWriter(tmp_path), no_dist=True)
    if not guessed:
        monkeypatch.setattr(archive_shapes, "expected_shape", lambda *_: None)
    parsed = []
    real = archive_read._Archive.directory

    def counting(self: Any) -> Any:
        parsed.append(1)
        return real(self)

    monkeypatch.setattr(archive_read._Archive, "directory", counting)
    loaded = zeros_like(state)
    dcp.load(loaded, storage_reader=RawFileSystemReader(tmp_path), no_dist=True)
    assert_equal(loaded, state)
    assert len(parsed) == (0 if guessed else 1), "12 archives of one shape"


def test_an_archive_whose_directory_differs_from_its_shape_is_parsed_and_refused(tmp_path: Path) -> None:
    """Same prefix as the archives before it, a central directory that points elsewhere: never
    loaded on the strength of the earlier archives (the CRC check is off here, so only the
    directory check stands between this file and a wrong read)."""
    state = _same_shape_state(3)
    dcp.save(state, storage_writer=RawFileSystemWriter(tmp_path), no_dist=True)
    metadata = FileSystemReader(tmp_path).read_metadata()
    last = max(metadata.storage_data.values(), key=lambda info: info.offset)
    path = tmp_path / last.relative_path
    data = bytearray(path.read_bytes())
    entry = data.index(b"PK\x01\x02", last.offset)  # the first central directory entry of the last archive
    (local,) = struct.unpack_from("<I", data, entry + 42)
    struct.pack_into("<I", data, entry + 42, local + 1)  # its local header offset, one byte off
    path.write_bytes(bytes(data))
    with pytest.raises(BaseException, match=r"local header|directory|zip"):
        dcp.load(zeros_like(state), storage_reader=RawFileSystemReader(tmp_path), no_dist=True)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 4),
        torch.randn(300_000),
        torch.zeros(0),
        torch.tensor(3.0),
        torch.arange(10, dtype=torch.int8),
        torch.randn(16_370),  # a record just under the size written on its own, with headers over it
        torch.randn(16_384),  # exactly that size
    ],
    ids=["small", "large", "empty", "0-dim", "int8", "just-under-64k", "64k"],
)
def test_an_archive_from_a_template_is_the_archive_written_in_full(
    tensor: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the first archive of a layout, the rest are written from its template: same bytes."""
    from safeckpt._storage.torchsave.zipformat import _ChecksummedStream

    def written(serial: int) -> bytes:
        monkeypatch.setattr(archive.secrets, "randbits", lambda _bits: serial)
        out = io.BytesIO()
        stream = _ChecksummedStream(out)
        archive._ArchiveWriter().write(stream, tensor)
        stream.flush()
        return out.getvalue()

    archive._templates._templates.clear()
    first, from_template, other = written(12345), written(12345), written(999)
    records = [*archive._ArchiveWriter()._records(tensor), ("version", memoryview(archive._version_record()))]
    records.append((".data/serialization_id", memoryview(f"{12345:040d}".encode())))
    in_full = io.BytesIO()
    archive._write_archive(in_full, records)
    assert first == from_template == in_full.getvalue()
    assert other != first and torch.equal(torch.load(io.BytesIO(other)), tensor)
    assert zipfile.ZipFile(io.BytesIO(other)).testzip() is None  # every CRC patched in right


@pytest.fixture
def wrong(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """For every batched archive checked (alone or in a run), whether its layout guess was wrong
    (it is then read again)."""
    from safeckpt._storage import batching as read_batch
    from safeckpt._storage import runs as read_runs

    checked: list[bool] = []
    real = read_batch.Planned.as_guessed
    real_run = read_runs.PlannedRun.as_guessed

    def counting(self: Any) -> bool:
        ok = real(self)
        checked.append(not ok)
        return ok

    def counting_run(self: Any) -> list[bool]:
        rows = real_run(self)
        checked.extend(not ok for ok in rows)
        return rows

    monkeypatch.setattr(read_batch.Planned, "as_guessed", counting)
    monkeypatch.setattr(read_runs.PlannedRun, "as_guessed", counting_run)
    return checked


def test_an_archive_of_a_known_length_but_another_layout_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrong: list[bool]
) -> None:
    """Batched reads guess an archive's layout from its length; a float32 and an int32 tensor of 8
    values have archives of the same length. The guess is checked before anything is committed,
    and the int32 one is read again and converted, not loaded as float bits."""
    state = {
        f"{kind}{i}": torch.arange(8, dtype=dtype) + i
        for i in range(3)
        for kind, dtype in (("f", torch.float32), ("i", torch.int32))
    }
    dcp.save(state, storage_writer=RawFileSystemWriter(tmp_path), no_dist=True)
    monkeypatch.setattr(archive_shapes, "expected_shape", lambda *_: None)  # guesses by length only
    loaded = {name: torch.zeros(8) for name in state}  # every target float32: ints are converted
    dcp.load(loaded, storage_reader=RawFileSystemReader(tmp_path), no_dist=True)
    for name, value in state.items():
        assert torch.equal(loaded[name], value.float()), name
    assert any(wrong), "the layouts alternate, so some guesses are wrong"
    assert not all(wrong), "and some are right"


def test_a_tensor_saved_with_other_strides_than_the_metadata_suggests_is_read_again(
    tmp_path: Path, wrong: list[bool]
) -> None:
    """The metadata's guess is a contiguous tensor; a transposed one that owns its storage is saved
    with its own strides (an archive of the same length). It is read again, and loads right."""
    base = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    state = {"t": base.t(), "c": base.clone() + 100}
    assert not state["t"].is_contiguous()
    dcp.save(state, storage_writer=RawFileSystemWriter(tmp_path), no_dist=True)
    loaded = {"t": torch.zeros(8, 4), "c": torch.zeros(4, 8)}
    dcp.load(loaded, storage_reader=RawFileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(loaded["t"], state["t"]) and torch.equal(loaded["c"], state["c"])
    assert wrong.count(True) == 1, wrong


def test_prefetch_asks_the_kernel_for_the_ranks_shard_and_leaves_anything_else_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore starts the disk on this rank's shard while it plans: a hint, never an error."""
    import threading
    import time

    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise here")
    save_raw(sample(), tmp_path)
    shard = tmp_path / "__0_0.distcp"
    advised: list[tuple[int, int, str, int]] = []
    done = threading.Event()

    def recording(fd: int, offset: int, length: int, advice: str) -> None:
        advised.append((offset, length, advice, os.fstat(fd).st_ino))
        done.set()

    monkeypatch.setattr(early_read, "advise", recording)
    early_read.prefetch(tmp_path, 0, limit=100)
    assert done.wait(10), "no read-ahead was asked for"
    assert advised == [(0, min(100, shard.stat().st_size), "POSIX_FADV_WILLNEED", shard.stat().st_ino)]
    os.mkfifo(tmp_path / "__1_0.distcp")  # a FIFO is never opened for reading (it would block)
    early_read.prefetch(tmp_path, 1)
    early_read.prefetch(tmp_path, 7)  # no such rank's file
    time.sleep(0.2)
    assert len(advised) == 1


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 5),
        torch.tensor(2.5),
        torch.empty(0, 3),
        torch.rand(9) > 0.5,
        torch.randn(4, 6).t(),  # strided over its whole storage: the storage's order, not the tensor's
        torch.randn(7).bfloat16(),  # numpy has no bfloat16
        torch.randn(2, 3, dtype=torch.complex64),
        torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        *([torch.randn(5).to(torch.float8_e4m3fn)] if hasattr(torch, "float8_e4m3fn") else []),
    ],
    ids=lambda t: f"{t.dtype}-{tuple(t.shape)}-{t.stride()}",
)
def test_an_archive_holds_the_bytes_of_the_tensors_whole_storage(tensor: torch.Tensor) -> None:
    whole = archive._bytes_of(torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()))
    assert bytes(archive._storage_bytes(tensor)) == bytes(whole)
    out = io.BytesIO()
    archive._ArchiveWriter().write(out, tensor)
    loaded = torch.load(io.BytesIO(out.getvalue()), weights_only=True)
    assert (loaded.dtype, loaded.shape, loaded.stride()) == (tensor.dtype, tensor.shape, tensor.stride())
    assert bytes(
        archive._bytes_of(torch.empty(0, dtype=torch.uint8).set_(loaded.untyped_storage()))
    ) == bytes(whole)
