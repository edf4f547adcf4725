"""Which data files of untrained tensors a save shares with the checkpoint before it, and which it writes.

A save hands its writer a :class:`Reuse`: the DCP keys of the tensors nothing
trains, and the data files of untrained tensors the root's previous commit
holds (:class:`EarlierFile`, from its record's ``contents`` and checksums). The
writer digests those tensors (:mod:`.content_digest`, on the staged copy) and
:func:`group` decides:

* an earlier file every item of which is in this save with the same digest (the
  same key, chunk, dtype, shape and bytes) is *shared*: the store makes it part
  of the new checkpoint (a hard link on a filesystem) and the new record takes
  its checksums; the items' places are the earlier file's;
* every other untrained item is written, in two new files: those whose digest is
  the one the earlier checkpoint recorded for them (unchanged, in a file that
  also held something that changed), and the rest (new, or changed). The first
  is shared by the next save; what keeps changing (a buffer updated in
  ``forward``) stays apart from it.

Content alone decides: a tensor changed through ``.data``, merged into, or
loaded from elsewhere has another digest and is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._format.sharing import EarlierFile, Index, Reuse

__all__ = ["EarlierFile", "Grouping", "Index", "Reuse", "group"]


@dataclass
class Grouping:
    """What :func:`group` decided for one rank's untrained items."""

    shared: list[tuple[EarlierFile, list[Any]]] = field(default_factory=list)
    """Earlier files to share, each with this save's items in the file's order."""
    written: list[list[Any]] = field(default_factory=list)
    """New files of untrained items to write."""


def group(
    items: Sequence[Any],
    digests: dict[Index, str],
    earlier: Sequence[EarlierFile],
    *,
    share: Callable[[EarlierFile], bool],
    index: Callable[[Any], Index],
) -> Grouping:
    """Share the earlier files whose every item is unchanged (``share`` makes one part of the new
    checkpoint and says whether it could), and group the rest into files to write."""
    by_index = {index(item): item for item in items}
    taken: set[Index] = set()
    out = Grouping()
    for file in earlier:
        wanted = [i.index for i in file.contents.items]
        if len(set(wanted)) != len(wanted) or any(
            k in taken or k not in by_index or digests[k] != i.digest
            for k, i in zip(wanted, file.contents.items, strict=True)
        ):
            continue
        if not share(file):
            continue
        taken.update(wanted)
        out.shared.append((file, [by_index[k] for k in wanted]))
    known = {i.index: i.digest for file in earlier for i in file.contents.items}
    rest = [item for item in items if index(item) not in taken]
    unchanged = [item for item in rest if known.get(index(item)) == digests[index(item)]]
    changed = [item for item in rest if known.get(index(item)) != digests[index(item)]]
    out.written = [g for g in (unchanged, changed) if g]
    return out
