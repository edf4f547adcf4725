"""The :class:`Store` protocol: what a place that holds checkpoint roots must do, and guarantee.

Names are relative to the root, ``/``-separated, with no ``.`` or ``..`` part
(``""`` is the root itself): ``"step_5"``, ``".staging/step_5.0a1b2c3d4e5f/__0_0.distcp"``.
Nothing above this layer builds a path or calls the operating system on one.

What each operation must guarantee, for the invariants of the design:

* ``write_atomic`` (records, ``latest``, the owner record) and ``write_stream``
  (a file too large to build in memory first): a reader sees the old content
  or the new, whole, never a mix; durable when it returns (7).
* ``commit_dir``: the one commit instant of a checkpoint (1). After it returns
  ``final`` holds what ``staged`` held, durably. A store that can exchange two
  names atomically leaves no instant without a complete ``final``; one that
  cannot moves the old copy to ``displaced`` first (a name start-up recovery
  puts back, 2) and to ``retired`` after.
* ``move``: atomic; the caller makes it durable with ``sync`` of both parents.
  A pruned or damaged checkpoint leaves resume's sight at that instant (3).
* ``remove``: one attempt at removing a tree (or a file); an ``OSError`` is
  raised as it came, so the caller's bounded retries decide what is transient
  (5). Never follows a link out of the root.
* ``entries``/``entry`` never follow a link: a linked directory lists as
  empty, so nothing is ever read or removed elsewhere through one (10).
* ``read_small``/``open_read`` open regular files only (a link, FIFO or device
  is :class:`UnsafeCheckpointError`, never a hang) and report sizes before a
  byte is read (10).
* ``lock``: excludes every other thread and process that takes it on this root
  (7, 11); reentrant in one thread.
* ``dcp_writer``/``dcp_reader``: DCP's storage for one checkpoint directory.
  The writer checksums every byte it writes (``.checksums``) and makes each
  file durable; the reader checks every item it reads against ``checksums``
  before its bytes reach the state, and takes DCP's ``.metadata`` from
  ``metadata()`` (the caller's verified, restricted read), never from the file
  itself (9, 10).

Readers take no lock: a record or pointer is replaced atomically, so a reader
sees a whole one; anything else it reads may be replaced or removed under it,
which the layers above tell from damage (:mod:`safeckpt._format.identity`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

FILE = "file"
DIR = "dir"
LINK = "link"
OTHER = "other"  # a FIFO, socket or device: never opened


@dataclass(frozen=True)
class Entry:
    """What is at one name: its kind and, for a regular file, its size in bytes (a link's size is
    the length of its target, as POSIX counts it)."""

    name: str
    """The last part of the name."""
    kind: str
    size: int = 0
    target: str = ""
    """For a link, where it points (stores without links never have one)."""


def join(*parts: str) -> str:
    """Names joined with ``/``, empty parts left out (``join("", "step_5")`` is ``"step_5"``)."""
    return posixpath.join(*[p for p in parts if p]) if any(parts) else ""


def parent(name: str) -> str:
    return posixpath.dirname(name)


def leaf(name: str) -> str:
    return posixpath.basename(name)


class ItemInfos(list[Any]):
    """The storage info (``.metadata``'s ``_StorageInfo``) of each item of a load plan, in the plan's
    order, as that plan's ``storage_data``: set by a planner that looked them up already."""


class ReadHandle(Protocol):
    """An open regular file: its size when opened, and reads of any range of it (a context manager
    that closes it)."""

    size: int

    def read(self, offset: int, length: int) -> bytes: ...

    def close(self) -> None: ...

    def __enter__(self) -> ReadHandle: ...

    def __exit__(self, *exc: Any) -> None: ...


class Lock(Protocol):
    """The root's inter-process lock (a reentrant context manager)."""

    timeout: float

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: Any) -> None: ...

    def held(self) -> bool: ...

    def close(self) -> None: ...


class Store(Protocol):
    """Every name and byte of one checkpoint root (see the module docstring for the contract).

    Call rules: thread-safe; the caller holds ``lock()`` where the design asks
    for it (record writes, commits, removal attempts), never for reads.
    """

    url: str
    """How a person names the root: a local path, or a URL."""
    small_reads_at_once: int
    """How many small reads (records, markers) to have in flight together: 1 where a read is a
    system call, more where each is a network round trip."""

    def where(self, name: str = "") -> str:
        """``name`` as a person names it (a path for a local root, else a URL), for messages.
        The public API's results turn it into a ``Path`` for a local root (``_store.loc.shown``)."""
        ...

    # --- names ---------------------------------------------------------------

    def entries(self, name: str = "") -> list[Entry]: ...

    def entry(self, name: str) -> Entry | None: ...

    def make_dir(self, name: str) -> None: ...

    def move(self, src: str, dst: str) -> None: ...

    def commit_dir(self, staged: str, final: str, *, displaced: str, retired: str) -> bool: ...

    def remove(self, name: str) -> None: ...

    def sync(self, name: str = "") -> None: ...

    # --- files -----------------------------------------------------------------

    def read_small(self, name: str, *, limit: int, what: str) -> bytes: ...

    def open_read(self, name: str) -> ReadHandle: ...

    def write_atomic(self, name: str, data: bytes) -> None: ...

    def write_new(self, name: str, data: bytes) -> None:
        """A file of a save's own staging area, which no reader looks at before its commit: durable
        when it returns, without ``write_atomic``'s rename (one per rank per save)."""
        ...

    def write_stream(self, name: str, write: Callable[[Any], object]) -> None:
        """What ``write(file)`` writes, as one file: readers see the old file or the new one,
        whole; durable on return; nothing left behind if ``write`` raises."""
        ...

    def read_pointer(self, name: str) -> str | None: ...

    def write_pointer(self, name: str, target: str) -> None: ...

    # --- checkpoints' bytes (DCP) ------------------------------------------------

    def dcp_writer(self, directory: str, *, direct_io: bool, dcp_own: bool, reuse: Any = None) -> Any:
        """DCP's writer of ``directory``. ``reuse`` (a :class:`safeckpt._storage.reuse.Reuse`, or
        None): write the untrained tensors into files of their own, and make an earlier
        checkpoint's file of them part of this one, unwritten, where every item is unchanged; the
        writer's ``contents`` then say which (see ``docs/format.md``)."""
        ...

    def dcp_reader(
        self,
        directory: str,
        *,
        checksums: Mapping[str, Any] | None,
        step: int | None,
        direct_io: bool,
        dcp_own: bool,
        metadata: Callable[[], Any],
    ) -> Any:
        """DCP's reader of ``directory``; its ``.metadata`` is ``metadata()``, read by the caller
        (checked against the record, through the restricted unpickler), never by the reader."""
        ...

    def dcp_prefetch(self, directory: str, rank: int, *, direct_io: bool) -> Callable[[], None]:
        """Start reading ``rank``'s data file of ``directory`` into the page cache (where the store
        has one) while the restore prepares; the callable says the read is done with."""
        ...

    # --- the root as a whole -------------------------------------------------------

    def lock(self, *, timeout: float) -> Lock: ...

    def free_space(self) -> int | None: ...

    def explain_error(self, error: OSError) -> tuple[str, str]:
        """What ``error`` (met on this store) means in words, and what to do about it."""
        ...

    def sleep(self, seconds: float) -> None:
        """Wait between retries (a seam: the tests count the waits, and need not sleep them)."""
        ...
