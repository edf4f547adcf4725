"""The GETs of one restore: every object of the load at once, a bounded window ahead of the reader.

A restore reads the ranges its items need from several objects (a rank's data
files, written :data:`~safeckpt._objstore.store` as several objects per rank).
:class:`Fetch` plans them as one list of GETs, in the order the reader consumes
them (object by object, by offset), and keeps a window of them submitted ahead:
the pool's requests stay busy across object boundaries, and the bytes held at
once are bounded by the window, not by the size of a rank's state.

GETs are as large as they can be while the pool still has one per thread: the
bytes wanted divided by the concurrency, at least ``part_size`` and at most four
parts. Each object's ranges are cut into equal pieces of about that size (up to
1.5 times it, so that an object a little larger than one GET is not read as a
GET and a sliver), so an object of a few parts is one GET: a server pays per
request, and some (moto among them) read a whole object to serve any range of
it. An item larger than the window (one big embedding) is read whole, its GETs
all at once, and joined: the bytes held are the window's or one item's.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

from .client import NotFound, ObjectClient
from .transfer import pool

GAP = 1 << 20  # ranges of one object closer than this are read as one GET
MAX_PARTS_PER_GET = 4


class Get(NamedTuple):
    key: str
    start: int
    end: int


def merged(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, those closer than :data:`GAP` joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1] + GAP:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def plan(
    wanted: Sequence[tuple[str, Sequence[tuple[int, int]]]], *, part_size: int, concurrency: int
) -> list[Get]:
    """The GETs for ``wanted`` (each object's key and the spans read from it), in that order."""
    ranges = [(key, (start, end)) for key, spans in wanted for start, end in merged(spans) if end > start]
    total = sum(end - start for _, (start, end) in ranges)
    size = min(max(part_size, math.ceil(total / max(1, concurrency))), MAX_PARTS_PER_GET * part_size)
    gets = []
    for key, (start, end) in ranges:
        pieces = max(1, round((end - start) / size))
        step = math.ceil((end - start) / pieces)
        gets += [Get(key, at, min(end, at + step)) for at in range(start, end, step)]
    return gets


class Fetch:
    """The bytes of planned GETs, :meth:`wait`\\ ed for in order; a context manager.

    At most ``window`` GETs are submitted past the one the reader waits for; a GET's
    reply is dropped once the reader has moved past it. Every reply of one object
    must carry the same token (the object was not replaced while it was read)."""

    def __init__(self, client: ObjectClient, gets: list[Get], *, concurrency: int, window: int) -> None:
        self._client = client
        self._gets = gets
        self._window = max(1, window)
        self._pool = pool(concurrency)
        self._replies: dict[int, Future[bytes]] = {}
        self._submitted = 0
        self._tokens: dict[str, str] = {}
        self._index: dict[str, list[tuple[int, int]]] = {key: [] for key, _, _ in gets}  # (start, GET n)
        for n, get in enumerate(gets):
            self._index[get.key].append((get.start, n))

    def _get(self, get: Get) -> bytes:
        got = self._client.get(get.key, start=get.start, length=get.end - get.start)
        if self._tokens.setdefault(get.key, got.token) != got.token:
            raise NotFound(2, "the object was replaced while it was read", get.key)
        if len(got.data) != get.end - get.start:
            raise EOFError(f"{get.key} is shorter than its metadata says")
        return got.data

    def _submit_through(self, last: int) -> None:
        while self._submitted <= last:
            self._replies[self._submitted] = self._pool.submit(self._get, self._gets[self._submitted])
            self._submitted += 1

    def wait(self, key: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of object ``key`` (a span it was planned with)."""
        if end <= start:
            return memoryview(b"")
        starts = self._index[key]
        first = starts[bisect.bisect_right(starts, (start, len(self._gets))) - 1][1]
        last = starts[bisect.bisect_left(starts, (end, -1)) - 1][1]
        self._submit_through(min(len(self._gets) - 1, max(last, first + self._window)))
        for done in [n for n in self._replies if n < first]:
            del self._replies[done]  # the reader is past it
        pieces = [(self._gets[n].start, self._replies[n].result()) for n in range(first, last + 1)]
        if len(pieces) == 1:
            at, data = pieces[0]
            return memoryview(data)[start - at : end - at]
        joined = bytearray(end - start)
        for at, data in pieces:
            lo, hi = max(start, at), min(end, at + len(data))
            joined[lo - start : hi - start] = memoryview(data)[lo - at : hi - at]
        return memoryview(joined)

    def __enter__(self) -> Fetch:
        return self

    def __exit__(self, *exc: Any) -> None:
        """Cancel the GETs that have not started, wait for the rest."""
        for reply in self._replies.values():
            reply.cancel()
        for reply in self._replies.values():
            if not reply.cancelled():
                with contextlib.suppress(Exception):
                    reply.result()
        self._replies.clear()
