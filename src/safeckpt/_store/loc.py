"""A name inside a store's root (:class:`Loc`), and how a path or URL becomes one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .base import Entry, Store, join, leaf, parent
from .registry import local_path, open_store


class Loc:
    """A name inside one store's root: the currency of the layers above the seam.

    Path arithmetic only (``loc / "metadata.json"``, ``.name``, ``.parent``); every
    operation on what it names goes through ``loc.store`` with ``loc.key``. It is
    shown (``str()``) as the store shows the name: a path for a local root.
    """

    __slots__ = ("key", "store")

    def __init__(self, store: Store, key: str = "") -> None:
        self.store = store
        self.key = key

    def __truediv__(self, part: str) -> Loc:
        return Loc(self.store, join(self.key, part))

    @property
    def name(self) -> str:
        return leaf(self.key)

    @property
    def parent(self) -> Loc:
        return Loc(self.store, parent(self.key))

    @property
    def where(self) -> Path | str:
        """How a person names it: a ``Path`` for a local root, else the store's URL and the name."""
        return shown(self.store, self.key)

    @property
    def on_disk(self) -> Path | None:
        """The file or directory on this machine's disk, for a local root (for a library that opens
        files itself: ``torch.load``, safetensors); None on object storage."""
        return None if local_path(self.store.url) is None else Path(self.store.where(self.key))

    def entry(self) -> Entry | None:
        """What is at this name (never through a link), or None."""
        return self.store.entry(self.key)

    def __str__(self) -> str:
        return str(self.where)

    def __repr__(self) -> str:
        return f"Loc({self.store.url!r}, {self.key!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Loc) and other.store.url == self.store.url and other.key == self.key

    def __hash__(self) -> int:
        return hash((self.store.url, self.key))

    def __reduce__(self) -> tuple[Any, ...]:
        # Across processes (other ranks) a name travels as its root's URL: the receiver opens
        # that root's store itself.
        return (_loc_at, (self.store.url, self.key))


def shown(store: Store, name: str = "") -> Path | str:
    """``name`` as the public API gives it: a ``Path`` for a local root (what callers of a path-taking
    API expect back), else its URL. The seam itself speaks in strings."""
    where = store.where(name)
    return Path(where) if local_path(store.url) is not None else where


def _loc_at(url: str, key: str) -> Loc:
    return Loc(open_store(url), key)


def as_loc(value: Loc | str | os.PathLike[str]) -> Loc:
    """A checkpoint directory as a name in its store: a :class:`Loc` as it is, else a path's leaf
    in the store of its parent."""
    if isinstance(value, Loc):
        return value
    local = local_path(value)  # a file:// URL's path; a mistyped URL is refused
    if local is None:
        text = os.fspath(value).rstrip("/")
        parent_url, _, name = text.rpartition("/")
        return Loc(open_store(parent_url), name)
    path = Path(local).absolute()
    return Loc(open_store(path.parent), path.name)


def as_root(value: Loc | Store | str | os.PathLike[str]) -> Loc:
    """A root as the :class:`Loc` of its store's top (a store, a path or a URL)."""
    if isinstance(value, Loc):
        return value
    return Loc(open_store(value), "")
