"""What a save's writer is given to share untrained tensors' files with the commit before it.

Plain data, built by the committer from the previous commit's record and read
by the writer (``safeckpt._storage.reuse`` decides with it; see there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .checksums import FileChecksum
from .contents import FileContents

Index = tuple[str, tuple[int, ...]]
"""An item of DCP's plan: its key and chunk offset."""


@dataclass(frozen=True)
class EarlierFile:
    """A data file of untrained tensors in the previous commit, as its record describes it."""

    name: str
    contents: FileContents
    checksum: FileChecksum
    size: int
    origin: str
    """Where its bytes were first written: what the new record's ``from`` says if it is shared."""


@dataclass(frozen=True)
class Reuse:
    """What a save's writer needs to share untrained tensors' files with the commit before it."""

    untrained: frozenset[str]
    """The DCP keys of the tensors nothing trains (grouped into files of their own)."""
    earlier_dir: str | None = None
    """The store's name of the previous commit's directory (None: the first save, nothing to share)."""
    earlier: tuple[EarlierFile, ...] = ()
    digests: Mapping[str, str] = field(default_factory=dict)
    """Digests taken at ``save()`` (by DCP key) of untrained tensors in host memory."""
    live: frozenset[str] = frozenset()
    """Those of them ``save()`` did not copy (the previous ``save()`` saw the same digest): the
    state holds the live tensor, whose bytes may be written only after checking its digest."""

    @classmethod
    def of(
        cls,
        untrained: Iterable[str],
        *,
        earlier_dir: str | None,
        earlier_name: str,
        files: Any,
        contents: Any,
        checksums: Any,
        digests: Mapping[str, str] | None = None,
        live: frozenset[str] = frozenset(),
    ) -> Reuse:
        """From the previous commit's record (``files``, ``contents``, ``checksums``); a file whose
        entries do not agree with each other is left out (written again, never shared)."""
        found = []
        for name, entry in sorted((contents or {}).items()):
            size = (files or {}).get(name)
            raw = (checksums or {}).get(name)
            if size is None or raw is None:
                continue
            try:
                checksum = FileChecksum.from_json(raw, size=size, where=name)
            except Exception:  # a damaged entry: that file is written again
                continue
            if len(checksum.segments) != len(entry.items) or not entry.items:
                continue
            origin = entry.shared_from or earlier_name
            found.append(EarlierFile(name, entry, checksum, size, origin))
        earlier = tuple(found) if earlier_dir is not None else ()
        return cls(frozenset(untrained), earlier_dir, earlier, dict(digests or {}), live)
