"""Staging buffers and the background write queue.

``save()`` copies the state into a :class:`StagingSlot` (host buffers that are
allocated once and reused while the state keeps its shapes; pinned when CUDA
is there) and hands a :class:`SaveJob` to the :class:`BackgroundWriter`. The
writer runs jobs one at a time, in order, on its own thread; each job gives its
slot back as soon as its data is on disk, before fsync and commit end, so the
next ``save()`` waits for the staging slot and not for the whole previous write.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .retention import CheckpointInfo

logger = logging.getLogger(__name__)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]

# A job's life: QUEUED -> WRITING -> COMMITTED, or QUEUED -> CANCELLED, or -> FAILED.
QUEUED = "queued"
WRITING = "writing"
COMMITTED = "committed"
CANCELLED = "cancelled"
FAILED = "failed"


def _pin_available() -> bool:
    return torch.cuda.is_available()


class StagingSlot:
    """Host copies of one state, reused from save to save.

    A buffer is kept per position in the state tree and reallocated only when
    the tensor there changes shape, dtype or kind; positions that disappear
    free their buffers. Not thread-safe: one save stages into a slot at a time.
    """

    def __init__(self, *, pin: bool | None = None) -> None:
        self.pin = _pin_available() if pin is None else pin
        self._buffers: dict[tuple[Any, ...], Any] = {}
        self.allocations = 0  # buffers created so far (tests and benchmarks read it)

    @property
    def nbytes(self) -> int:
        total = 0
        for buf in self._buffers.values():
            local = _local(buf)
            total += local.numel() * local.element_size()
        return total

    def stage(self, tree: Any) -> Any:
        """A copy of ``tree`` whose tensors live in this slot's buffers.

        Returns once every copy has finished (device copies synchronised).
        """
        seen: set[tuple[Any, ...]] = set()
        device_copy = [False]
        staged = self._stage(tree, (), seen, device_copy)
        for key in set(self._buffers) - seen:
            del self._buffers[key]
        if device_copy[0]:
            torch.cuda.synchronize()
        return staged

    def _stage(
        self, value: Any, path: tuple[Any, ...], seen: set[tuple[Any, ...]], device_copy: list[bool]
    ) -> Any:
        if isinstance(value, torch.Tensor):
            seen.add(path)
            return self._copy(value, path, device_copy)
        if isinstance(value, Mapping):
            return {k: self._stage(v, (*path, k), seen, device_copy) for k, v in value.items()}
        if isinstance(value, list):
            return [self._stage(v, (*path, i), seen, device_copy) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self._stage(v, (*path, i), seen, device_copy) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _copy(self, tensor: torch.Tensor, path: tuple[Any, ...], device_copy: list[bool]) -> Any:
        source = _local(tensor).detach()
        buf = self._buffers.get(path)
        if buf is None or not _fits(buf, tensor):
            buf = self._allocate(tensor)
            self._buffers[path] = buf
        target = _local(buf)
        non_blocking = source.device.type == "cuda" and self.pin
        target.copy_(source, non_blocking=non_blocking)
        if source.device.type != "cpu":
            device_copy[0] = True
        return buf

    def _allocate(self, tensor: torch.Tensor) -> Any:
        self.allocations += 1
        local = _local(tensor)
        host = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=self.pin)
        if DTensor is not None and isinstance(tensor, DTensor):
            # Keep the DTensor wrapper (mesh, placements, global shape) around a host local
            # tensor; DCP writes the local shard and records the global layout.
            return DTensor(host, tensor._spec, requires_grad=False)
        return host


def _local(tensor: Any) -> torch.Tensor:
    if DTensor is not None and isinstance(tensor, DTensor):
        return tensor._local_tensor
    return tensor


def _fits(buf: Any, tensor: torch.Tensor) -> bool:
    is_dtensor = DTensor is not None and isinstance(tensor, DTensor)
    if is_dtensor != (DTensor is not None and isinstance(buf, DTensor)):
        return False
    if is_dtensor and (
        buf.placements != tensor.placements
        or buf.device_mesh != tensor.device_mesh
        or buf.shape != tensor.shape
    ):
        return False
    local, source = _local(buf), _local(tensor)
    return local.shape == source.shape and local.dtype == source.dtype


class StagingPool:
    """``depth`` staging slots; ``acquire`` blocks while all are in use."""

    def __init__(self, depth: int, *, pin: bool | None = None) -> None:
        self._free = [StagingSlot(pin=pin) for _ in range(depth)]
        self.slots = tuple(self._free)
        self._cond = threading.Condition()

    def acquire(self) -> StagingSlot:
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self._free.pop()

    def release(self, slot: StagingSlot) -> None:
        with self._cond:
            if slot not in self._free:
                self._free.append(slot)
                self._cond.notify()

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self.slots)


@dataclass(eq=False)
class SaveJob:
    """One save, from ``save()`` to its outcome. ``status`` changes under the manager's view lock."""

    seq: int
    step: int
    staging_dir: Path
    dcp_state: Any
    train_state: bytes
    metrics: Mapping[str, float | None]
    extra: Mapping[str, Any]
    time: float
    pinned: bool = False
    slot: StagingSlot | None = None
    status: str = QUEUED
    cancel_requested: bool = False
    committed_here: bool = False  # rank 0 committed it (set by the commit itself)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)

    def info(self) -> CheckpointInfo:
        return CheckpointInfo(self.step, self.metrics, self.time, self.pinned)

    def release_staging(self, pool: StagingPool | None) -> None:
        """Drop references to staged data and give the slot back (idempotent)."""
        self.dcp_state = None
        if self.slot is not None and pool is not None:
            pool.release(self.slot)
        self.slot = None


class BackgroundWriter:
    """A thread that runs ``persist(job)`` for each submitted job, in submission order.

    ``persist`` must not raise (it records failures on the job); if it does,
    the error is logged, set on the job, and the thread goes on.
    """

    def __init__(self, persist: Callable[[SaveJob], None], *, name: str = "safeckpt-writer") -> None:
        self._persist = persist
        self._queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put(job)

    @property
    def pending(self) -> int:
        with self._idle:
            return self._pending

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted job has finished; False if ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
            return True

    def close(self) -> None:
        """Finish queued jobs, then stop the thread. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._persist(job)
            except BaseException as e:  # never let the writer thread die
                logger.exception("safeckpt writer: unexpected error while saving step %d", job.step)
                job.error = job.error or e
                job.status = FAILED
            finally:
                job.done.set()
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
