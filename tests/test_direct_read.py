"""O_DIRECT reads of cold files: the same bytes as a buffered read, fallbacks, and restores through them."""

from __future__ import annotations

import errno
import itertools
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_common import evict  # fsync, then drop from the page cache: a file or a whole directory
from safeckpt import CheckpointManager, Retention
from safeckpt._dcp import options
from safeckpt._fs import direct_read as direct_read
from safeckpt._fs.direct_read import ALIGN, DirectFileReader
from safeckpt._storage import prefetch as early_read
from safeckpt._storage import reader as raw_reader
from safeckpt._storage.batching import ReadAhead, windows
from safeckpt._storage.writer import raw_path_available
from safeckpt.errors import CorruptCheckpointError

MIB = 1 << 20

# A restore reads a cold shard with O_DIRECT on the raw DCP reader only (torch's private serialization
# helpers; SAFECKPT_TORCH_PRIVATE=0 runs the public fallback, which reads each item buffered).
needs_raw_reader = pytest.mark.skipif(not raw_path_available(), reason="O_DIRECT restores: raw reader only")


@pytest.fixture
def cold(tmp_path: Path) -> tuple[Path, bytes]:
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    data = os.urandom(3 * MIB + 123)
    (tmp_path / "f").write_bytes(data)
    evict(tmp_path / "f")
    return tmp_path / "f", data


def _reader(path: Path) -> tuple[int, DirectFileReader]:
    fd = os.open(path, os.O_RDONLY)
    reader = DirectFileReader.for_file(fd, 0)
    assert reader is not None, "the disk here takes O_DIRECT: the fast path must run (else nothing tests it)"
    return fd, reader


def test_unaligned_ranges_come_back_exact(cold: tuple[Path, bytes]) -> None:
    path, data = cold
    fd, reader = _reader(path)
    with reader:
        for offset, length in [
            (0, 1),
            (1, 4095),
            (4095, 2),
            (12345, MIB),
            (len(data) - 10, 10),
            (len(data), 0),
        ]:
            staged = reader.read(offset, length)
            assert staged is not None
            out = bytearray(length)
            staged.copy_into([out])
            staged.release()
            assert bytes(out) == data[offset : offset + length], (offset, length)
    os.close(fd)


def test_copies_split_across_targets_and_a_size_mismatch_is_refused(cold: tuple[Path, bytes]) -> None:
    path, data = cold
    fd, reader = _reader(path)
    with reader:
        staged = reader.read(100, 300_000)
        assert staged is not None
        parts = [bytearray(7), bytearray(200_000), bytearray(99_993)]  # one above the GIL-free size
        staged.copy_into(parts)
        assert b"".join(parts) == data[100:300_100]
        with pytest.raises(ValueError, match="staged"):
            staged.copy_into([bytearray(5)])
        larger = [bytearray(300_000), bytearray(1)]
        with pytest.raises(ValueError, match="staged"):
            staged.copy_into(larger)
        assert not any(larger[0]), "nothing is copied before the sizes are checked"
        staged.release()
    os.close(fd)


def test_past_the_end_and_too_large_are_errors(cold: tuple[Path, bytes]) -> None:
    path, data = cold
    fd, reader = _reader(path)
    with reader:
        with pytest.raises(EOFError):
            reader.read(len(data) - 5, 10)
        with pytest.raises(ValueError, match="larger"):
            reader.read(1, DirectFileReader.window)  # rounded out: one page more
        with pytest.raises(ValueError, match="non-negative"):
            reader.read(0, -1)
        assert reader.read(0, 10) is not None  # the buffers went back after each error
    os.close(fd)


def test_buffers_are_reused(cold: tuple[Path, bytes]) -> None:
    path, _ = cold
    fd, reader = _reader(path)
    with reader:
        for k in range(10):
            staged = reader.read(k * 4096, 4096)
            assert staged is not None
            staged.release()
        assert reader._taken == 1
    os.close(fd)


def test_a_warm_file_is_read_buffered(cold: tuple[Path, bytes]) -> None:
    path, data = cold
    assert path.read_bytes() == data  # now in the page cache
    fd = os.open(path, os.O_RDONLY)
    assert DirectFileReader.for_file(fd, 0) is None
    os.close(fd)


