"""Moving one object's bytes: parallel multipart uploads and parallel ranged reads.

An upload is written as a stream (``write``/``tell``, as DCP's writers write a
file) and goes out in parts of ``part_size`` bytes, ``max_concurrency`` at a
time, each with its CRC32; the parts in flight are bounded by twice the pool's
threads for all the uploads of the process together. A small object
(:func:`single_request_limit`) is one PUT, sent when it is closed: each stream
may hold that much before its first part goes, so a writer of ``n`` files side
by side holds up to ``n`` such buffers besides the parts in flight. An upload
that fails or is abandoned is aborted, so no unfinished upload is left behind by this process (one left by a
killed process is collected by the next writer, see :mod:`.store`).
"""

from __future__ import annotations

import contextlib
import io
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .client import Got, NotFound, ObjectClient, ObjectStoreError

SINGLE_REQUEST_PARTS = 4
SINGLE_REQUEST_MOST = 256 << 20  # every service takes a PUT this large; a buffer this size per file


def single_request_limit(part_size: int) -> int:
    """The largest object that goes up in one request: one request costs a service less than
    several, leaves no unfinished upload, and runs beside the other objects of the save."""
    return min(SINGLE_REQUEST_PARTS * part_size, SINGLE_REQUEST_MOST)


_pools: dict[int, ThreadPoolExecutor] = {}
_slots: dict[int, threading.Semaphore] = {}
_pools_lock = threading.Lock()


def pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool per size, shared by uploads and reads (threads start on first use).

    A task run here never waits for another task of the pool (that could take every thread)."""
    with _pools_lock:
        found = _pools.get(workers)
        if found is None:
            found = _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="safeckpt-s3")
        return found


def _part_slots(workers: int) -> threading.Semaphore:
    """The parts every upload of the process may hold at once on the pool of ``workers``: twice
    its threads (one sending, one waiting each), however many files are written side by side."""
    with _pools_lock:
        return _slots.setdefault(workers, threading.Semaphore(2 * workers))


class UploadStream(io.RawIOBase):
    """A new object written in order; it exists, whole, once :meth:`close` returns (a context manager)."""

    def __init__(
        self,
        client: ObjectClient,
        key: str,
        *,
        part_size: int,
        concurrency: int,
    ) -> None:
        super().__init__()
        self._client = client
        self._key = key
        self._part_size = part_size
        self._concurrency = concurrency
        self._buffer = bytearray()
        self._position = 0
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._finished = False

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._buffer += view
        self._position += len(view)
        if self._upload_id is None and len(self._buffer) <= single_request_limit(self._part_size):
            return len(view)  # may still go as one request
        while len(self._buffer) >= self._part_size:
            part = bytes(self._buffer[: self._part_size])
            del self._buffer[: self._part_size]
            self._send(part)
        return len(view)

    def _send(self, part: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self._client.start_upload(self._key)
        for sent_before in self._parts:  # a part that failed: the upload is lost, stop feeding it
            if sent_before.done() and not sent_before.cancelled() and sent_before.exception() is not None:
                raise sent_before.exception()  # type: ignore[misc]
        # Bounded memory: a part waits for a slot, which the part before it frees once it is sent.
        slots = _part_slots(self._concurrency)
        slots.acquire()
        try:
            sent = pool(self._concurrency).submit(
                self._client.upload_part, self._key, self._upload_id, len(self._parts) + 1, part
            )
        except BaseException:
            slots.release()
            raise
        sent.add_done_callback(lambda _: slots.release())
        self._parts.append(sent)

    def close(self, fsync: bool = True) -> None:
        if self._finished or self.closed:
            super().close()
            return
        self._finished = True
        try:
            if self._upload_id is None:
                self._client.put(self._key, bytes(self._buffer))
            else:
                if self._buffer:
                    self._send(bytes(self._buffer))
                parts = [f.result() for f in self._parts]
                self._client.finish_upload(self._key, self._upload_id, parts)
        except BaseException:
            self.abort()
            raise
        finally:
            self._buffer = bytearray()
            super().close()

    def abort(self) -> None:
        """Give the upload up: nothing of it stays on the server."""
        self._finished = True
        for part in self._parts:
            part.cancel()
        for part in self._parts:
            if not part.cancelled():
                with contextlib.suppress(BaseException):
                    part.result()
        if self._upload_id is not None:
            with contextlib.suppress(OSError):  # else left for the collector of unfinished uploads
                self._client.abort_upload(self._key, self._upload_id)
        self._buffer = bytearray()

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
            super().close()


class RangeReader:
    """An object opened for reading: its size when opened, and reads of any range (a ReadHandle).

    Reads of more than one part go out as parallel ranged GETs. Every read checks
    that the object is still the one opened (``If-Match`` would cost the same
    request; the ETag of each reply is compared instead).
    """

    def __init__(self, client: ObjectClient, key: str, *, part_size: int, concurrency: int) -> None:
        self._client = client
        self._key = key
        self._part_size = part_size
        self._concurrency = concurrency
        # The first part comes with the size: one GET instead of a HEAD and a GET for most files.
        try:
            first = client.get(key, start=0, length=part_size)
        except ObjectStoreError as e:
            if e.status != 416:  # an empty object has no byte 0 to start a range at
                raise
            head = client.head(key)
            first = Got(b"", head.token, head.size)
        self.size = first.size
        self.token = first.token
        self._first = first.data

    def read(self, offset: int, length: int) -> bytes:
        length = max(0, min(length, self.size - offset))
        if length == 0:
            return b""
        if length <= self._part_size:
            return self.piece(offset, length)
        starts = range(offset, offset + length, self._part_size)
        spans = [(s, min(self._part_size, offset + length - s)) for s in starts]
        futures = [pool(self._concurrency).submit(self.piece, s, n) for s, n in spans]
        return b"".join(f.result() for f in futures)

    def piece(self, offset: int, length: int) -> bytes:
        """One ranged GET (never from a pool thread's nested wait: see :func:`pool`)."""
        if offset + length <= len(self._first):
            return self._first[offset : offset + length]
        got = self._client.get(self._key, start=offset, length=length)
        if got.token != self.token:
            raise NotFound(2, "the object was replaced while it was read", self._key)
        return got.data

    def close(self) -> None:
        pass

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
