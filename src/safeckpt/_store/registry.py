"""Which store serves a root: a local path, or a URL whose scheme a store registered.

A store implementation registers the schemes it serves when it is imported
(:mod:`safeckpt._posix` serves local paths); :func:`open_store` is how every
layer gets the store of a root it was given, and refuses a root no store
serves: an ``s3://`` URL is never taken for a local directory.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .base import Store

LOCAL = "file"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

_factories: dict[str, Callable[..., Store]] = {}


def register(scheme: str, factory: Callable[..., Store]) -> None:
    """Serve ``scheme`` (``"file"`` for local paths) with ``factory(root, ops=...)``."""
    _factories[scheme] = factory


def scheme_of(root: str | os.PathLike[str]) -> str:
    match = _SCHEME.match(os.fspath(root)) if isinstance(root, str) else None
    return match.group(1).lower() if match else LOCAL


def is_store(value: Any) -> bool:
    return hasattr(value, "entries") and hasattr(value, "commit_dir")


def open_store(
    root: str | os.PathLike[str] | Store, *, ops: Any = None, options: Mapping[str, Any] | None = None
) -> Store:
    """The store of ``root`` (a store is returned as it is); a root no store serves is refused.

    ``options`` (``storage_options=``) are the settings of a URL's store (credentials, endpoint).
    The store opened with them is kept for its URL, so a name that travels to another part of the
    process as its root's URL (a pickled :class:`~safeckpt._store.loc.Loc`) finds the same store.
    """
    if is_store(root):
        return root  # type: ignore[return-value]
    scheme = scheme_of(root)  # type: ignore[arg-type]
    factory = _factories.get(scheme)
    if factory is None:
        served = ", ".join(f"{s}://" for s in sorted(_factories) if s != LOCAL)
        raise ConfigError(
            f"{root}: safeckpt has no storage for {scheme}:// roots"
            f"{f' (it serves local paths and {served})' if served else ' (it serves local paths)'}; "
            "pass a local directory, or a URL of a scheme it serves. It never takes a URL for a "
            "local directory.",
            path=os.fspath(root),  # type: ignore[arg-type]
        )
    if scheme == LOCAL:
        if options:
            raise ConfigError(
                f"storage_options are for URL roots (s3://...); {root} is a local path and takes none.",
                path=os.fspath(root),  # type: ignore[arg-type]
            )
        return factory(Path(root), ops=ops)  # type: ignore[arg-type]
    url = os.fspath(root).rstrip("/")  # type: ignore[arg-type]
    with _opened_lock:
        if options is None and url in _opened:
            return _opened[url]
        same = _with_options.get((url, _options_key(options)))
        if same is not None and ops is None:
            _opened[url] = same
            return same
        store = factory(url, ops=ops, options=options)
        _opened[store.url] = store
        if ops is None:
            _with_options[(store.url, _options_key(options))] = store
        return store


def _options_key(options: Mapping[str, Any] | None) -> str:
    return json.dumps(options or {}, sort_keys=True, default=repr)


_opened: dict[str, Store] = {}  # by URL: the last store opened for it (with its options)
_with_options: dict[tuple[str, str], Store] = {}  # by URL and options: a manager per epoch opens one
_opened_lock = threading.Lock()
