"""Raw I/O limits that are limits: the fastest of several strategies, measured in one repetition.

A limit is what the machine allows for the bytes of a state: how fast they can be
made durable in a file, how fast they can be read back cold. One strategy is not
a limit (a peer beat the old chunked, truncating raw write by 30%), so each limit
here times every strategy it knows, back to back in the same repetition, and
keeps the fastest:

* host copies (:class:`MemcpyLimit`): ``copy_`` into preallocated buffers
  against ``clone`` into new tensors;
* writes (:class:`WriteLimit`): a fresh file against one created empty before
  the timing, one ``os.writev`` of every buffer against 64 MiB ``os.write``
  calls, and ``O_DIRECT`` from a page-aligned copy in huge pages where the
  filesystem takes it (64 MiB and 16 MiB writes, and 16 MiB writes from two
  threads, so two are in flight); every strategy ends with an fsync;
* reads (:class:`ReadLimit`): one ``os.readv`` of every buffer on one thread
  against ``os.preadv`` on two threads (each reading half the file), an
  ``mmap`` copied out (what safetensors does), one read per tensor into tensors
  allocated for it (what ``torch.load`` does), and, where the filesystem takes
  it, ``O_DIRECT`` reads into aligned buffers in huge pages, copied into place
  by another thread (64 MiB reads on one thread, and 16 MiB reads two at a
  time on two threads); the page cache is evicted before each.

:meth:`WriteLimit.time` and :meth:`ReadLimit.time` time one strategy, so that a
benchmark can give each strategy its own place in a repetition's rotation,
between the variants, rather than running them back to back (on a virtual
disk, five cold 1 GiB reads in a row do not see the disk the sixth sees).

Every ``O_DIRECT`` strategy's memory comes from
:func:`safeckpt._fs.direct_write.aligned_buffer`, as safeckpt's own staging does: the
kernel builds one request from physically contiguous memory, so from scattered
4 KiB pages the same strategy issues smaller requests and measures slower
(1 GiB written from a 4 KiB-page copy took 420 ms in 2.4 MiB requests where
safeckpt's reused 16 MiB buffers took 316 ms in 3.6 MiB requests; that was
why safeckpt once ran at 0.82x of this limit).

No strategy truncates or deletes an earlier file inside its timing: every write
goes to a path no earlier write used (``O_EXCL`` proves it), and what a
repetition wrote is deleted by :meth:`Scratch.purge`, which the caller runs
between repetitions, outside every timing.
"""

from __future__ import annotations

import itertools
import mmap
import os
import shutil
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench_common import MIB, evict, interleaved, memcpy, settle, timed
from safeckpt._fs.direct_write import aligned_buffer, copy_bytes

ALIGN = 4096  # O_DIRECT needs buffer addresses, offsets and lengths aligned to the logical block size
_CHUNK = 64 * MIB
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


# --- fresh paths, deletion outside the timings -----------------------------------------------


