"""The storage seam: what every place that holds checkpoint roots must do (:class:`Store`).

Code above the seam speaks of names inside a root (``"step_5/metadata.json"``)
and calls a :class:`Store` for every listing, read, write, commit and removal;
it never calls the operating system on a path of a root. The implementation
for POSIX filesystems is :class:`safeckpt._posix.PosixStore`. The contract is
in :mod:`.base` and ``docs/architecture.md``.
"""

from .base import DIR, FILE, LINK, OTHER, Entry, Lock, ReadHandle, Store, join, leaf, parent
from .loc import Loc, as_loc, as_root
from .registry import open_store, register

__all__ = [
    "DIR",
    "FILE",
    "LINK",
    "OTHER",
    "Entry",
    "Loc",
    "Lock",
    "ReadHandle",
    "Store",
    "as_loc",
    "as_root",
    "join",
    "leaf",
    "open_store",
    "parent",
    "register",
]
