"""What a checkpoint's bytes cost, once checkpoints share the files of their frozen tensors
(``docs/format.md``, "Bytes shared between checkpoints"): each one's own and shared bytes, and the
root's total with each shared file counted once (as ``du`` counts a hard-linked file once).

From the records alone (no stat, no listing: the same on a filesystem and an object store):

* a checkpoint's *shared* bytes are those of the files its record takes from an earlier save
  (``contents`` with ``"from"``); its *own* bytes are the rest, the ones its save wrote;
* the root's total counts each checkpoint's own bytes, and each shared file once: not at all when
  the kept checkpoint that wrote it is listed (it is among that one's own bytes), else once for
  every distinct file (its writer was pruned; the bytes stay while a kept checkpoint reads them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .._format.record import Record


@dataclass(frozen=True)
class Footprint:
    own: int
    """Bytes this checkpoint's save wrote."""
    shared: int
    """Bytes it reads from files an earlier save wrote (stored once, for every checkpoint naming them)."""


def footprint(record: Record) -> Footprint:
    shared = sum(record.files.get(name, 0) for name in _shared(record))
    return Footprint(own=record.size - shared, shared=shared)


def _shared(record: Record) -> dict[str, str]:
    return {n: c.shared_from for n, c in (record.contents or {}).items() if c.shared_from is not None}


def _wrote(origin: str, name: str) -> bool:
    """Whether ``origin`` (a record's ``from``) names the save of checkpoint ``name``: the checkpoint
    itself on a filesystem, its area (``.staging/<name>.<id>``) on an object store."""
    return origin == name or origin.startswith(f".staging/{name}.")


def total(checkpoints: Iterable[tuple[str, Record]]) -> int:
    """The bytes the listed checkpoints (by directory name) hold together, each file once."""
    listed = list(checkpoints)
    count = sum(footprint(record).own for _, record in listed)
    seen: set[tuple[str, str]] = set()
    for _, record in listed:
        for file, origin in _shared(record).items():
            if (origin, file) in seen:
                continue
            seen.add((origin, file))
            writer = [r for n, r in listed if _wrote(origin, n) and file not in _shared(r)]
            if not any(file in r.files for r in writer):
                count += record.files.get(file, 0)
    return count