class Scratch:
    """Paths no earlier write used, under one directory, and deletion deferred to :meth:`purge`.

    Call rule: time only between :meth:`fresh` and :meth:`discard`; call :meth:`purge`
    between repetitions (it deletes, then flushes, so the deletes slow no timing).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._counter = itertools.count(1)
        self._pending: list[Path] = []

    def fresh(self, name: str) -> Path:
        """A new path (nothing exists there) under the directory."""
        while True:
            path = self.directory / f"{name}.{next(self._counter)}"
            if not path.exists():
                return path

    def discard(self, path: Path | None) -> None:
        """Delete ``path`` (file or directory) at the next :meth:`purge`, not now."""
        if path is not None:
            self._pending.append(path)

    def purge(self) -> None:
        """Delete what was discarded, then let the disk settle (outside every timing)."""
        pending, self._pending = self._pending, []
        for path in pending:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        settle()


# --- vectored I/O --------------------------------------------------------------------------


def byte_views(tensors: Iterable[torch.Tensor]) -> list[memoryview]:
    """The bytes of each (contiguous, CPU) tensor, as writable views of its own memory."""
    views = []
    for t in tensors:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("byte_views needs contiguous CPU tensors (views of their memory)")
        views.append(memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B"))
    return views


def transfer(views: Sequence[memoryview], io: Callable[[list[memoryview], int], int]) -> int:
    """Pass every byte of ``views`` through ``io(batch, done)``; returns the bytes moved.

    ``io`` is one vectored call (``writev``, ``readv``, ``preadv``) over at most
    IOV_MAX buffers; ``done`` is the byte count so far (for ``preadv`` offsets).
    Partial transfers resume where they stopped; a zero-byte transfer is an EOF.
    """
    pending = deque(v for v in views if len(v))
    done = 0
    while pending:
        n = io(list(itertools.islice(pending, _IOV_MAX)), done)
        if n <= 0:
            raise EOFError(f"vectored I/O stopped after {done} bytes")
        done += n
        while n:
            head = pending[0]
            if n >= len(head):
                n -= len(head)
                pending.popleft()
            else:
                pending[0] = head[n:]
                n = 0
    return done


def _chunks(views: Sequence[memoryview], size: int = _CHUNK) -> list[memoryview]:
    return [v[i : i + size] for v in views for i in range(0, len(v), size)]


def _fsync_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- limits ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limit:
    """One repetition of a limit: every strategy's seconds; the limit is the fastest."""

    times: dict[str, float]

    @property
    def seconds(self) -> float:
        return min(self.times.values())

    @property
    def strategy(self) -> str:
        return min(self.times, key=self.times.__getitem__)


FRESH_WRITEV = "fresh file, one writev"
FRESH_CHUNKS = "fresh file, 64 MiB writes"
CREATED_WRITEV = "pre-created empty file, one writev"
CREATED_CHUNKS = "pre-created empty file, 64 MiB writes"
DIRECT = "fresh file, O_DIRECT, 64 MiB writes"
DIRECT_16 = "fresh file, O_DIRECT, 16 MiB writes"
DIRECT_16X2 = "fresh file, O_DIRECT, 16 MiB writes from two threads"
DIRECT_WRITES = (DIRECT, DIRECT_16, DIRECT_16X2)


