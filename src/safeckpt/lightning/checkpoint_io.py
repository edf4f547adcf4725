"""SafeCheckpointIO: a Lightning ``CheckpointIO`` whose async saves and removals never race.

Lightning's ``AsyncCheckpointIO`` hands each save to a thread pool and lets
``remove_checkpoint`` delete a path blindly; a top-k removal that reaches a save
still in the queue finds nothing, and the write then creates the file: a stale
checkpoint ``ModelCheckpoint`` believes it deleted. Here every save of a path
is in the core's :class:`~safeckpt._manager.ledger.SaveLedger` (the mechanism
the manager's saves use, keyed by path), and a removal is a decision about it:

* queued: the save is cancelled and never written;
* writing: the file is removed right after its write ends, never during it;
* committed (or a file from an earlier run): renamed into ``<dir>/.trash/`` at
  once, then deleted by the background :class:`~safeckpt._root.removal.Deleter`
  (NFS retries, the shared 0.75 s budget, drained at ``teardown()``).

Each file is what ``torch.save(checkpoint)`` writes (Lightning's own format),
written through the directory's store as one file (``Store.write_stream``: on
disk a temp sibling, fsynced, ``os.replace``-d into place and the directory
fsynced; on S3 one upload that appears whole): a kill at any instant leaves the
previous file or the new one. A path may be local or an ``s3://`` URL.

Call rules: Lightning calls ``save_checkpoint`` and ``remove_checkpoint``
on global rank 0 only (this class does nothing on other ranks, like Lightning's
own plugins), ``load_checkpoint`` on every rank, ``teardown()`` after each
``fit``/``validate``; all from the training thread.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_only

from .._dist.failures import root_not_writable
from .._format.layout import Layout
from .._fs.fileops import DEFAULT_FILE_OPS, FileOps
from .._manager.background import COMMITTED, FAILED, BackgroundWriter, StagingPool, StagingSlot
from .._manager.ledger import Flight, SaveLedger
from .._posix import PosixStore
from .._root.removal import Deleter
from .._store.base import LINK, Entry, Lock, Store
from .._store.handle_file import HandleFile
from .._store.loc import Loc
from .._store.registry import LOCAL, check_root, local_path, open_store, scheme_of
from .._util.torch_private import load_lightning_file
from ..errors import CheckpointNotFoundError, ConfigError, SaveFailedError
from . import trainer_hooks
from .checkpoint_file import TEMP_NAME, CheckpointSlot

logger = logging.getLogger(__name__)

__all__ = ["SafeCheckpointIO", "StorageOptionsError"]


class StorageOptionsError(ConfigError, TypeError):
    """``save_checkpoint(..., storage_options=...)`` got options this plugin does not support."""


def _keep_on_cpu(storage: Any, location: str) -> Any:
    return storage  # Lightning's default map_location: tensors stay where torch.load puts them


@dataclass(eq=False)
class _Save(Flight):
    """One save of one path: what to write; its state is the ledger's.

    ``data`` and ``slot`` belong to whoever moved it out of the queue: the
    canceller (training thread) or the writer (which started it).
    """

    seq: int
    path: Loc
    data: Any
    slot: StagingSlot | None  # a CheckpointSlot of the plugin's pool

    @property
    def step(self) -> int:  # BackgroundWriter names a job by its step in its logs
        return self.seq


@dataclass
class _Dir:
    """The removal machinery of one checkpoint directory: its trash, lock and deleter."""

    layout: Layout
    lock: Lock
    deleter: Deleter

    @property
    def store(self) -> Store:
        return self.layout.store


class SafeCheckpointIO(CheckpointIO):
    """Async, atomic, race-free checkpoint files for Lightning: ``Trainer(plugins=[SafeCheckpointIO()])``.

    Args:
        async_save: ``save_checkpoint`` returns once the checkpoint's tensors are
            copied into reused host buffers; a background thread writes the file.
            False: it returns once the file is durable.
        queue_depth: saves that may be staged while earlier ones are written
            (each costs one host copy of the checkpoint). When all are in use,
            ``save_checkpoint`` waits for the oldest write to end.
        drain_timeout: how long ``teardown()`` keeps retrying deletions of removed
            checkpoints (a slow NFS server can hold a ``.nfs`` file for seconds).
        lock_timeout: how long to wait for a directory's sidecar lock (``<dir>/.lock``).
        retry_interval: seconds between background deletion passes while some fail.
        file_ops: the filesystem seam of local paths (tests inject faults and delays through it).

    A background write error is raised once, as :class:`~safeckpt.SaveFailedError`,
    by the next ``save_checkpoint``/``remove_checkpoint``/``load_checkpoint``/``wait``
    or by ``teardown()``, then cleared. Paths are local (or mounted) files, or
    ``s3://`` URLs: then ``storage_options`` (Lightning passes the Trainer's) are the S3
    settings, over the standard ``AWS_*`` variables. As the Trainer starts, each
    ``ModelCheckpoint``'s directory is checked, and ``fit(ckpt_path="last")`` finds the
    ``last`` file of a URL dirpath (:mod:`.trainer_hooks`).
    """

    def __init__(
        self,
        *,
        async_save: bool = True,
        queue_depth: int = 2,
        drain_timeout: float = 30.0,
        lock_timeout: float = 300.0,
        retry_interval: float = 1.0,
        file_ops: FileOps | None = None,
    ) -> None:
        if isinstance(queue_depth, bool) or not isinstance(queue_depth, int) or queue_depth < 1:
            raise ConfigError(f"SafeCheckpointIO(queue_depth={queue_depth!r}): must be a positive integer.")
        trainer_hooks.install(SafeCheckpointIO)  # the Trainer's start: see trainer_hooks
        self.async_save = async_save
        self.queue_depth = queue_depth
        self.drain_timeout = drain_timeout
        self.lock_timeout = lock_timeout
        self.retry_interval = retry_interval
        self._ops = file_ops or DEFAULT_FILE_OPS
        self._saves: SaveLedger[Loc, _Save] = SaveLedger()  # queued and writing, by path
        self._error_lock = threading.Lock()
        self._error: BaseException | None = None
        self._seq = 0
        self._writer: BackgroundWriter | None = None
        self._pool: StagingPool | None = None
        self._dirs: dict[str, _Dir] = {}  # by the directory's URL (its path, for a local one)
        self._dirs_lock = threading.Lock()
        self._roots: dict[str, Loc] = {}  # each directory's store, opened once
        self._swept: set[str] = set()  # directories whose leftover temp files were collected
        self.cancelled = 0  # saves a removal cancelled before they were written (tests read it)
        self.removed_after_write = 0  # saves a removal reached while they were being written

    # --- Lightning's interface -------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` to ``path`` (rank 0); see the class doc for when it returns.

        Raises :class:`StorageOptionsError` for ``storage_options`` on a local path (or
        options an ``s3://`` path does not take), and a failed earlier background save (once).
        """
        self._raise_pending()
        if not _is_rank_zero():
            return
        target = self._file(path, storage_options)
        if target.store.url not in self._swept:  # this plugin's first save into the directory
            self._sweep(target.parent, self._check(target.parent))
        target.store.make_dir(target.parent.key)
        if not self.async_save:
            _write(target, checkpoint)
            return
        writer, pool = self._start()
        slot = pool.acquire()
        try:
            data = slot.stage(checkpoint)
        except BaseException:
            pool.release(slot)
            raise
        self._seq += 1
        job = _Save(self._seq, target, data, slot)
        with self._saves.lock:
            # Superseded: this save writes the same path later.
            self._cancelled(self._saves.cancel_queued(target))
            self._saves.add(target, job)
        writer.submit(job)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any | None = _keep_on_cpu,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load ``path`` with ``torch.load`` (waiting first for this plugin's saves of it)."""
        self._raise_pending()
        target = self._file(path)
        self._saves.wait(target)
        self._raise_pending()
        try:
            on_disk = target.on_disk
            if on_disk is not None:  # as Lightning reads it: through a link too
                return load_lightning_file(on_disk, map_location=map_location, weights_only=weights_only)
            with target.store.open_read(target.key) as handle:
                stream = io.BufferedReader(HandleFile(handle), buffer_size=1 << 20)
                return torch.load(stream, map_location=map_location, weights_only=weights_only)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"Checkpoint file not found: {target}", path=str(target)) from e

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Make ``path`` go away: cancel its queued save, remove it after its write, or trash it (rank 0)."""
        self._raise_pending()
        if not _is_rank_zero():
            return
        target = self._file(path)
        removal = self._saves.remove(target)  # a save being written: the writer trashes it after
        self._cancelled(removal.cancelled)
        self.removed_after_write += len(removal.deferred)
        if not removal.writing:
            # No save of this path is queued or writing now, and the single writer starts
            # none before the next save_checkpoint: the file on disk is committed.
            self._discard(target)

    def teardown(self) -> None:
        """Wait for every save, drain the trash, stop the threads; raise a failed save once.

        Idempotent, and the plugin can be used again afterwards (Lightning tears
        it down after ``validate`` and again after ``fit``).
        """
        try:
            if self._writer is not None:
                self._writer.wait_idle()
                self._writer.close()
        finally:
            self._writer = None
            self._pool = None  # frees the host buffers between runs
            with self._dirs_lock:
                dirs, self._dirs = self._dirs, {}
            for d in dirs.values():
                d.deleter.drain(self.drain_timeout)
                d.deleter.close()
                d.lock.close()
        self._raise_pending()

    # --- extras ------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until every save handed in so far is durable (or failed); raise a failure once."""
        if self._writer is not None:
            self._writer.wait_idle()
        self._raise_pending()

    def check_dir(self, dirpath: str | os.PathLike[str]) -> None:
        """Raise a :class:`~safeckpt.CheckpointError` now if checkpoints cannot go into ``dirpath``
        (a missing bucket, a directory that is or is under a file, a mistyped URL).

        Called as the Trainer starts, for the directory of each ``ModelCheckpoint``, and at this
        plugin's first save into a directory.
        """
        text = local_path(dirpath)
        directory = os.path.abspath(text) if text is not None else os.fspath(dirpath).rstrip("/")
        self._check(self._directory(directory))

    def pending_paths(self) -> list[Path | str]:
        """Paths with a save queued or being written, oldest first (URLs for ``s3://`` ones)."""
        pending = self._saves.keys()
        return [loc.where for loc in pending]

    # --- the mechanism -----------------------------------------------------------------

    def _start(self) -> tuple[BackgroundWriter, StagingPool]:
        if self._writer is None or self._pool is None:
            self._pool = StagingPool(self.queue_depth, slot=CheckpointSlot)
            self._writer = BackgroundWriter(
                self._persist, name="safeckpt-lightning-writer", on_crash=self._crashed
            )
        return self._writer, self._pool

    def _cancelled(self, jobs: Iterable[_Save]) -> None:
        """Saves the ledger cancelled while queued: their buffers go back at once."""
        for job in jobs:
            self.cancelled += 1
            self._release(job)
            logger.info("safeckpt: cancelled the queued save of %s (removed before it was written)", job.path)

    def _release(self, job: _Save) -> None:
        job.data = None
        if job.slot is not None and self._pool is not None:
            self._pool.release(job.slot)
        job.slot = None

    def _persist(self, job: _Save) -> None:
        """Writer thread: write one save unless it was cancelled; trash it after if it was removed."""
        if not self._saves.start(job):
            return  # cancelled while queued
        data = job.data
        error: BaseException | None = None
        try:
            _write(job.path, data)
        except Exception as e:
            error = e
        finally:
            del data
            self._release(job)
        if error is None:
            self._saves.finish(job, COMMITTED)
        else:
            failure = SaveFailedError(
                f"writing the checkpoint {job.path} failed ({type(error).__name__}: {error}); the "
                "file is unchanged (a previous version, if any, is intact). Check the disk and "
                "its permissions; training can go on.",
                path=str(job.path),
                cause=error,
            )
            failure.__cause__ = error
            self._saves.finish(job, FAILED, failure)
            self._fail(failure)
        # Ended, so no removal can mark it any more: remove_after is final here.
        if job.remove_after and error is None:
            self._discard(job.path)

    def _crashed(self, job: _Save, error: BaseException) -> None:
        """Writer thread: ``_persist`` raised past its own handling; the save failed."""
        self._release(job)
        self._saves.finish(job, FAILED, error)

    def _fail(self, error: SaveFailedError) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = error
                return
        logger.error("safeckpt: %s", error)

    def _discard(self, target: Loc) -> None:
        """Rename a committed file into ``<dir>/.trash/`` and let the deleter remove it."""
        if target.entry() is None:
            return
        d = self._dir(target.parent)
        trash = d.layout.trash / f"{target.name}.{uuid.uuid4().hex[:12]}"
        try:
            with d.lock:
                d.store.make_dir(d.layout.trash.key)
                with contextlib.suppress(FileNotFoundError):  # already gone
                    d.store.move(target.name, trash.key)
        except OSError as e:  # removal never fails training; the caller sees a warning
            logger.warning("safeckpt: could not remove %s (%s); remove it by hand", target, e)
            return
        d.deleter.schedule()

    def _check(self, directory: Loc) -> list[Entry]:
        """What ``directory`` holds; raises a :class:`~safeckpt.CheckpointError` if checkpoints
        cannot go there (the raw error of a store would come later, from the writer thread)."""
        top = directory.entry()
        if top is None or top.kind != LINK:  # a linked directory is written through, as Lightning does
            check_root(directory.store, writing=True)
        try:
            return directory.store.entries(directory.key)  # a missing bucket refuses a listing
        except OSError as e:
            raise root_not_writable(directory, e, doing="SafeCheckpointIO") from e

    def _sweep(self, directory: Loc, listing: list[Entry]) -> None:
        """Trash the temp files of writes a crash interrupted (before this plugin's first save there).

        Only names this plugin's local writes make (``.<name>.tmp.<12 hex>``); one writer
        per directory is assumed, as Lightning writes from global rank 0 only.
        """
        self._swept.add(directory.store.url)
        temps = [e for e in listing if TEMP_NAME.fullmatch(e.name)]
        if not temps:
            return
        d = self._dir(directory)
        with d.lock:
            d.store.make_dir(d.layout.trash.key)
            for temp in temps:
                with contextlib.suppress(FileNotFoundError):
                    d.store.move(temp.name, (d.layout.trash / temp.name).key)
        logger.info("safeckpt: collected %d interrupted write(s) in %s", len(temps), directory)
        d.deleter.schedule()

    def _dir(self, directory: Loc) -> _Dir:
        with self._dirs_lock:  # the training and the writer thread both remove
            d = self._dirs.get(directory.store.url)
            if d is None:
                layout = Layout(directory)
                lock = layout.store.lock(timeout=self.lock_timeout)
                deleter = Deleter(layout, lock, retry_interval=self.retry_interval)
                deleter.start()
                d = self._dirs[directory.store.url] = _Dir(layout, lock, deleter)
            return d

    def _file(self, path: str | os.PathLike[str], storage_options: Any | None = None) -> Loc:
        """``path`` as a file in the store of its directory (that store's root is the directory)."""
        text = local_path(path)  # a file:// URL's path; a mistyped URL is refused, never created
        if text is not None:
            _check_storage_options(storage_options)
            local = Path(os.path.abspath(text))
            directory, name = str(local.parent), local.name
        else:
            directory, _, name = os.fspath(path).rstrip("/").rpartition("/")
        return self._directory(directory, storage_options) / name

    def _directory(self, directory: str, storage_options: Any | None = None) -> Loc:
        """The store of ``directory`` (an absolute path or a URL), whose root it is; opened once."""
        with self._dirs_lock:
            root = self._roots.get(directory)
            if root is None or storage_options:
                if scheme_of(directory) == LOCAL:
                    store: Store = PosixStore(directory, self._ops)
                else:
                    store = _open_url(directory, storage_options)
                root = self._roots[directory] = Loc(store)
        return root

    def _raise_pending(self) -> None:
        with self._error_lock:
            error, self._error = self._error, None
        if error is not None:
            raise error


def _is_rank_zero() -> bool:
    return getattr(rank_zero_only, "rank", 0) == 0


def _write(target: Loc, checkpoint: Any) -> None:
    """``torch.save`` streamed into ``target`` as one file (old or new, whole, at every instant)."""
    target.store.write_stream(target.key, lambda f: torch.save(checkpoint, f))


def _check_storage_options(options: Any) -> None:
    if options is None or (isinstance(options, Mapping) and not options):
        return
    raise StorageOptionsError(
        f"SafeCheckpointIO takes no storage_options={options!r} for a local path: it writes one "
        "torch.save file per checkpoint, atomically. Drop storage_options (they are for s3:// "
        "paths), or use a CheckpointIO that defines them."
    )


def _open_url(directory: str, options: Any) -> Store:
    try:
        return open_store(directory, options=options or None)
    except ConfigError as e:
        if options and "storage_options" in str(e):
            raise StorageOptionsError(str(e)) from e
        raise
