"""The O_DIRECT write stream: the same bytes on every path, fallbacks, failures reported."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from pathlib import Path

import pytest

from safeckpt._dcp import options
from safeckpt._fs import direct_write as direct_io
from safeckpt._fs.direct_write import DirectFileWriter, direct_io_available

_BUFFER = direct_io._BUFFER


def _payload(n: int) -> bytes:
    return (bytes(range(251)) * (n // 251 + 1))[:n]


def _write(path: Path, pieces: list[bytes], **kw: object) -> DirectFileWriter:
    with DirectFileWriter(path, **kw) as out:  # type: ignore[arg-type]
        for piece in pieces:
            assert out.write(piece) == len(piece)
        assert out.tell() == sum(map(len, pieces))
    return out


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, _BUFFER - 1, _BUFFER, 2 * _BUFFER + 12345])
def test_the_file_holds_exactly_the_bytes_written(tmp_path: Path, size: int, direct: bool) -> None:
    data = _payload(size)
    # Pieces of awkward sizes, so buffers fill across piece boundaries.
    pieces = [data[i : i + 777_777] for i in range(0, size, 777_777)] or [b""]
    _write(tmp_path / "f", pieces, direct=direct)
    assert (tmp_path / "f").read_bytes() == data


def test_the_disk_here_takes_o_direct(tmp_path: Path) -> None:
    """On the ext4 disk of this machine the fast path runs (else every test above tested the fallback)."""
    if not direct_io_available():
        pytest.skip("no O_DIRECT on this platform")
    data = _payload(2 * _BUFFER + 5)
    out = _write(tmp_path / "f", [data])
    if not out.direct:
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    assert (tmp_path / "f").read_bytes() == data


def test_a_small_file_never_takes_o_direct(tmp_path: Path) -> None:
    """Less than one buffer goes through the page cache: nothing to overlap, nothing to pad."""
    out = _write(tmp_path / "f", [_payload(_BUFFER - 1)], direct=True)
    assert not out.direct and out._thread is None


def test_an_existing_file_is_replaced_not_extended(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 100_000)
    _write(tmp_path / "f", [b"new"])
    assert (tmp_path / "f").read_bytes() == b"new"


def test_o_direct_refused_at_open_falls_back_to_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refusing_open(path: object, flags: int, *args: object) -> int:
        if flags & direct_io._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(direct_io.os, "open", refusing_open)
    data = _payload(_BUFFER + 999)
    out = _write(tmp_path / "f", [data], direct=True)
    assert not out.direct
    assert (tmp_path / "f").read_bytes() == data


def test_o_direct_refused_at_the_first_write_goes_on_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a FUSE filesystem does: the open succeeds, every O_DIRECT write fails with EINVAL."""
    if not direct_io_available():
        pytest.skip("no O_DIRECT on this platform")
    real_pwrite = os.pwrite
    refused = []

    def pwrite(fd: int, data: object, offset: int) -> int:
        if direct_io._O_DIRECT & _flags(fd):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(direct_io.os, "pwrite", pwrite)
    data = _payload(2 * _BUFFER + 4097)
    out = _write(tmp_path / "f", [data], direct=True)
    if refused:  # the open took O_DIRECT: the first write was refused, then all went buffered
        assert refused == [0] and not out.direct
    assert (tmp_path / "f").read_bytes() == data


def _flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


@pytest.mark.parametrize("at_write", [0, 1])
def test_a_failed_background_write_is_raised_and_the_fd_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at_write: int
) -> None:
    real_pwrite = os.pwrite
    calls = []
    opened: list[int] = []
    real_open = os.open

    def tracking_open(*args: object) -> int:
        fd = real_open(*args)  # type: ignore[arg-type]
        opened.append(fd)
        return fd

    def failing_pwrite(fd: int, data: object, offset: int) -> int:
        calls.append(offset)
        if len(calls) > at_write:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(direct_io.os, "open", tracking_open)
    monkeypatch.setattr(direct_io.os, "pwrite", failing_pwrite)
    out = DirectFileWriter(tmp_path / "f")
    with pytest.raises(OSError) as info:
        for _ in range(6):  # more than the buffers: a later write sees the failure, or close does
            out.write(_payload(_BUFFER))
        out.close()
    assert info.value.errno == errno.ENOSPC
    out.abort()  # what `with` does on an exception: closes, raises nothing more
    out.close()
    with pytest.raises(OSError):
        os.fstat(opened[0])  # closed, even on the failure path


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SAFECKPT_DIRECT_IO", "0")
    assert not options.defaults().direct_io  # what a manager gets unless it says direct_io=True
    out = _write(tmp_path / "f", [b"abc"], direct=options.defaults().direct_io)
    assert not out.direct and (tmp_path / "f").read_bytes() == b"abc"


def test_buffers_are_reused_between_files(tmp_path: Path) -> None:
    _write(tmp_path / "a", [_payload(2 * _BUFFER)])
    pooled = list(direct_io._pool)
    assert pooled, "a closed writer gives its buffers back"
    _write(tmp_path / "b", [_payload(2 * _BUFFER)])
    assert any(b in direct_io._pool for b in pooled)


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping holding ``address`` (Linux's /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def _thp_advisable() -> bool:
    """Linux with transparent huge pages that ``madvise`` can ask for, and smaps that shows it."""
    try:
        enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in enabled


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _thp_advisable(), reason="Linux THP only")
def test_staging_buffers_are_private_and_advised_for_huge_pages() -> None:
    """A shared anonymous mapping is shmem, whose huge pages are off: O_DIRECT requests then split."""
    buffer = direct_io.aligned_buffer(4 << 20)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))  # the export ends here
        flags = _vm_flags(address)
        assert "sh" not in flags, "the buffer is a shared (shmem) mapping"
        assert "hg" in flags, "the buffer is not advised for transparent huge pages"
        assert address % mmap.PAGESIZE == 0
    finally:
        buffer.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_starts_an_empty_pool_of_its_own(tmp_path: Path) -> None:
    """The pool's memory is not inherited (MADV_DONTFORK): the child must not reuse it."""
    direct_io.give_back(direct_io.take_buffer())
    assert direct_io._pool, "the buffer did not go back to the pool"
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            if not direct_io._pool:
                with DirectFileWriter(tmp_path / "child") as out:
                    out.write(_payload(_BUFFER + 7))
                code = 0 if (tmp_path / "child").read_bytes() == _payload(_BUFFER + 7) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert direct_io._pool, "the parent's pool was emptied"
