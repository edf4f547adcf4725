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
import enum
import logging
import operator
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._util.torch_private import dtensor_local, dtensor_with_local, foreach_copy_

logger = logging.getLogger(__name__)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


class SaveState(str, enum.Enum):
    """A save's life: QUEUED -> WRITING -> COMMITTED, or QUEUED -> CANCELLED, or -> FAILED.

    A ``str`` too, so that the public ``SaveStatus.status`` still equals and prints as
    ``"committed"``."""

    QUEUED = "queued"
    WRITING = "writing"
    COMMITTED = "committed"
    CANCELLED = "cancelled"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


QUEUED, WRITING, COMMITTED, CANCELLED, FAILED = SaveState


def _pin_available() -> bool:
    return torch.cuda.is_available()


class StagingSlot:
    """Host copies of one state, reused from save to save.

    A buffer is kept per position in the state tree (per DCP key for the flat
    dicts the manager stages) and reallocated only when the tensor there
    changes shape, dtype or kind; positions that disappear free their buffers.
    While a flat state keeps its keys, shapes and dtypes, staging costs one
    grouped copy (``torch._foreach_copy_``) and a few list comparisons, not a
    Python step per tensor. Not thread-safe: one save stages into a slot at a time.
    """

    def __init__(self, *, pin: bool | None = None) -> None:
        self.pin = _pin_available() if pin is None else pin
        self._buffers: dict[tuple[Any, ...], Any] = {}
        self.allocations = 0  # buffers created so far (tests and benchmarks read it)
        # The flat plan: the keys, (shape, dtype) of each source, and the buffers, in order.
        self._flat_keys: tuple[Any, ...] | None = None
        self._flat_meta: list[Any] = []  # (shape, dtype, is_cpu) per source (_META)
        self._flat_bufs: list[Any] = []
        self._flat_special: list[int] = []  # DTensors and device tensors: copied one by one
        self._flat_host_dst: list[torch.Tensor] = []  # buffers of the plain CPU sources, in order
        self._flat_device = False

    @property
    def nbytes(self) -> int:
        total = 0
        for buf in self._buffers.values():
            local = local_shard(buf)
            total += local.numel() * local.element_size()
        return total

    def stage(self, tree: Any) -> Any:
        """A copy of ``tree`` whose tensors live in this slot's buffers.

        Returns once every copy has finished (device copies synchronised).
        """
        if type(tree) is dict:
            sources = list(tree.values())
            try:
                metas = list(map(_META, sources))  # AttributeError: not all tensors
            except AttributeError:
                metas = None
            if metas is not None and (
                metas == self._flat_meta or all(isinstance(v, torch.Tensor) for v in sources)
            ):
                return self._stage_flat(tree, sources, metas)
        self._flat_keys = None
        self._flat_meta = []
        seen: set[tuple[Any, ...]] = set()
        device_copy = [False]
        with torch.no_grad():
            staged = self._stage(tree, (), seen, device_copy)
        for key in set(self._buffers) - seen:
            del self._buffers[key]
        if device_copy[0]:
            torch.cuda.synchronize()
        return staged

    def _stage_flat(
        self, tree: dict[Any, Any], sources: list[torch.Tensor], metas: list[Any]
    ) -> dict[Any, Any]:
        keys = tuple(tree)
        self._ensure_plan(keys, sources, metas)
        bufs = self._flat_bufs
        with torch.no_grad():  # a copy from a parameter must not record autograd history
            if self._flat_special:  # DTensors and device tensors: one by one
                special = set(self._flat_special)
                host_src = [s for i, s in enumerate(sources) if i not in special]
                for i in self._flat_special:
                    local = local_shard(sources[i])
                    local_shard(bufs[i]).copy_(local, non_blocking=local.device.type == "cuda" and self.pin)
            else:
                host_src = sources
            if host_src:
                foreach_copy_(self._flat_host_dst, host_src)
        if self._flat_device:
            torch.cuda.synchronize()
        return dict(zip(keys, bufs, strict=True))

    def buffers_for(self, tree: dict[Any, torch.Tensor]) -> dict[Any, Any]:
        """The buffers a flat dict of tensors is staged into, allocated or reused, not copied
        into: for a copy made elsewhere (:mod:`.overlap`)."""
        sources = list(tree.values())
        keys = tuple(tree)
        self._ensure_plan(keys, sources, list(map(_META, sources)))
        return dict(zip(keys, self._flat_bufs, strict=True))

    def _ensure_plan(self, keys: tuple[Any, ...], sources: list[torch.Tensor], metas: list[Any]) -> None:
        if (
            keys != self._flat_keys
            or metas != self._flat_meta
            or any(not _fits(self._flat_bufs[i], sources[i]) for i in self._flat_special)
        ):
            self._plan_flat(keys, sources, metas)

    def _plan_flat(self, keys: tuple[Any, ...], sources: list[torch.Tensor], metas: list[Any]) -> None:
        """(Re)build the flat plan, keeping every buffer that still fits its key."""
        old = self._buffers
        self._buffers = {}
        bufs = []
        for key, source in zip(keys, sources, strict=True):
            buf = old.get((key,))
            if buf is None or not _fits(buf, source):
                buf = self._allocate(source)
            self._buffers[(key,)] = buf
            bufs.append(buf)
        self._flat_keys = keys
        self._flat_meta = metas
        self._flat_bufs = bufs
        self._flat_special = [
            i for i, s in enumerate(sources) if _is_dtensor(s) or local_shard(s).device.type != "cpu"
        ]
        special = set(self._flat_special)
        self._flat_host_dst = [b for i, b in enumerate(bufs) if i not in special]
        self._flat_device = any(local_shard(sources[i]).device.type != "cpu" for i in self._flat_special)

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
        source = local_shard(tensor).detach()
        buf = self._buffers.get(path)
        if buf is None or not _fits(buf, tensor):
            buf = self._allocate(tensor)
            self._buffers[path] = buf
        target = local_shard(buf)
        non_blocking = source.device.type == "cuda" and self.pin
        target.copy_(source, non_blocking=non_blocking)
        if source.device.type != "cpu":
            device_copy[0] = True
        return buf

    def _allocate(self, tensor: torch.Tensor) -> Any:
        self.allocations += 1
        local = local_shard(tensor)
        host = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=self.pin)
        if DTensor is not None and isinstance(tensor, DTensor):
            # Keep the DTensor wrapper (mesh, placements, global shape) around a host local
            # tensor; DCP writes the local shard and records the global layout.
            return dtensor_with_local(tensor, host)
        return host


