"""Which store serves a root: a local path, or a URL whose scheme a store registered.

A store implementation registers the schemes it serves when it is imported
(:mod:`safeckpt._posix` serves local paths); :func:`open_store` is how every
layer gets the store of a root it was given, and refuses a root no store
serves: a URL is never taken for a local directory. ``file://`` URLs name the
local path they hold (``file:///abs`` or ``file://localhost/abs``, fsspec's
reading); a path that starts like a URL and is not a well-formed one
(``s3:/x``, ``S3://x``, ``gs:x``) is refused with the likely spelling, not
created as ``./s3:/x``.
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
from .base import DIR, LINK, Store

LOCAL = "file"
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SCHEME_LIKE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(.*)$", re.DOTALL)
# Schemes people write storage URLs with (fsspec's, the clouds'). A path that starts with one of
# them and a colon, but not as a URL, is a mistyped URL; any other prefix ("exp:1/run") is a name.
URL_SCHEMES = frozenset(
    {
        "abfs", "abfss", "adl", "az", "dbfs", "file", "ftp", "gcs", "gs", "hdfs", "hf", "http",
        "https", "memory", "oss", "r2", "s3", "s3a", "sftp", "ssh", "wasb", "wasbs", "webhdfs",
    }
)  # fmt: skip

_factories: dict[str, Callable[..., Store]] = {}
ENTRY_POINTS = "safeckpt.stores"
"""The entry-point group of stores installed by other packages: ``scheme = module:factory``."""
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*$")


def register(scheme: str, factory: Callable[..., Store]) -> None:
    """Serve ``scheme`` (``"file"`` for local paths) with ``factory(root, ops=..., options=...)``;
    a scheme registered again is served by the new factory (stores already opened stay)."""
    if not isinstance(scheme, str) or not _SCHEME.match(scheme):
        raise ConfigError(f"{scheme!r} is not a URL scheme: lowercase letters, digits, '+', '.', '-'.")
    if not callable(factory):
        raise ConfigError(f"the store factory of {scheme}:// must be callable, got {type(factory).__name__}.")
    _factories[scheme] = factory


def _installed(scheme: str) -> Callable[..., Store] | None:
    """The factory another package installed for ``scheme`` (the ``safeckpt.stores`` entry-point
    group), loaded the first time a root of that scheme is opened; None where there is none."""
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group=ENTRY_POINTS) if e.name == scheme]
    if not found:
        return None
    try:
        factory = found[0].load()
    except Exception as e:  # a broken plugin is a configuration problem, said so
        raise ConfigError(
            f"the store of {scheme}:// installed by {found[0].value} could not be loaded "
            f"({type(e).__name__}: {e}); reinstall or remove that package."
        ) from e
    register(scheme, factory)
    return factory


def scheme_of(root: str | os.PathLike[str]) -> str:
    """The scheme of the store that serves ``root``: ``"file"`` for a path or a ``file://`` URL.

    Raises :class:`ConfigError` for a root that looks like a URL and is not a well-formed one.
    """
    return _parse(root)[0]


def local_path(root: str | os.PathLike[str]) -> str | None:
    """The local path ``root`` names (a ``file://`` URL's path, or the path as given), or None for
    a URL of another scheme. Raises :class:`ConfigError` as :func:`scheme_of` does."""
    scheme, target = _parse(root)
    return target if scheme == LOCAL else None


def _parse(root: str | os.PathLike[str]) -> tuple[str, str]:
    """``(scheme, what its store takes)``: ``("file", path)`` or ``(scheme, URL)``."""
    text = os.fsdecode(os.fspath(root))
    url = _URL.match(text)
    if url is not None:
        scheme = url.group(1)
        if scheme != scheme.lower() and scheme.lower() in URL_SCHEMES:
            raise _not_lowercase(text, scheme)
        if scheme.lower() == LOCAL:
            return LOCAL, _file_url_path(text)
        return scheme.lower(), text
    loose = _SCHEME_LIKE.match(text)
    if loose is not None and loose.group(1).lower() in URL_SCHEMES:
        raise _malformed(root, loose.group(1), loose.group(2))
    return LOCAL, text


def _file_url_path(url: str) -> str:
    host, slash, path = url[len("file://") :].partition("/")
    if host.lower() not in ("", "localhost"):
        raise ConfigError(
            f"{url!r} names the host {host!r}: safeckpt takes file:// URLs of this machine only "
            "(file:///ABSOLUTE/PATH or file://localhost/ABSOLUTE/PATH). Mount that directory here "
            "and pass its local path.",
            path=url,
        )
    if not slash:
        raise ConfigError(f"{url!r} names no path; write file:///ABSOLUTE/PATH.", path=url)
    return "/" + path


def _not_lowercase(url: str, scheme: str) -> ConfigError:
    spelled = scheme.lower() + url[len(scheme) :]
    return ConfigError(
        f"{url!r}: the URL scheme {scheme + '://'!r} is written in lowercase: did you mean {spelled!r}?",
        path=url,
    )


def _malformed(root: str | os.PathLike[str], written: str, rest: str) -> ConfigError:
    text, scheme = os.fsdecode(os.fspath(root)), written.lower()
    if scheme == LOCAL and not rest.startswith("/"):
        what = f"a file: URL names an absolute path; write file:///ABSOLUTE/PATH, or {rest!r} itself."
    else:
        spelled = scheme + ":///" + rest.lstrip("/") if scheme == LOCAL else scheme + "://" + rest.lstrip("/")
        what = f"did you mean {spelled!r}?"
    # pathlib merges the '//' of a URL: Path("s3://b/x") is "s3:/b/x"
    merged = " (a pathlib.Path merges a URL's '//': pass a URL as a str)" if not isinstance(root, str) else ""
    served = "" if scheme in _factories else f" safeckpt has no storage for {scheme}:// roots ({_serves()})."
    return ConfigError(
        f"{text!r} starts with the URL scheme {written + ':'!r} but is not a URL{merged}: {what}{served} "
        f"A URL is never taken for a local directory (for a directory of that name, write {'./' + text!r}).",
        path=text,
    )


def _serves() -> str:
    served = ", ".join(f"{s}://" for s in sorted(_factories) if s != LOCAL)
    return f"it serves local paths and {served}" if served else "it serves local paths"


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
    scheme, target = _parse(root)  # type: ignore[arg-type]
    factory = _factories.get(scheme) or _installed(scheme)
    if factory is None:
        raise ConfigError(
            f"{root}: safeckpt has no storage for {scheme}:// roots ({_serves()}); pass a local "
            "directory, or a URL of a scheme it serves. It never takes a URL for a local directory.",
            path=os.fspath(root),  # type: ignore[arg-type]
        )
    if scheme == LOCAL:
        if options:
            raise ConfigError(
                f"storage_options are for URL roots (s3://...); {root} is a local path and takes none.",
                path=os.fspath(root),  # type: ignore[arg-type]
            )
        return factory(Path(target), ops=ops)
    url = target.rstrip("/")
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


def check_root(store: Store, *, writing: bool) -> None:
    """Refuse a root that cannot hold checkpoints: a file, a symbolic link, or a path under a file.

    A root that does not exist passes (a writer creates it; a reader finds nothing in it). Through
    the store alone: a root's parents are looked at through the store that serves each of them.
    """
    where = store.where("")
    top = store.entry("")
    if top is None:
        blocker = _file_above(Path(where)) if local_path(store.url) is not None else None
        if blocker is not None:
            raise ConfigError(
                f"{where} is under {blocker}, which is a file, not a directory; choose a root whose "
                "parents are directories.",
                path=str(where),
            )
        return
    if top.kind == LINK:  # a root's names are never followed through a link, the root's own too
        raise ConfigError(
            f"{where} is a symbolic link{f' to {top.target}' if top.target else ''}, not a directory; "
            "pass the directory it points to.",
            path=str(where),
        )
    if top.kind != DIR:
        todo = (
            "pass the directory checkpoints go into (it is created if missing)"
            if writing
            else "pass a checkpoint root (the directory given to CheckpointManager) or a step_<N> "
            "directory in one"
        )
        raise ConfigError(f"{where} is a file, not a directory; {todo}.", path=str(where))


def _file_above(where: Path) -> Path | None:
    """The nearest existing parent of the local root ``where`` (missing), if it is not a directory.
    (An object store's prefixes are never files.)"""
    for parent in where.parents:
        entry = open_store(parent).entry("")
        if entry is not None:
            # a link is taken for a directory: where it points is the filesystem's to say
            return parent if entry.kind not in (DIR, LINK) else None
    return None


def _options_key(options: Mapping[str, Any] | None) -> str:
    return json.dumps(options or {}, sort_keys=True, default=repr)


_opened: dict[str, Store] = {}  # by URL: the last store opened for it (with its options)
_with_options: dict[tuple[str, str], Store] = {}  # by URL and options: a manager per epoch opens one
_opened_lock = threading.Lock()
