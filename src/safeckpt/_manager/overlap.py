"""Staging that overlaps the next step (``overlap_staging=True``): ``save()`` returns once it has
recorded what to copy; the copy runs on a thread of its own while training goes on.

Nothing changes a model's parameters or an optimizer's state before that
optimizer's ``step()``, and a module's buffers change only in a forward pass
(BatchNorm's running statistics). So each tensor of the state is *guarded*
by the hook that runs before the first change it can see:

* an optimizer in the state guards its parameters and its own state: a step
  pre-hook copies (or waits for) what of them is not copied yet;
* a module in the state guards its buffers: a forward pre-hook copies (or
  waits for) them; a submodule with buffers of its own guards those (its
  forward may run without its parent's, e.g. a block called by hand);
* any other tensor (one no hook can guard: a plain tensor, a parameter no
  optimizer in the state steps) is copied before ``save()`` returns;
* and any optimizer's step, one of the state's or not, first copies (or waits
  for) the groups whose tensors it steps: a process-wide step pre-hook. A fused
  optimizer (``fused=True``) changes its tensors without moving their version
  counters, so the check below could not see an optimizer outside the state
  stepping a guarded parameter.

Whoever comes first copies a guarded group: the thread or the hook, under the
group's lock, so the checkpoint holds each tensor as it was when ``save()`` was
called. What no hook can see, a change made by hand in place, is caught where
it costs nothing: each tensor's version counter is recorded at ``save()`` and
checked before its copy; a changed one fails the save (never a silent mix).
Once all is copied the hooks do nothing; they are removed at the next call
into the manager (removing one from inside PyTorch's loop over hooks, on
another thread, could break that loop).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._state.walk import Captured
from .._util.torch_private import foreach_copy_
from ..errors import SaveFailedError
from .background import StagingSlot, local_shard

logger = logging.getLogger("safeckpt.manager")


def _storage_key(tensor: torch.Tensor) -> int:
    return local_shard(tensor).untyped_storage().data_ptr()


@dataclass
class _Copy:
    key: str
    source: torch.Tensor  # the live tensor's local part
    target: torch.Tensor  # its staging buffer's local part
    version: int  # the source's version counter at save()


@dataclass
class _Group:
    """The tensors one hook guards."""

    what: str
    copies: list[_Copy]
    owners: list[Any]  # the optimizer, or the module and the state's module above it: hooked
    storages: set[int] = field(default_factory=set)  # of its tensors (see _storage_key)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False
    event: Any = None  # CUDA: when its copies are done
    waited: bool = False  # CUDA: the training stream waits for ``event`` (once is enough)


class OverlappedCopy:
    """One save's copy into its staging buffers: the unguarded part at ``save()``, each guarded
    group by the background thread or by its hook, whichever comes first.

    Call rules: built and started (:meth:`start`) on the training thread; :meth:`wait` from any thread;
    :meth:`remove_hooks` on the training thread, outside a forward or a step.
    """

    def __init__(self, groups: list[_Group], *, stream: Any = None, ready: Any = None) -> None:
        self._groups = groups
        self._stream = stream  # CUDA: the side stream the background copies run on
        self._ready = ready  # CUDA: the training stream's work up to save()
        self._done = threading.Event()
        self._handles: list[Any] = []
        self._owner = threading.get_ident()  # the thread that saved: the training thread
        self.error: SaveFailedError | None = None

    def guard(self) -> None:
        """Hook each group's owners: one hook per owner, copying its groups in order."""
        by_owner: dict[int, tuple[Any, list[_Group]]] = {}
        for group in self._groups:
            for owner in group.owners:
                by_owner.setdefault(id(owner), (owner, []))[1].append(group)
        for owner, groups in by_owner.values():
            if isinstance(owner, torch.optim.Optimizer):
                self._handles.append(owner.register_step_pre_hook(self._hook(groups)))
            else:  # first: a hook registered before (spectral norm's) may change a buffer
                self._handles.append(owner.register_forward_pre_hook(self._hook(groups), prepend=True))
        if self._groups:  # any other optimizer: one outside the state may step a guarded tensor
            hooked = {key for key, (owner, _) in by_owner.items() if isinstance(owner, torch.optim.Optimizer)}
            self._handles.append(register_optimizer_step_pre_hook(self._any_step(frozenset(hooked))))

    def start(self, copier: Copier) -> None:
        if not self._groups:
            self._done.set()
            return
        copier.submit(self)

    def cancel(self) -> None:
        """A save refused before its copy started: no copy, and no hooks left."""
        self.remove_hooks()
        self._done.set()

    def wait(self) -> None:
        """Until every group is copied (the writer thread, before it writes; the next ``save()``)."""
        self._done.wait()
        for group in self._groups:
            if group.event is not None:
                group.event.synchronize()

    def remove_hooks(self) -> bool:
        """Remove the hooks, on the thread that made the save only (another thread's removal could
        meet PyTorch's loop over an optimizer's hooks); whether they are gone."""
        if threading.get_ident() != self._owner:
            return not self._handles
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        return True

    def _hook(self, groups: list[_Group]) -> Callable[..., None]:
        def before(*_: Any) -> None:
            for group in groups:
                if not group.done or (group.event is not None and not group.waited):
                    self._copy(group, on_training_thread=True)

        return before

    def _any_step(self, hooked: frozenset[int]) -> Callable[..., None]:
        def before(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            if id(optimizer) in hooked:
                return  # the state's own: its hook copies its groups
            pending = [g for g in self._groups if not g.done or (g.event is not None and not g.waited)]
            if not pending:
                return
            stepped = {_storage_key(t) for t in _stepped(optimizer)}
            for group in pending:
                if not group.storages.isdisjoint(stepped):
                    self._copy(group, on_training_thread=True)

        return before

    def _run(self) -> None:
        try:
            for group in self._groups:
                self._copy(group, on_training_thread=False)
        except BaseException as e:  # never leave a waiter hanging
            self._fail(f"staging failed ({type(e).__name__}: {e})")
            logger.error("safeckpt: overlapped staging failed: %s", e)
        finally:
            self._done.set()

    def _copy(self, group: _Group, *, on_training_thread: bool) -> None:
        with group.lock:
            if not group.done:
                # Before the copy, and after it (a change made while it ran: the copy releases
                # the GIL, and on CUDA it runs on another stream) under the same lock.
                if self._unchanged(group):
                    self._copy_group(group, on_training_thread)
                    if group.event is not None and not on_training_thread:
                        group.event.synchronize()
                    self._unchanged(group)
                group.done = True
            if on_training_thread and group.event is not None and not group.waited:
                # CUDA: the step's kernels wait for the side stream's copy of this group, once.
                torch.cuda.current_stream().wait_event(group.event)
                group.waited = True

    def _unchanged(self, group: _Group) -> bool:
        changed = [c.key for c in group.copies if c.source._version != c.version]
        if changed:
            self._fail(
                f"{', '.join(changed[:5])} changed in place after save() and before it was "
                f"copied, outside what guards it ({group.what}): the checkpoint would not "
                "hold the state at save(). Change tensors of the state only through its "
                "optimizer and forward passes while a save with overlap_staging=True is "
                "copying, or call mgr.wait() first"
            )
        return not changed

    def _copy_group(self, group: _Group, on_training_thread: bool) -> None:
        with torch.no_grad():
            if all(c.source.device.type == "cpu" for c in group.copies):
                for c in group.copies:
                    c.target.copy_(c.source)
                return
            # CUDA: into pinned buffers without blocking; an event says when. The background
            # thread's side stream first waits for the training stream's work up to save().
            side = self._stream is not None and not on_training_thread
            stream = self._stream if side else torch.cuda.current_stream()
            # On the background thread the current device is cuda:0 until set: without the side
            # stream's device, every rank would make a context on GPU 0.
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                if side:
                    stream.wait_event(self._ready)
                for c in group.copies:
                    c.target.copy_(c.source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                group.event = event

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = SaveFailedError(f"this save failed: {why}. Earlier checkpoints are untouched.")


class Copier:
    """The thread that makes each save's background copy, one save after another (a manager's own:
    a thread started per save would cost ``save()`` its start-up)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[OverlappedCopy | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, pending: OverlappedCopy) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="safeckpt-stage", daemon=True)
            self._thread.start()
        self._queue.put(pending)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _work(self) -> None:
        while (pending := self._queue.get()) is not None:
            pending._run()


def _stepped(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    """The tensors ``optimizer``'s step changes: its parameters and its own state."""
    yield from (p for group in optimizer.param_groups for p in group["params"])
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    return f"the step pre-hook of {type(optimizer).__name__} at {id(optimizer):#x}"


def _module_name(module: nn.Module) -> str:
    return f"the forward pre-hook of {type(module).__name__} at {id(module):#x}"


def plan_copy(
    sources: dict[str, torch.Tensor],
    targets: dict[str, torch.Tensor],
    optimizers: Sequence[torch.optim.Optimizer],
    modules: Sequence[nn.Module],
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[_Group]]:
    """Split a save's copies: the unguarded ones (to copy now, as ``(target, source)``), and the
    groups each hook guards."""
    guard_of: dict[int, str] = {}
    shared: set[int] = set()
    owners: dict[str, list[Any]] = {}

    def claim(tensors: Iterable[torch.Tensor], what: str) -> None:
        for tensor in tensors:
            key = _storage_key(tensor)
            if guard_of.setdefault(key, what) != what:
                shared.add(key)  # two guards over one storage: neither alone can keep it

    for optimizer in optimizers:
        what = _optimizer_name(optimizer)
        owners[what] = [optimizer]
        claim(_stepped(optimizer), what)
    for module in modules:
        for owner in module.modules():
            own = [b for b in owner.buffers(recurse=False) if b is not None]
            if own:
                what = _module_name(owner)
                # The state's module too: its forward runs first, and a wrapper's (DDP's buffer
                # broadcast) may change them before the submodule's own hook would run.
                owners.setdefault(what, [owner])
                if module is not owner and module not in owners[what]:
                    owners[what].append(module)
                claim(own, what)
    now: list[tuple[torch.Tensor, torch.Tensor]] = []
    groups: dict[str, _Group] = {}
    for key, source in sources.items():
        local, target = local_shard(source).detach(), local_shard(targets[key])
        storage = _storage_key(source)
        guard = guard_of.get(storage)
        if guard is None or storage in shared:
            now.append((target, local))
            continue
        if guard not in groups:
            groups[guard] = _Group(guard, [], owners[guard])
        groups[guard].copies.append(_Copy(key, local, target, local._version))
        groups[guard].storages.add(storage)
    # Buffers first: the next forward needs them before the step needs the optimizer's tensors.
    ordered = sorted(groups.values(), key=lambda g: isinstance(g.owners[0], torch.optim.Optimizer))
    return now, ordered


def stage_overlapped(slot: StagingSlot, captured: Captured) -> tuple[dict[str, Any], OverlappedCopy]:
    """Stage ``captured`` into ``slot``: the unguarded tensors now, the rest later.

    Returns the staged tree (the slot's buffers: whole once the copy's :meth:`~OverlappedCopy.wait`
    returns) and that copy, with its hooks in place; the caller starts it as ``save()`` returns
    (started earlier, its thread would contend for the GIL with the rest of ``save()``).
    """
    targets = slot.buffers_for(captured.dcp)
    now, groups = plan_copy(captured.dcp, targets, captured.optimizers, captured.modules)
    with torch.no_grad():
        host = [(t, s) for t, s in now if s.device.type == "cpu"]
        if host:
            foreach_copy_([t for t, _ in host], [s for _, s in host])
        for target, source in now:
            if source.device.type != "cpu":
                target.copy_(source, non_blocking=True)
    stream = ready = None
    if any(c.source.device.type == "cuda" for g in groups for c in g.copies):
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        stream = torch.cuda.Stream()
    if any(s.device.type == "cuda" for _, s in now):
        torch.cuda.current_stream().synchronize()  # an unguarded tensor is the user's again now
    pending = OverlappedCopy(groups, stream=stream, ready=ready)
    try:
        pending.guard()
    except BaseException:
        pending.cancel()  # no hook left behind by a save that never was
        raise
    return targets, pending