# What a flat plan depends on: each buffer's shape and dtype, and which sources are copied one by
# one (DTensors, and tensors not on the CPU: is_cpu, not device, which builds an object per tensor).
_META = operator.attrgetter("shape", "dtype", "is_cpu")


def _is_dtensor(tensor: Any) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def local_shard(tensor: Any) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    if DTensor is not None and isinstance(tensor, DTensor):
        return dtensor_local(tensor)
    return tensor


def _fits(buf: Any, tensor: Any) -> bool:  # tensor: a Tensor or a DTensor
    is_dtensor = DTensor is not None and isinstance(tensor, DTensor)
    if is_dtensor != (DTensor is not None and isinstance(buf, DTensor)):
        return False
    if is_dtensor and (
        buf.placements != tensor.placements
        or buf.device_mesh != tensor.device_mesh
        or buf.shape != tensor.shape
    ):
        return False
    local, source = local_shard(buf), local_shard(tensor)
    return local.shape == source.shape and local.dtype == source.dtype


class StagingPool:
    """``depth`` staging slots; ``acquire`` blocks while all are in use."""

    def __init__(
        self, depth: int, *, pin: bool | None = None, slot: Callable[..., StagingSlot] | None = None
    ) -> None:
        make = slot or StagingSlot  # a subclass stages other containers (Lightning's checkpoint dict)
        self._free = [make(pin=pin) for _ in range(depth)]
        self.slots = tuple(self._free)
        self._cond = threading.Condition()

    def acquire(self, timeout: float | None = None) -> StagingSlot:
        """A free slot; raises ``TimeoutError`` if none frees up within ``timeout`` s."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout):
                raise TimeoutError(f"no staging slot freed up within {timeout:g} s")
            return self._free.pop()

    def release(self, slot: StagingSlot) -> None:
        with self._cond:
            if slot not in self._free:
                self._free.append(slot)
                self._cond.notify()

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self.slots)


class BackgroundWriter:
    """A thread that runs ``persist(job)`` for each submitted job, in submission order.

    ``persist`` must not raise (it records failures on the job); if it does,
    the error is logged, set on the job, and the thread goes on.
    """

    def __init__(
        self,
        persist: Callable[[Any], None],
        *,
        name: str = "safeckpt-writer",
        on_crash: Callable[[Any, BaseException], None] | None = None,
    ) -> None:
        self._persist = persist
        self._on_crash = on_crash
        self._queue: queue.Queue[Any] = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Any) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put(job)

    @property
    def alive(self) -> bool:
        """The writer thread has not stopped (a job may be running)."""
        return self._thread.is_alive()

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
                if self._on_crash is not None:
                    self._on_crash(job, e)
                else:
                    job.error = job.error or e
                    job.status = FAILED
            finally:
                job.done.set()
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
