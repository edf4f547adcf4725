"""What one restore has verified, kept while it runs: whole small files by their recorded checksum,
and checkpoints whose files were found to match their record.

A restore looks at the same few things several times: rank 0 verifies the
checkpoint it chooses, each rank then checks its own files and reads its
train-state file, and the load reads ``.metadata`` and the train-state file
again. On object storage each look is a round trip. What is kept is keyed by
what the record promises (a file's size and checksum, the commit a record
describes), so a checkpoint replaced meanwhile is looked at anew. Outside a
:func:`keeping` scope nothing is kept; the outermost scope's end forgets all.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator

from .._store.loc import Loc
from .._util.forksafe import reset_in_child

# A whole file kept only up to this size: the train-state file and .metadata, not data files.
_MAX_KEPT_BYTES = 64 << 20

_lock = threading.Lock()
_scopes = 0  # keeping() scopes open, across threads
_bytes: dict[tuple[Loc, Hashable], bytes] = {}
_matched: set[tuple[Loc, Hashable]] = set()


@contextlib.contextmanager
def keeping() -> Iterator[None]:
    """Inside (nested, or overlapping across threads), verified reads are kept for the next."""
    global _scopes
    reset_in_child(_reset_in_child)
    with _lock:
        _scopes += 1
    try:
        yield
    finally:
        with _lock:
            _scopes -= 1
            if _scopes == 0:
                _bytes.clear()
                _matched.clear()


def verified_bytes(path: Loc, promise: Hashable) -> bytes | None:
    """The bytes of ``path`` already read and found to be what ``promise`` (size, checksum) says."""
    with _lock:
        return _bytes.get((path, promise))


def keep_bytes(path: Loc, promise: Hashable, data: bytes) -> None:
    with _lock:
        if _scopes and len(data) <= _MAX_KEPT_BYTES:
            _bytes[(path, promise)] = data


def files_matched(directory: Loc, commit: Hashable) -> bool:
    """Whether ``directory``'s files were found to match the record of ``commit`` in this scope."""
    with _lock:
        return (directory, commit) in _matched


def note_files_match(directory: Loc, commit: Hashable) -> None:
    with _lock:
        if _scopes:
            _matched.add((directory, commit))


def _reset_in_child() -> None:
    # A child forked by another thread during a restore has no one to end that scope.
    global _lock, _scopes
    _lock = threading.Lock()
    _scopes = 0
    _bytes.clear()
    _matched.clear()
