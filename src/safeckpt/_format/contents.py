"""What a data file of untrained tensors holds, by content: the record's ``contents``.

A save puts the tensors nothing trains (``requires_grad=False``, stepped by no
optimizer) into data files of their own, and records, per such file, each
item's DCP key, chunk offset and a content digest, in the file's order (item
``i`` is the file's checksum segment ``i``). The next save compares the digests
of what it is about to write with these, and where every item of a file is
unchanged it shares that file instead of writing it again (see
``docs/format.md``, "Bytes shared between checkpoints").

The digest is XXH3-128 of a header (dtype, shape, strides) and the tensor's
bytes: 128 bits (a false match of two different contents is a 2^-128 event per
comparison) at about 20 GB/s on one core, so deciding costs a fraction of
writing. It is never a security boundary: a match only ever shares bytes this
root wrote itself, and every byte is still checked against its CRC32 on read.

``shared_from`` says where a shared file's bytes were first written: on a
filesystem, the checkpoint whose file this one is a hard link of (for people:
the bytes are in this directory either way); on an object store, the *area*
whose object this checkpoint reads, which pruning keeps while any kept record
names it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DIGEST = "xxh3_128"


@dataclass(frozen=True)
class ItemDigest:
    """One item of a data file: DCP's key and chunk offset, and its content digest (hex)."""

    key: str
    offset: tuple[int, ...]
    digest: str

    @property
    def index(self) -> tuple[str, tuple[int, ...]]:
        return self.key, self.offset


@dataclass(frozen=True)
class FileContents:
    """The items of one data file of untrained tensors, in file order, and where its bytes are."""

    items: tuple[ItemDigest, ...]
    shared_from: str | None = None
    """None: written by this save. Else where the bytes were first written (see the module doc)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {DIGEST: [[i.key, list(i.offset), i.digest] for i in self.items]}
        if self.shared_from is not None:
            out["from"] = self.shared_from
        return out

    @classmethod
    def from_json(cls, data: Any) -> FileContents:
        """Parse one file's entry; raises ``TypeError``/``ValueError`` on anything malformed."""
        if not isinstance(data, dict) or not isinstance(data.get(DIGEST), list):
            raise TypeError(f"'contents' entries must hold a {DIGEST!r} list")
        items = []
        for row in data[DIGEST]:
            if not (isinstance(row, list) and len(row) == 3):
                raise TypeError(f"a 'contents' item must be [key, offsets, digest], got {row!r}")
            key, offset, digest = row
            if not isinstance(key, str) or not isinstance(digest, str) or not isinstance(offset, list):
                raise TypeError(f"a 'contents' item must be [key, offsets, digest], got {row!r}")
            if not all(type(o) is int and o >= 0 for o in offset):
                raise ValueError(f"the offsets of a 'contents' item must be integers, got {offset!r}")
            items.append(ItemDigest(key, tuple(offset), digest))
        shared_from = data.get("from")
        if shared_from is not None and not isinstance(shared_from, str):
            raise TypeError("'from' must be a name")
        return cls(tuple(items), shared_from)


def contents_to_json(contents: Mapping[str, FileContents] | None) -> dict[str, Any] | None:
    return None if contents is None else {n: c.to_json() for n, c in sorted(contents.items())}


def contents_from_json(data: Any, files: Mapping[str, int]) -> dict[str, FileContents] | None:
    """A record's ``contents`` (None when absent); every file it names must be one the record lists."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise TypeError("'contents' must map file names to their items")
    unknown = sorted(set(data) - set(files))
    if unknown:
        raise ValueError(f"'contents' names files the record does not list: {unknown[:3]}")
    return {name: FileContents.from_json(entry) for name, entry in data.items()}


def shared_files(contents: Mapping[str, FileContents] | None) -> dict[str, str]:
    """The files a save took from an earlier one instead of writing them, with where from."""
    return {n: c.shared_from for n, c in (contents or {}).items() if c.shared_from is not None}


def written_here(contents: Mapping[str, FileContents] | None) -> dict[str, FileContents] | None:
    """``contents`` of a copy that holds every file itself (an upload to another root, an export):
    nothing shared from an earlier checkpoint of that root."""
    if contents is None:
        return None
    return {n: FileContents(c.items) for n, c in contents.items()}