class WriteLimit:
    """The fastest way to make the bytes of ``tensors`` durable in one new file, fsync included.

    :meth:`measure` times every strategy once (order interleaved by ``rep``) and
    discards what it wrote into ``scratch`` (deleted at the next purge). The
    ``O_DIRECT`` strategy writes a page-aligned copy of the bytes made here, once
    (the tensors' own memory is not aligned); it is left out, with a reason in
    :attr:`notes`, where the filesystem refuses ``O_DIRECT``.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], scratch: Scratch, *, direct: bool = True) -> None:
        self.views = byte_views(tensors)
        self.nbytes = sum(len(v) for v in self.views)
        self.scratch = scratch
        self.notes: list[str] = []
        self.strategies: dict[str, Callable[[Path], None]] = {
            FRESH_WRITEV: self._writev,
            FRESH_CHUNKS: self._chunked,
            CREATED_WRITEV: self._writev,
            CREATED_CHUNKS: self._chunked,
        }
        self._aligned: memoryview | None = None
        if direct:
            why_not = self._direct_refused()
            if why_not:
                self.notes.append(f"O_DIRECT left out: {why_not}.")
            else:
                self._aligned = self._aligned_copy()
                self.strategies[DIRECT] = lambda path: self._direct(path, _CHUNK, 1)
                self.strategies[DIRECT_16] = lambda path: self._direct(path, 16 * MIB, 1)
                self.strategies[DIRECT_16X2] = lambda path: self._direct(path, 16 * MIB, 2)

    def measure(self, rep: int) -> Limit:
        """Every strategy once, order interleaved by ``rep``; their files are deleted at the next purge."""
        return Limit({name: self.time(name) for name in interleaved(list(self.strategies), rep)})

    def time(self, name: str) -> float:
        """Seconds of one run of strategy ``name`` (to a new path, deleted at the next purge)."""
        path = self.prepare(name)
        settle()
        return timed(lambda: self.write(name, path))

    def prepare(self, name: str) -> Path:
        """The path strategy ``name`` writes next (created empty for a pre-created strategy); call it
        before the timing. The file is deleted at the scratch's next purge."""
        path = self.scratch.fresh("write-limit")
        if name in (CREATED_WRITEV, CREATED_CHUNKS):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        self.scratch.discard(path)
        return path

    def write(self, name: str, path: Path) -> None:
        """Strategy ``name`` into ``path`` (from :meth:`prepare`): the part to time."""
        self.strategies[name](path)

    @staticmethod
    def _open(path: Path, extra: int = 0) -> int:
        # A pre-created file is empty: opening it without O_TRUNC truncates nothing.
        flags = os.O_WRONLY | extra
        return os.open(path, flags) if path.exists() else os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)

    def _writev(self, path: Path) -> None:
        fd = self._open(path)
        try:
            transfer(self.views, lambda batch, _: os.writev(fd, batch))
        finally:
            _fsync_close(fd)

    def _chunked(self, path: Path) -> None:
        fd = self._open(path)
        try:
            for chunk in _chunks(self.views):
                transfer([chunk], lambda batch, _: os.write(fd, batch[0]))
        finally:
            _fsync_close(fd)

    def _direct(self, path: Path, size: int, threads: int) -> None:
        assert self._aligned is not None
        fd = self._open(path, os.O_DIRECT)
        try:
            chunks = _shared(list(enumerate(_chunks([self._aligned], size))))

            def write(_: object) -> None:
                while (job := chunks()) is not None:
                    k, chunk = job
                    transfer([chunk], lambda batch, done, k=k: os.pwrite(fd, batch[0], k * size + done))

            in_threads(write, [None] * threads)  # each thread takes the next chunk: writes stay adjacent
        finally:
            _fsync_close(fd)

    def _aligned_copy(self) -> memoryview:
        # mmap memory is page-aligned; the last block is padded with zeros (under 4 KiB more written).
        padded = -(-self.nbytes // ALIGN) * ALIGN
        buf = memoryview(aligned_buffer(padded))
        offset = 0
        for v in self.views:
            buf[offset : offset + len(v)] = v
            offset += len(v)
        return buf

    def _direct_refused(self) -> str:
        return direct_refused(self.scratch)


def direct_refused(scratch: Scratch) -> str:
    """Why ``O_DIRECT`` writes and reads cannot be used in ``scratch``'s directory ("": they can)."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    probe = scratch.fresh("o-direct-probe")
    block = memoryview(mmap.mmap(-1, ALIGN))
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        try:
            os.write(fd, block)
        finally:
            os.close(fd)
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [block], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"the filesystem refuses it ({exc.strerror or exc})"
    finally:
        probe.unlink(missing_ok=True)
    return ""


LIMIT_SLOT = "limit: "


def combined(first: Mapping[str, float], then: Mapping[str, float]) -> dict[str, float]:
    """Every pair of strategies done one after the other (a copy, then a write): seconds of each."""
    return {f"{a} + {b}": ta + tb for a, ta in first.items() for b, tb in then.items()}


def slots(strategies: Iterable[str]) -> list[str]:
    """One rotation entry per strategy of a limit, to interleave with a table's variants."""
    return [LIMIT_SLOT + name for name in strategies]


def strategy_of(slot: str) -> str | None:
    """The strategy a rotation entry from :func:`slots` names (None: a variant)."""
    return slot[len(LIMIT_SLOT) :] if slot.startswith(LIMIT_SLOT) else None


def _shared(jobs: list[Any]) -> Callable[[], Any]:
    """A function handing out ``jobs`` in order to whichever thread asks next; None when none is left."""
    lock = threading.Lock()
    pending = deque(jobs)

    def take() -> Any:
        with lock:
            return pending.popleft() if pending else None

    return take


def in_threads(work: Callable[[Any], None], parts: Sequence[Any]) -> None:
    """``work(part)`` for every part, each on its own thread; the first error is raised here."""
    errors: list[BaseException] = []

    def run(part: Any) -> None:
        try:
            work(part)
        except BaseException as exc:  # re-raised on the calling thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(part,)) for part in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


COPY_INTO = "copy_ into preallocated buffers"
CLONE = "clone into new tensors"


class MemcpyLimit:
    """The fastest host copy of ``sources``: ``copy_`` into reused buffers, or ``clone`` (what Lightning
    does). A staging save copies at least this much; the clones are freed after the timing."""

    def __init__(self, sources: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
        self.sources, self.buffers = list(sources), list(buffers)
        self.notes: list[str] = []

    def measure(self, rep: int) -> Limit:
        times = {}
        for name in interleaved([COPY_INTO, CLONE], rep):
            settle()
            if name == COPY_INTO:
                times[name] = timed(lambda: memcpy(self.sources, self.buffers))
            else:
                clones: list[torch.Tensor] = []
                times[name] = timed(lambda clones=clones: clones.extend(t.clone() for t in self.sources))
                del clones
        return Limit(times)


READV = "one thread, one readv"
PREADV2 = "two threads, preadv of a half each"
MMAP = "mmap, MADV_WILLNEED, one copy"
FRESH_PER_TENSOR = "one read per tensor into new tensors (as torch.load)"
DIRECT_READ = "O_DIRECT, 64 MiB reads on a thread, copied out on another"
DIRECT_READ_16X2 = "O_DIRECT, 16 MiB reads on two threads, copied out on another"
DIRECT_READS = (DIRECT_READ, DIRECT_READ_16X2)


class ReadLimit:
    """The fastest cold read of one file holding the bytes of ``buffers``, into ``buffers``.

    The file is written here, once (before any timing); :meth:`measure` evicts
    its pages before every strategy. The ``O_DIRECT`` strategies read into
    page-aligned buffers made here (the tensors' memory is not aligned) and
    copy into place; they are left out, with a reason in :attr:`notes`, where
    the filesystem refuses ``O_DIRECT``.
    """

    def __init__(self, buffers: Sequence[torch.Tensor], scratch: Scratch, *, direct: bool = True) -> None:
        self.views = byte_views(buffers)
        self.nbytes = sum(len(v) for v in self.views)
        self.path = scratch.fresh("read-limit")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            transfer(self.views, lambda batch, _: os.writev(fd, batch))
        finally:
            _fsync_close(fd)
        self.strategies: dict[str, Callable[[], None]] = {
            READV: self._readv,
            PREADV2: self._preadv2,
            MMAP: self._mmap,  # what safetensors and torch.load(mmap=True) build on
            FRESH_PER_TENSOR: self._fresh_per_tensor,  # torch.load beat every other strategy here once
        }
        self.notes: list[str] = []
        self.fresh: list[torch.Tensor] = []  # what FRESH_PER_TENSOR read into
        self._staging: list[memoryview] = []
        if direct:
            why_not = direct_refused(scratch)
            if why_not:
                self.notes.append(f"O_DIRECT left out: {why_not}.")
            else:
                self._staging = [memoryview(aligned_buffer(_CHUNK)) for _ in range(2)]
                self.strategies[DIRECT_READ] = lambda: self._direct_pipelined(_CHUNK, 1)
                self.strategies[DIRECT_READ_16X2] = lambda: self._direct_pipelined(16 * MIB, 2)

    def measure(self, rep: int) -> Limit:
        return Limit({name: self.time(name) for name in interleaved(list(self.strategies), rep)})

    def time(self, name: str) -> float:
        """Seconds of one cold run of strategy ``name`` (the page cache evicted first)."""
        self.fresh = []  # what the last run allocated is freed here, outside the timing
        settle()
        evict(self.path)
        return timed(self.strategies[name])

    def _open(self) -> int:
        fd = os.open(self.path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # the best hint a reader can give
        return fd

    def _readv(self) -> None:
        fd = self._open()
        try:
            transfer(self.views, lambda batch, _: os.readv(fd, batch))
        finally:
            os.close(fd)

    def _fresh_per_tensor(self) -> None:
        """Each tensor's bytes, in file order, into a tensor allocated for it (freed after the timing)."""
        fresh: list[torch.Tensor] = []
        with open(self.path, "rb", buffering=0) as f:
            for v in self.views:
                t = torch.empty(len(v), dtype=torch.uint8)
                transfer(byte_views([t]), lambda batch, _: f.readinto(batch[0]) or 0)
                fresh.append(t)
        self.fresh = fresh  # freed by the next time(): freeing 1 GiB is not part of a read

    def _mmap(self) -> None:
        with open(self.path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            if hasattr(mmap, "MADV_WILLNEED"):
                mapped.madvise(mmap.MADV_WILLNEED)  # start reading the whole file at once
            with memoryview(mapped) as whole:
                offset = 0
                for v in self.views:
                    v[:] = whole[offset : offset + len(v)]
                    offset += len(v)
        finally:
            mapped.close()

    def _preadv2(self) -> None:
        halves = split_views(self.views, self.nbytes // 2)
        starts = (0, sum(len(v) for v in halves[0]))

        def read(part: tuple[list[memoryview], int]) -> None:
            views, start = part
            fd = self._open()  # one file description each: its own readahead window
            try:
                transfer(views, lambda batch, done: os.preadv(fd, batch, start + done))
            finally:
                os.close(fd)

        in_threads(read, list(zip(halves, starts, strict=True)))

    def _direct_chunks(self, size: int) -> list[tuple[int, list[memoryview]]]:
        """(file offset, the buffers its ``size`` bytes go to) for each chunk of the file."""
        chunks, rest, offset = [], list(self.views), 0
        while offset < self.nbytes:
            n = min(size, self.nbytes - offset)
            head, rest = split_views(rest, n)
            chunks.append((offset, head))
            offset += n
        return chunks

    def _direct_read(self, fd: int, staging: memoryview, offset: int, n: int) -> memoryview:
        """Bytes ``[offset, offset + n)`` (offset aligned) read into ``staging``; a view of them."""
        want = -(-n // ALIGN) * ALIGN
        done = 0
        while done < n:
            got = os.preadv(fd, [staging[done:want]], offset + done)
            if got <= 0:
                raise EOFError(f"O_DIRECT read stopped after {offset + done} bytes")
            done += got
        return staging[:n]

    def _direct_pipelined(self, size: int, readers: int) -> None:
        """``readers`` threads read ``size`` bytes at a time into ``2 * readers`` staging buffers, in
        file order; this one copies each out as it arrives (what safeckpt's direct reader does)."""
        staging = [
            part
            for buffer in self._staging
            for part in (buffer[k : k + size] for k in range(0, len(buffer) - size + 1, size))
        ][: 2 * readers]
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        try:
            chunks = self._direct_chunks(size)
            with ThreadPoolExecutor(readers) as pool:
                reading: deque[Future[memoryview]] = deque()

                def submit(k: int) -> None:
                    if k < len(chunks):
                        offset, targets = chunks[k]
                        into, n = staging[k % len(staging)], sum(map(len, targets))
                        reading.append(pool.submit(self._direct_read, fd, into, offset, n))

                for k in range(len(staging)):
                    submit(k)
                for k, (_, targets) in enumerate(chunks):
                    _copy_out(reading.popleft().result(), targets)
                    submit(k + len(staging))  # into the buffer just copied out of
        finally:
            os.close(fd)


def _copy_out(staged: memoryview, targets: list[memoryview]) -> None:
    """Copy ``staged`` into ``targets`` in order, the GIL released as safeckpt's reader copies."""
    offset = 0
    for t in targets:
        copy_bytes(t, staged[offset : offset + len(t)])
        offset += len(t)


def split_views(views: Sequence[memoryview], at: int) -> tuple[list[memoryview], list[memoryview]]:
    """``views`` cut at byte ``at`` of their concatenation: (the bytes before, the bytes from there)."""
    head: list[memoryview] = []
    tail: list[memoryview] = []
    offset = 0
    for v in views:
        if offset + len(v) <= at:
            head.append(v)
        elif offset >= at:
            tail.append(v)
        else:
            head.append(v[: at - offset])
            tail.append(v[at - offset :])
        offset += len(v)
    return head, tail
