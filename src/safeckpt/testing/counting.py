"""A ``FileOps`` that counts removal attempts and retry waits, by thread and by cleanup pass.

The NFS scenario tests and ``benchmarks/bench_nfs_prune.py`` assert and report on
counts, not on clocks: how many ``rmtree`` attempts and waits each cleanup pass
made, and whether the training thread ever removed or waited.

    ops = CountingFileOps()
    mgr = CheckpointManager(root, file_ops=ops)
    ops.watch(mgr)          # attribute each wait to the deleter pass that asked for it
    ...
    ops.close(mgr)          # passes from here on are the close() drain's
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._fs.fileops import FileOps
from .._root.removal import PassResult

if TYPE_CHECKING:
    from .._manager.manager import CheckpointManager


@dataclass
class CleanupPass:
    """One pass of the deleter over the trash, as seen through the seam."""

    thread: str
    closing: bool
    """Whether it ran in ``close()``'s drain rather than during training."""
    sleeps: list[float] = field(default_factory=list)
    rmtrees: int = 0
    result: PassResult | None = None

    @property
    def refused(self) -> int:
        """Trash entries this pass could not remove."""
        return len(self.result.remaining) if self.result is not None else 0


class CountingFileOps(FileOps):
    """Real file operations, counted. Thread-safe.

    The thread that creates it is taken as the training thread; its removals,
    waits and renames into the trash are counted (and timed) apart, until
    :meth:`close`.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._current = threading.local()
        self.passes: list[CleanupPass] = []
        self.closing = False
        self.training_thread = threading.get_ident()
        self.training_rmtrees = 0
        self.training_sleeps: list[float] = []
        self.training_seconds = 0.0
        """Time the training thread spent removing, waiting, and renaming into the trash."""
        self.attempts: Counter[str] = Counter()
        """``rmtree`` attempts per path."""

    # --- the seam -----------------------------------------------------------------

    def rmtree(self, path: Path) -> None:
        started = time.monotonic()
        try:
            super().rmtree(path)
        finally:
            with self._guard:
                self.attempts[str(path)] += 1
            self._note(time.monotonic() - started, rmtree=True)

    def sleep(self, seconds: float) -> None:
        started = time.monotonic()
        super().sleep(seconds)
        self._note(time.monotonic() - started, sleep=seconds)

    def replace(self, src: Path, dst: Path) -> None:
        started = time.monotonic()
        super().replace(src, dst)
        if Path(dst).parent.name == ".trash":
            self._note(time.monotonic() - started)

    def _note(self, seconds: float, *, rmtree: bool = False, sleep: float | None = None) -> None:
        with self._guard:
            if threading.get_ident() == self.training_thread and not self.closing:
                self.training_rmtrees += rmtree
                if sleep is not None:
                    self.training_sleeps.append(sleep)
                self.training_seconds += seconds
            current: CleanupPass | None = getattr(self._current, "cleanup", None)
            if current is not None:
                current.rmtrees += rmtree
                if sleep is not None:
                    current.sleeps.append(sleep)

    # --- passes -------------------------------------------------------------------

    def watch(self, mgr: CheckpointManager) -> None:
        """Spy on ``mgr``'s deleter (rank 0) so each wait is attributed to its pass."""
        deleter = mgr._session.deleter
        if deleter is None:
            raise ValueError("this manager has no deleter (not rank 0)")
        run_pass = deleter.run_pass

        def counted_pass(*args: Any, **kwargs: Any) -> PassResult:
            record = CleanupPass(threading.current_thread().name, self.closing)
            with self._guard:
                self.passes.append(record)
            self._current.cleanup = record
            try:
                record.result = run_pass(*args, **kwargs)
                return record.result
            finally:
                self._current.cleanup = None

        deleter.run_pass = counted_pass  # type: ignore[method-assign]

    def training_passes(self) -> list[CleanupPass]:
        """The passes that ran before :meth:`close` (in the background, during training)."""
        with self._guard:
            return [p for p in self.passes if not p.closing]

    def close(self, mgr: CheckpointManager) -> None:
        """Close ``mgr``; passes from here on are counted as its drain's."""
        with self._guard:
            self.closing = True
        mgr.close()
