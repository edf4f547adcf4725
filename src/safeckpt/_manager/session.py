"""Opening a root: claim it if nobody writes it, else read; own it before the first write.

The opening half of :class:`~safeckpt._manager.manager.CheckpointManager`, on rank 0
(see :mod:`safeckpt._root.ownership` for the protocol and :mod:`safeckpt._root.startup`
for what an owner collects).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from .._dist.failures import root_not_writable
from .._format.catalog import Catalog, scan
from .._format.layout import Layout
from .._fs.fileops import FileOps
from .._fs.lock import SidecarLock
from .._root.ownership import Ownership, live_writer
from .._root.removal import Deleter
from .._root.startup import take_root
from ..errors import ConfigError, RootNotWritableError
from .saves import Committed, SaveView

logger = logging.getLogger("safeckpt.manager")


class OpenPath:
    """How a manager's rank 0 gets at its root: as a reader, a claimant, or the writer."""

    root: Path
    _layout: Layout
    _ops: FileOps
    _view: SaveView
    _lock: SidecarLock | None
    _ownership: Ownership | None
    _deleter: Deleter | None
    _lock_timeout: float
    _retry_interval: float
    read_only: bool
    _quarantine: Callable[[], None]

    def _open_root(self, lock_timeout: float, retry_interval: float) -> None:
        """Rank 0: claim the root if it is free, load the view.

        A claimant (no live owner was writing) recovers from an interrupted run
        and starts the deleter; otherwise this manager is a reader until its
        first save (see :mod:`safeckpt._root.ownership`). A root this process cannot
        write is opened for reading, with a warning that names the cause; with
        ``read_only=True`` nothing is written and nothing is said.
        """
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(
                f"{self.root} is a file, not a directory; pass the directory checkpoints go into "
                "(it is created if missing).",
                path=str(self.root),
            )
        self._lock = SidecarLock(self._layout.lock_path, timeout=lock_timeout)
        self._ownership = Ownership(self.root, self._lock, self._ops)
        self._retry_interval = retry_interval
        claimed = False
        if not self.read_only:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                claimed = self._ownership.try_claim(writing=False)
            except OSError as e:  # a read-only root or snapshot: restore still works
                error = root_not_writable(self.root, e, doing=f"opening {self.root}")
                logger.warning("safeckpt: %s Restoring works; save() raises until this is fixed.", error)
            else:
                if not claimed:
                    self._warn_live_writer()
        if claimed:
            self._take_root()
        else:
            self._load_view(self._read_catalog())

    def _read_catalog(self) -> Catalog:
        try:
            return scan(self.root)
        except OSError as e:
            raise ConfigError(
                f"{self.root} cannot be read ({type(e).__name__}: {e}); check its permissions, or pass "
                "a root this user can read.",
                path=str(self.root),
            ) from e

    def _warn_live_writer(self) -> None:
        owner = live_writer(self.root)
        if owner is not None:
            logger.warning(
                "safeckpt: %s is being written by another live job (%s). This manager can restore "
                "from it, but its save() raises RootInUseError while that job runs: a root has one "
                "writer at a time. Give this run its own root, or pass read_only=True to only read.",
                self.root,
                owner.describe(),
            )

    def _take_root(self) -> None:
        """Rank 0, once it owns the root: start-up collection, the view, the deleter."""
        assert self._lock is not None
        catalog = take_root(self._layout, self._lock, self._ops)
        self._load_view(catalog)
        self._quarantine()  # what a restore stepped over before this manager owned the root
        if self._deleter is None:
            self._deleter = Deleter(
                self._layout,
                self._lock,
                self._ops,
                retry_interval=self._retry_interval,
                on_idle=self._ownership.heartbeat,
            )
            self._deleter.start()
        self._deleter.schedule()

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

    def _ensure_writer(self, doing: str) -> None:
        """Rank 0, before anything is written: own the root, or raise an error that says why not.

        A live writer elsewhere is :class:`RootInUseError` at once. A root removed
        while this job ran (``rm -rf``) is made again, with a warning that its
        checkpoints are gone. Any ``OSError`` on the way is a
        :class:`RootNotWritableError` naming its cause (read-only, full, permission).
        """
        if self.read_only:
            raise RootNotWritableError(
                f"{doing}: this CheckpointManager of {self.root} was opened with read_only=True and "
                "writes nothing. Create it without read_only=True to save or pin (one writer per root).",
                path=str(self.root),
            )
        assert self._ownership is not None
        try:
            if self._ownership.writing and self._ownership.still_ours():
                return
            self._remake_removed_root()
            was_claimed = self._ownership.claimed and self._ownership.still_ours()
            self._ownership.claim_for_writing()
            if not was_claimed:
                self._take_root()  # another owner held it since we opened: collect what it left
        except OSError as e:
            raise root_not_writable(self.root, e, doing=doing) from e

    def _remake_removed_root(self) -> None:
        """A root removed under this job is made again; what it held is gone, and is said so.

        The root existed once this manager was opened (it made it), so a missing one was removed.
        """
        if os.path.isdir(self.root):
            return
        gone = sorted(c.record.step for c in self._view.snapshot()[0])
        logger.warning(
            "safeckpt: %s was removed while this job ran (by hand, or by another job); "
            "making it again. %s",
            self.root,
            f"The checkpoints it held (step(s) {', '.join(map(str, gone))}) are gone."
            if gone
            else "It held no committed checkpoint.",
        )
        self.root.mkdir(parents=True, exist_ok=True)
