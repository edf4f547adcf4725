"""A manager's hold on its root (rank 0): claim it if nobody writes it, else read; own it
before the first write; give it up at ``close()``.

See :mod:`safeckpt._root.ownership` for the protocol and :mod:`safeckpt._root.startup`
for what an owner collects.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from .._dist.failures import root_not_writable, storage_error, unreachable
from .._format.catalog import Catalog, scan
from .._format.layout import Layout
from .._root.ownership import OwnedLock, Ownership, in_use_error
from .._root.removal import Deleter
from .._root.startup import take_root
from .._store.base import DIR, Lock
from .._store.registry import check_root
from ..errors import CheckpointError, RootInUseError, RootNotWritableError
from .damaged import DamagedCommits
from .saves import Committed, SaveView

logger = logging.getLogger("safeckpt.manager")


class RootSession:
    """Rank 0's hold on one root: the sidecar lock, the owner record, the background deleter.

    Call rules: rank 0 only; ``open()`` once, then ``ensure_writer()`` before
    every write (``ensure_claimed()`` in ``save()``, whose writes the writer thread
    checks) and ``drain()``/``release()`` at ``close()``. ``lock``,
    ``ownership`` and ``deleter`` are None until ``open()`` made them
    (``deleter`` until this manager owns the root).
    """

    def __init__(
        self,
        layout: Layout,
        view: SaveView,
        damaged: DamagedCommits,
        *,
        read_only: bool,
        lock_timeout: float,
        retry_interval: float,
    ) -> None:
        self.root = layout.root
        self.read_only = read_only
        self._layout = layout
        self._store = layout.store
        self._view = view
        self._damaged = damaged
        self._lock_timeout = lock_timeout
        self._retry_interval = retry_interval
        self.lock: Lock | None = None
        self.ownership: Ownership | None = None
        self.deleter: Deleter | None = None
        # Staging names start-up collection keeps: in use by another writer of this run, or kept
        # on purpose (see :class:`~.tiering.TierSetup`); never leftovers.
        self.keep_staging: Callable[[str], bool] | None = None
        self._claiming = threading.Lock()  # ensure_writer() runs on the caller's and the writer thread
        # A root that saves wait for (made while they commit elsewhere): what happens while it does
        # not answer, for the warning; None: such a root is RootUnreachableError (see open()).
        self.when_unreachable: str | None = None

    def open(self) -> None:
        """Claim the root (before any restore), load the view.

        Afterwards this manager owns the root, or it raised :class:`RootInUseError` naming the
        live owner (see :mod:`safeckpt._root.ownership`); it may wait first, saying so, while a
        previous owner on another machine is not yet proven dead. The owner recovers from an
        interrupted run and starts the deleter. A root this process cannot write is opened for
        reading, with a warning that names the cause; with ``read_only=True`` nothing is
        written, nothing is claimed and nothing is said. A root whose storage does not answer
        at all is :class:`RootUnreachableError`, unless ``when_unreachable`` says what happens
        meanwhile: then it opens empty, with a warning, and is claimed at its first write.
        """
        check_root(self._store, writing=not self.read_only)  # a file, a link, or under a file
        raw = self._store.lock(timeout=self._lock_timeout)
        self.ownership = Ownership(self.root, raw)
        self.lock = OwnedLock(raw, self.ownership)
        claimed = False
        if not self.read_only:
            try:
                self._store.make_dir(self.root.key)
                self.ownership.claim()
                claimed = True
            except OSError as e:  # a read-only root or snapshot, a server refusing writes: reads work
                error = root_not_writable(self.root, e, doing=f"opening {self.root}")
                if not self._readable(e):
                    return
                logger.warning("safeckpt: %s Restoring works; save() raises until this is fixed.", error)
        if claimed:
            try:
                self._take_root()
            except BaseException as e:  # the claim goes with the error: no owner left behind alive
                self.release()
                if isinstance(e, OSError) and not isinstance(e, CheckpointError):
                    raise storage_error(self.root, e, doing=f"opening {self.root}") from e
                raise
        elif self._readable(None):
            self._load_view(self._read_catalog())

    def _readable(self, refused: OSError | None) -> bool:
        """Whether the root can be read (after ``refused``, a write that failed): a storage that does
        not answer at all is :class:`RootUnreachableError`, or, tolerated, an empty view."""
        if refused is not None and not isinstance(refused, ConnectionError):
            return True
        try:
            self._store.entry(self.root.key)
            return True
        except ConnectionError as e:
            if self.when_unreachable is None:
                raise unreachable(self.root, e, doing=f"opening {self.root}") from e
            logger.warning("safeckpt: %s cannot be reached now (%s); %s", self.root, e, self.when_unreachable)
            self._view.load([], None, next_seq=0)
            return False

    def move_damaged_aside(self) -> None:
        """Move what a restore stepped over to ``.damaged/``, if this manager owns the root."""
        self._damaged.move_aside(self.lock, self.ownership)

    def drain(self, timeout: float) -> None:
        """Keep deleting the trash for up to ``timeout`` s (at ``close()``)."""
        if self.deleter is not None:
            self.deleter.drain(timeout)

    def release(self) -> list[BaseException]:
        """Stop the deleter, give the root up, close the lock file; every step runs, errors returned."""
        errors: list[BaseException] = []
        for action in (
            self.deleter.close if self.deleter is not None else None,
            self.ownership.release if self.ownership is not None else None,
            self.lock.close if self.lock is not None else None,
        ):
            if action is None:
                continue
            try:
                action()
            except BaseException as e:
                errors.append(e)
        return errors

    def _read_catalog(self) -> Catalog:
        try:
            return scan(self.root)
        except OSError as e:
            raise storage_error(self.root, e, doing=f"opening {self.root}") from e

    def _take_root(self) -> None:
        """Once this manager owns the root: start-up collection, the view, the deleter."""
        assert self.lock is not None and self.ownership is not None
        catalog = take_root(self._layout, self.lock, keep=self.keep_staging)
        self._load_view(catalog)
        self.move_damaged_aside()  # what a restore stepped over before this manager owned the root
        if self.deleter is None:
            self.deleter = Deleter(self._layout, self.lock, retry_interval=self._retry_interval)
        self.deleter.start()  # again, if it stopped when the root was lost
        self.deleter.schedule()

    def _load_view(self, catalog: Catalog) -> None:
        for entry in catalog.entries:
            if not entry.committed:
                logger.warning(
                    "safeckpt: ignoring %s: %s. It is neither loaded nor pruned; delete it if it "
                    "is not yours.",
                    entry.path,
                    entry.problem,
                )
        committed = [Committed(e.path, e.record) for e in catalog.newest_first() if e.record]
        self._view.load(committed, catalog.latest_step, next_seq=catalog.next_seq)

    def ensure_claimed(self, doing: str) -> None:
        """``save()``'s check on the training thread: own the root unless this manager already does.

        No storage request while this manager holds its claim: the writer thread confirms it with
        :meth:`ensure_writer` before it writes each save, and every write under the lock checks it
        again (:class:`~safeckpt._root.ownership.OwnedLock`), so training does not wait for a
        round trip (on object storage, a GET) in every ``save()``. A root lost since is then that
        save's failure, raised by the next call. Errors as :meth:`ensure_writer`.
        """
        assert self.ownership is not None
        if self.read_only or not self.ownership.claimed:
            self.ensure_writer(doing)

    def ensure_writer(self, doing: str) -> None:
        """Before anything is written: own the root, or raise an error that says why not.

        A root taken over by another writer (this one was paused or cut off for too long) is
        :class:`RootInUseError`, for good: this manager writes nothing more there. A live writer
        elsewhere is :class:`RootInUseError` too (a root that could not be claimed at start, a
        read-only one since fixed, is claimed here). A root removed while this job ran
        (``rm -rf``) is made again, with a warning that its checkpoints are gone. Any ``OSError``
        on the way is a :class:`RootNotWritableError` naming its cause (read-only, full,
        permission).
        """
        if self.read_only:
            raise RootNotWritableError(
                f"{doing}: this CheckpointManager of {self.root} was opened with read_only=True and "
                "writes nothing. Create it without read_only=True to save or pin (one writer per root).",
                path=str(self.root),
            )
        ownership = self.ownership
        assert ownership is not None
        with self._claiming:
            try:
                if ownership.claimed and ownership.still_ours():
                    return
                if ownership.claimed:  # the record no longer names us: taken over, or gone (rm -rf)
                    with contextlib.suppress(RootInUseError):
                        ownership.check()  # marks the claim lost, to a new owner or to nobody
                if ownership.lost_to is not None:
                    raise in_use_error(self.root, ownership.lost_to, lost=True)
                self._remake_removed_root()
                ownership.claim()
                self._take_root()  # not ours before: collect what the last owner left
            except OSError as e:
                raise root_not_writable(self.root, e, doing=doing) from e

    def _remake_removed_root(self) -> None:
        """A root removed under this job is made again; what it held is gone, and is said so.

        The root existed once this manager was opened (it made it), so a missing one was removed.
        """
        top = self.root.entry()
        if top is not None and top.kind == DIR:
            return
        gone = sorted(c.record.step for c in self._view.snapshot()[0])
        logger.warning(
            "safeckpt: %s was removed while this job ran (by hand, or by another job); making it again. %s",
            self.root,
            f"The checkpoints it held (step(s) {', '.join(map(str, gone))}) are gone."
            if gone
            else "It held no committed checkpoint.",
        )
        self._store.make_dir(self.root.key)
