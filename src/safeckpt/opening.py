"""Opening a root: claim it if nobody writes it, else read; own it before the first write.

The opening half of :class:`~safeckpt.manager.CheckpointManager`, on rank 0
(see :mod:`safeckpt.ownership` for the protocol and :mod:`safeckpt.startup`
for what an owner collects).
"""

from __future__ import annotations

import logging
from pathlib import Path

from .catalog import Catalog, scan
from .errors import ConfigError
from .fileops import FileOps
from .layout import Layout
from .lock import SidecarLock
from .ownership import Ownership
from .removal import Deleter
from .startup import take_root
from .view import Committed, SaveView

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

    def _open_root(self, lock_timeout: float, retry_interval: float) -> None:
        """Rank 0: claim the root if it is free, load the view.

        A claimant (no live owner was writing) recovers from an interrupted run
        and starts the deleter; otherwise this manager is a reader until its
        first save (see :mod:`safeckpt.ownership`).
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
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            claimed = self._ownership.try_claim(writing=False)
        except OSError as e:  # a read-only root or snapshot: restore still works
            logger.info("safeckpt: %s is not writable (%s); opened for reading only", self.root, e)
            claimed = False
        if claimed:
            self._take_root()
        else:
            self._load_view(scan(self.root))

    def _take_root(self) -> None:
        """Rank 0, once it owns the root: start-up collection, the view, the deleter."""
        assert self._lock is not None
        catalog = take_root(self._layout, self._lock, self._ops)
        self._load_view(catalog)
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

    def _ensure_writer(self) -> None:
        """Rank 0, before anything is written: own the root (waiting for a live writer, then raising)."""
        assert self._ownership is not None
        if self._ownership.writing and self._ownership.still_ours():
            return
        was_claimed = self._ownership.claimed and self._ownership.still_ours()
        self._ownership.claim_for_writing(self._lock_timeout)
        if not was_claimed:
            self._take_root()  # another owner held it since we opened: collect what it left