def test_switched_off_by_the_environment(cold: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = cold
    monkeypatch.setenv("SAFECKPT_DIRECT_IO", "0")
    fd = os.open(path, os.O_RDONLY)
    assert DirectFileReader.for_file(fd, 0, enabled=options.defaults().direct_io) is None
    os.close(fd)


def test_refused_at_the_first_read_then_buffered(
    cold: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """FUSE takes O_DIRECT at open and refuses the read: the reader says so; later failures are raised."""
    path, _ = cold
    fd, reader = _reader(path)
    real = os.preadv
    failing = {"errno": errno.EINVAL}

    def preadv(fd_: int, buffers: list, offset: int, *flags: int) -> int:
        if fd_ == reader._fd and failing["errno"]:
            raise OSError(failing["errno"], "refused")
        return real(fd_, buffers, offset, *flags)

    monkeypatch.setattr(direct_read.os, "preadv", preadv)
    with reader:
        assert reader.read(0, 10) is None and reader.refused
        assert reader.read(0, 10) is None
    os.close(fd)
    fd, reader = _reader(path)
    with reader:
        failing["errno"] = 0
        assert reader.read(0, 10) is not None
        failing["errno"] = errno.EINVAL  # after a read that worked, EINVAL is an error, not a refusal
        with pytest.raises(OSError):
            reader.read(0, 10)
    os.close(fd)


_WINDOW = DirectFileReader.window


@pytest.mark.parametrize("start", [0, 1, ALIGN - 1, ALIGN, 3 * ALIGN + 17])
@pytest.mark.parametrize("length", [1, ALIGN, 5 * MIB, _WINDOW, 2 * _WINDOW + 99])
def test_windows_tile_a_range_in_whole_buffers(start: int, length: int) -> None:
    size = DirectFileReader.window
    pieces = windows(start, start + length, size)
    assert pieces[0][0] == start and pieces[-1][1] == start + length
    assert all(a == b for (_, a), (b, _) in itertools.pairwise(pieces))  # adjacent, no gap, no overlap
    assert all(b % ALIGN == 0 for _, b in pieces[:-1])  # they meet at page boundaries: no page read twice
    spans = [_span(a, b - a) for a, b in pieces]
    assert all(span == size for span in spans[:-1]) and spans[-1] <= size


# --- restores through the direct path ----------------------------------------------------------


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return {
        "big": torch.randn(6 * MIB),  # 24 MiB: more than one buffer, read in several windows
        "mid": torch.randn(1 * MIB, dtype=torch.float64),
        "small": [torch.randn(333) for _ in range(20)],
        "ints": torch.randint(-9, 9, (3 * MIB + 1,), dtype=torch.int32),
    }


def _zeros(state: dict) -> dict:
    return {
        k: [torch.zeros_like(x) for x in v] if isinstance(v, list) else torch.zeros_like(v)
        for k, v in state.items()
    }


def _equal(a: dict, b: dict) -> bool:
    return all(
        all(torch.equal(x, y) for x, y in zip(a[k], b[k], strict=True))
        if isinstance(a[k], list)
        else torch.equal(a[k], b[k])
        for k in a
    )


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    reads: list[tuple[int, int]] = []  # (offset, length) of every direct read
    real = DirectFileReader.read

    def read(self: DirectFileReader, offset: int, length: int) -> object:
        reads.append((offset, length))
        return real(self, offset, length)

    monkeypatch.setattr(DirectFileReader, "read", read)
    return reads


def _span(offset: int, length: int) -> int:
    """What a direct read of ``[offset, offset + length)`` spans, rounded out to pages."""
    return -(-(offset + length) // ALIGN) * ALIGN - (offset - offset % ALIGN)


@needs_raw_reader
def test_a_cold_restore_reads_direct_and_bit_exact(tmp_path: Path, counted: list[tuple[int, int]]) -> None:
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    state = _state()
    with CheckpointManager(tmp_path / "run", async_save=False, retention=Retention(keep_last=2)) as mgr:
        mgr.save(1, {"model": state})
    evict(tmp_path / "run")
    target = _zeros(state)
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        result = mgr.restore({"model": target})
    assert result.step == 1
    assert _equal(target, state)
    assert counted, "the cold shard was not read with O_DIRECT"
    spans = [_span(offset, length) for offset, length in counted]
    assert max(spans) == DirectFileReader.window  # whole buffers, whatever the archives' sizes
    assert spans.count(DirectFileReader.window) >= 2  # 40 MiB of archives: two full requests at least
    reads = sorted(counted)
    for (offset, length), (after, _) in itertools.pairwise(reads):
        assert offset + length <= after, "a byte was read twice"
    assert sum(length for _, length in counted) >= 24 * MIB + 4 * MIB + 12 * MIB


def test_a_restore_refused_o_direct_at_its_first_read_is_read_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every window already submitted comes back refused: each batch is read again the buffered way."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    state = _state()
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, {"model": state})
    evict(tmp_path / "run")
    refused: list[int] = []

    def read_into(self: DirectFileReader, view: memoryview, offset: int) -> int:
        refused.append(offset)
        raise OSError(errno.EINVAL, "refused")

    monkeypatch.setattr(DirectFileReader, "_read_into", read_into)
    # The filesystem refuses every O_DIRECT read, the early ones too (safeckpt._storage.prefetch).
    monkeypatch.setattr(early_read, "read_aligned", lambda fd, view, offset: read_into(None, view, offset))  # type: ignore[arg-type]
    alone: list[int] = []  # archives read again one by one (the slow path a batch with no bytes falls to)
    real = raw_reader.RawFileSystemReader._read_archive
    monkeypatch.setattr(
        raw_reader.RawFileSystemReader,
        "_read_archive",
        lambda self, fd, offset, *a: (alone.append(offset), real(self, fd, offset, *a))[1],
    )
    target = _zeros(state)
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.restore({"model": target})
    assert refused, "the direct path was not tried"
    assert _equal(target, state)
    assert not alone, "the refused batch was not read again as a batch"


@needs_raw_reader
def test_a_flipped_byte_is_caught_on_the_direct_path(tmp_path: Path, counted: list[tuple[int, int]]) -> None:
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    state = _state()
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, {"model": state})
    shard = next((tmp_path / "run").rglob("__0_0.distcp"))
    fd = os.open(shard, os.O_RDWR)
    try:
        middle = shard.stat().st_size // 3  # inside the large tensor's bytes
        byte = os.pread(fd, 1, middle)
        os.pwrite(fd, bytes([byte[0] ^ 0x40]), middle)
    finally:
        os.close(fd)
    evict(tmp_path / "run")
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr, pytest.raises(CorruptCheckpointError):
        mgr.restore({"model": _zeros(state)}, step=1)
    assert counted


def test_prefetch_leaves_a_cold_shard_to_the_direct_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read-ahead into the page cache would make the restore read the shard buffered: none is asked."""
    import threading

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, {"model": _state()})
    directory = next((tmp_path / "run").rglob("__0_0.distcp")).parent
    evict(directory)
    advised: list[str] = []
    monkeypatch.setattr(early_read, "advise", lambda fd, offset, length, advice: advised.append(advice))
    decided = threading.Event()
    real = early_read.reads_direct
    monkeypatch.setattr(
        early_read, "reads_direct", lambda fd, offset, **kw: (real(fd, offset, **kw), decided.set())[0]
    )
    done = early_read.prefetch(directory, 0)
    assert decided.wait(10)
    assert advised == []
    done()  # the early reads it started instead (given back)
    (directory / "__0_0.distcp").read_bytes()  # warm now: the prefetch asks for read-ahead again
    decided.clear()
    early_read.prefetch(directory, 0)
    assert decided.wait(10)
    for _ in range(100):
        if advised:
            break
        threading.Event().wait(0.01)
    assert advised == ["POSIX_FADV_WILLNEED"]


def _batches(size: int, seed: int) -> list[list[SimpleNamespace]]:
    """Consecutive archive-like parts (prefix, data, tail) of random sizes over ``size`` bytes, in batches."""
    rng = random.Random(seed)
    batches: list[list[SimpleNamespace]] = []
    offset = 0
    while offset < size:
        batch = []
        for _ in range(rng.randint(1, 6)):
            length = min(size - offset, rng.choice([1, 4095, 70_000, 300_000, 700_000]))
            if length == 0:
                break
            a = rng.randint(0, length)
            b = rng.randint(a, length)
            parts = (bytearray(a), bytearray(b - a), bytearray(length - b))
            batch.append(
                SimpleNamespace(
                    offset=offset,
                    length=length,
                    prefix=parts[0],
                    data=parts[1],
                    tail=parts[2],
                    buffers=lambda parts=parts: list(parts),
                )
            )
            offset += length
        batches.append(batch)
    return batches


@pytest.mark.parametrize("failure", [None, "refused", "first refused", "eio"])
def test_read_ahead_through_few_buffers(
    cold: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch, failure: str | None
) -> None:
    """Many batches, small windows, more windows than buffers: every byte, and no read waits forever."""
    path, data = cold
    fd, reader = _reader(path)
    reader.window = 64 * 1024  # ~50 windows over the file, 4 buffers
    real = DirectFileReader._read_into
    reads = itertools.count()

    def read_into(self: DirectFileReader, view: memoryview, offset: int) -> int:
        k = next(reads)
        if failure == "first refused" and k == 0:
            time.sleep(0.3)  # the second read, on the other thread, succeeds before this one refuses
            raise OSError(errno.EINVAL, "refused")
        if failure == "refused":
            raise OSError(errno.EINVAL, "refused")
        if failure == "eio" and k == 7:
            raise OSError(errno.EIO, "I/O error")
        return real(self, view, offset)

    monkeypatch.setattr(DirectFileReader, "_read_into", read_into)
    batches = _batches(len(data), seed=len(failure or ""))
    done: list[list[SimpleNamespace]] = []
    with reader, ThreadPoolExecutor(2) as pool:
        reads_ahead = ReadAhead(fd, pool, reader)

        def run() -> None:
            pending = iter(batches)
            for batch in itertools.islice(pending, 2):
                reads_ahead.add(batch)
            while (batch := reads_ahead.next()) is not None:
                done.append(batch)
                assert reader._taken <= reader.buffers
                for more in itertools.islice(pending, 1):
                    reads_ahead.add(more)

        if failure == "eio":
            with pytest.raises(OSError, match="I/O error"):
                run()
            os.close(fd)
            return
        run()
    os.close(fd)
    assert done == batches
    for p in (p for batch in done for p in batch):
        assert bytes(p.prefix + p.data + p.tail) == data[p.offset : p.offset + p.length], p.offset


# --- early reads: a cold shard's first windows, read while the restore plans ----------------------


@pytest.fixture
def claims(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """Every claim of an early window: (start, end, whether it was taken)."""
    seen: list[tuple[int, int, bool]] = []
    real = early_read.EarlyReads.claim

    def claim(self: early_read.EarlyReads, start: int, end: int) -> object:
        got = real(self, start, end)
        seen.append((start, end, got is not None))
        return got

    monkeypatch.setattr(early_read.EarlyReads, "claim", claim)
    return seen


def _saved_cold(tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    state = _state()
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, {"model": state})
    evict(tmp_path / "run")
    return state, next((tmp_path / "run").rglob("__0_0.distcp"))


@needs_raw_reader
def test_a_cold_restore_takes_its_first_windows_from_the_early_reads(
    tmp_path: Path, claims: list[tuple[int, int, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    state, shard = _saved_cold(tmp_path)
    own: list[tuple[int, int]] = []  # what the reader read itself
    real = DirectFileReader._read_into
    monkeypatch.setattr(
        DirectFileReader,
        "_read_into",
        lambda self, view, offset: (own.append((offset, len(view))), real(self, view, offset))[1],
    )
    target = _zeros(state)
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.restore({"model": target}, step=1)
    assert _equal(target, state)
    taken = [(start, end) for start, end, ok in claims if ok]
    assert len(taken) >= 2, claims  # the file is about 44 MiB: its windows were read early
    for start, end in taken:  # and not read again
        assert all(offset + length <= start or offset >= end for offset, length in own), (taken, own)
    assert early_read.lookup(shard.stat()) is None, "the early reads were not closed after the restore"


@needs_raw_reader
def test_a_flipped_byte_in_an_early_window_is_caught(
    tmp_path: Path, claims: list[tuple[int, int, bool]]
) -> None:
    state, shard = _saved_cold(tmp_path)
    fd = os.open(shard, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, MIB)[0] ^ 0x01]), MIB)  # inside the first window
    finally:
        os.close(fd)
    evict(shard)
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr, pytest.raises(CorruptCheckpointError):
        mgr.restore({"model": _zeros(state)}, step=1)
    assert any(ok and start <= MIB < end for start, end, ok in claims), claims


@needs_raw_reader
def test_failed_early_reads_leave_their_ranges_to_the_reader_and_give_every_buffer_back(
    tmp_path: Path, claims: list[tuple[int, int, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    state, _ = _saved_cold(tmp_path)
    outstanding = _count_buffers(monkeypatch)

    def failing(fd: int, view: memoryview, offset: int) -> int:
        if offset >= 16 * MIB:
            raise OSError(errno.EIO, "injected")
        return direct_read.read_aligned(fd, view, offset)

    monkeypatch.setattr(early_read, "read_aligned", failing)
    target = _zeros(state)
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.restore({"model": target}, step=1)
    assert _equal(target, state)
    assert [ok for start, _, ok in claims if start < 16 * MIB] and not [
        ok for start, _, ok in claims if start >= 16 * MIB and ok
    ]
    assert outstanding == [0]  # the window read early was given back once the restore had read


def _count_buffers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[buffers the early reads took from the pool and did not give back]"""
    outstanding = [0]
    take, give = early_read.take_buffer, early_read.give_back

    def taking() -> object:
        outstanding[0] += 1
        return take()

    def giving(buffer: object) -> None:
        outstanding[0] -= 1
        give(buffer)  # type: ignore[arg-type]

    monkeypatch.setattr(early_read, "take_buffer", taking)
    monkeypatch.setattr(early_read, "give_back", giving)
    return outstanding


def test_claims_serve_ranges_inside_one_window_and_close_gives_every_buffer_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    import threading

    outstanding = _count_buffers(monkeypatch)
    data = os.urandom(36 * MIB + 100)  # three windows, the last one short
    path = tmp_path / "f"
    path.write_bytes(data)
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        early = early_read.EarlyReads.start(fd, os.fstat(fd))
        assert early is not None and early_read.lookup(os.fstat(fd)) is early
        other = tmp_path / "g"
        other.write_bytes(data)
        assert early_read.lookup(other.stat()) is None  # another file: same bytes, another identity
        seen: list[object] = []
        elsewhere = threading.Thread(target=lambda: seen.append(early_read.lookup(os.fstat(fd))))
        elsewhere.start()
        elsewhere.join()
        assert seen == [None]  # another thread's restore reads for itself
        again = early_read.EarlyReads.start(fd, os.fstat(fd))
        assert again is not None and again.claim(0, 4096) is None  # the same thread again: reads nothing
        again.close()
        assert early_read.lookup(os.fstat(fd)) is early
        assert early.claim(16 * MIB - 4096, 16 * MIB + 4096) is None  # spans two windows
        assert early.claim(36 * MIB, 36 * MIB + 101) is None  # past the end of the file
        for start, end in [(4096, 8192), (5, 16 * MIB), (0, 100), (32 * MIB + 7, 36 * MIB + 100)]:
            claimed = early.claim(start, end)  # any range inside one window, as often as asked
            assert claimed is not None, (start, end)
            buffer, base = claimed
            assert bytes(memoryview(buffer)[start - base : end - base]) == data[start:end]
        assert outstanding == [3]  # the early reads' own until closed
        early.close()
        assert early_read.lookup(os.fstat(fd)) is None
        assert outstanding == [0]
    finally:
        os.close(fd)
