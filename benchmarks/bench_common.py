"""Shared pieces of the benchmarks: states, timing, simple raw I/O, cache eviction.

Every benchmark measures a ratio against a limit measured in the same run and
the same repetition (raw memcpy, raw write + fsync, raw cold read), so a noisy,
shared machine moves numerator and denominator together. Repetitions are
interleaved (the order of the variants rotates from one repetition to the next).

:func:`raw_write` and :func:`raw_read` are one strategy each (chunked writes,
one-thread reads): a baseline, not a limit. ``bench_limits`` measures limits
that are limits (the fastest of several strategies, on fresh paths);
``bench_tables`` holds the results (re-exported here) and the verdicts across runs.

A benchmark script prints its tables as Markdown on stdout; ``--json PATH`` also
writes them as data (:meth:`Report.load` reads it back), which ``run_all.py``
merges over its 3 interleaved runs into the blocks of ``benchmarks/results.md``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import platform
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

# Results live in bench_tables; the scripts import them from here.
from bench_tables import BEATEN as BEATEN
from bench_tables import Report as Report
from bench_tables import Row as Row
from bench_tables import Table as Table

if TYPE_CHECKING:
    from safeckpt import CheckpointManager

GIB = 1 << 30
MIB = 1 << 20
_CHUNK = 64 * MIB  # one os.write/os.readv call; large enough to keep the syscall count negligible


# --- timing -----------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes (monotonic clock)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rotated_rounds(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Seconds of each function, once per round, in an order rotated every round: subjects timed
    side by side, so a server's drift over the run (moto slows as it holds more) falls on all."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(reps):
        turn = r % len(names)
        for name in names[turn:] + names[:turn]:
            times[name].append(timed(fns[name]))
    return times


def steal_seconds() -> float:
    """Steal time of every CPU so far, in seconds: what a VM's host ran instead of this guest
    (``/proc/stat``; 0 where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def wrap(owner: Any, name: str, label: str, spent: dict[str, float]) -> Callable[..., Any]:
    """Replace ``owner.name`` by a copy that adds its time to ``spent[label]`` (a trace's timer;
    ``spent`` a ``defaultdict(float)``); returns the copy."""
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)  # callers that inspect the signature (DCP's planners) see the original's
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start

    setattr(owner, name, timed)
    return timed


def interleaved(items: Sequence[Any], rep: int) -> list[Any]:
    """The order in which repetition ``rep`` runs ``items``: row ``rep`` of a Williams design.

    Over ``n`` repetitions (``2n`` for an odd ``n``) every item runs once in
    every position, and for an even ``n`` every item follows every other one
    exactly once (odd: twice, over ``2n``). A plain rotation kept the same
    neighbours in every repetition, so whatever a variant leaves behind (a
    disk or a host cache still busy with its writes) always fell on the same
    next variant.
    """
    n = len(items)
    if n <= 2:
        k = rep % n if n else 0
        return [*items[k:], *items[:k]]
    # First row 0, 1, n-1, 2, n-2, ...; row r adds r; odd n: rows n..2n-1 are rows 0..n-1 reversed.
    offsets = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    row = rep % (2 * n if n % 2 else n)
    order = [items[(offset + row) % n] for offset in offsets]
    return order[::-1] if row >= n else order


def settle() -> None:
    """Collect garbage and let dirty pages of earlier variants reach the disk."""
    gc.collect()
    os.sync()


# --- saves that prune nothing inside a timing ---------------------------------------------


@contextlib.contextmanager
def held(mgr: CheckpointManager | None) -> Iterator[None]:
    """Time a save inside this: it prunes nothing, and the previous checkpoint goes after it.

    The managers keep one checkpoint (``keep_last=1``); the newest is pinned before
    the timing, so the timed save's commit removes nothing, then unpinned after it,
    which prunes it, and the deleter empties the trash, all outside the timing.
    Pruning itself is what the cleanup table measures.
    """
    step = mgr.latest_step if mgr is not None else None
    if mgr is None or step is None:
        yield
        return
    mgr.pin(step)
    try:
        yield
    finally:
        mgr.unpin(step)  # prunes it now
        quiesce(mgr)


def quiesce(mgr: CheckpointManager, timeout: float = 30.0) -> None:
    """Wait until the manager's background deleter has emptied the trash (so it slows no other row)."""
    trash = mgr.root / ".trash"
    deadline = time.monotonic() + timeout
    while trash.is_dir() and any(trash.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)


# --- a transformer-shaped state -------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """Sizes of the benchmark transformer."""

    vocab: int
    hidden: int
    layers: int

    @classmethod
    def for_bytes(cls, model_bytes: int) -> Shape:
        """A shape whose fp32 parameters take about ``model_bytes``.

        Hidden size: the largest power-of-two multiple of 256 that still leaves
        room for four layers; the embedding takes about an eighth of the model.
        """
        hidden = 256
        while 4 * _layer_params(hidden * 2) * 4 <= model_bytes * 7 // 8:
            hidden *= 2
        vocab = max(1024, model_bytes // 8 // (4 * hidden))
        rest = model_bytes - vocab * hidden * 4
        layers = max(1, round(rest / (_layer_params(hidden) * 4)))
        return cls(vocab=vocab, hidden=hidden, layers=layers)


def _layer_params(d: int) -> int:
    # qkv (3d x d) + out (d x d) + fc1 (4d x d) + fc2 (d x 4d), their biases, two layer norms.
    return 12 * d * d + 3 * d + d + 4 * d + d + 4 * d


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)


class Transformer(nn.Module):
    """Only the parameter shapes of a GPT-style model matter here (no forward)."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.hidden)
        self.blocks = nn.ModuleList(Block(shape.hidden) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.hidden)


@dataclass
class BenchState:
    """A model (and optimizer), and the same tensors as one flat dict for the peers."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    shape: Shape

    @property
    def state(self) -> dict[str, Any]:
        """What ``CheckpointManager.save`` gets."""
        out: dict[str, Any] = {"model": self.model}
        if self.optimizer is not None:
            out["optim"] = self.optimizer
        return out

    def flat(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state under a unique name (torch.save / safetensors / raw I/O)."""
        out = {f"model.{k}": v.detach() for k, v in self.model.state_dict().items()}
        if self.optimizer is not None:
            names = {id(p): n for n, p in self.model.named_parameters()}
            for param, moments in self.optimizer.state.items():
                for key, value in moments.items():
                    if isinstance(value, torch.Tensor):
                        out[f"optim.{names[id(param)]}.{key}"] = value
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat().values())


def build_state(size_bytes: int, *, optimizer: bool, seed: int = 0) -> BenchState:
    """A transformer-shaped fp32 state of about ``size_bytes`` (AdamW moments included when asked)."""
    torch.manual_seed(seed)
    model_bytes = size_bytes // 3 if optimizer else size_bytes
    shape = Shape.for_bytes(model_bytes)
    model = Transformer(shape)
    optim: torch.optim.Optimizer | None = None
    if optimizer:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optim.step()  # allocates exp_avg / exp_avg_sq with non-trivial values
        optim.zero_grad(set_to_none=True)
    return BenchState(model, optim, shape)


# --- raw limits ---------------------------------------------------------------------


def host_buffers(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Preallocated host buffers shaped like ``tensors`` (touched once, so no page faults later)."""
    return [torch.zeros_like(t, device="cpu") for t in tensors]


def memcpy(sources: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
    for src, buf in zip(sources, buffers, strict=True):
        buf.copy_(src)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")


def raw_write(tensors: Sequence[torch.Tensor], path: Path) -> None:
    """Write the tensors' bytes back to back into one file, then fsync it.

    ``O_TRUNC``: give it a fresh path inside a timing (truncating a large file costs a lot on ext4).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in tensors:
            view = _byte_view(tensor)
            while view:
                view = view[os.write(fd, view[:_CHUNK]) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: Path, buffers: Sequence[torch.Tensor]) -> None:
    """Read one file written by :func:`raw_write` into preallocated buffers."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # the best hint a reader can give
        for buf in buffers:
            view = _byte_view(buf)
            while view:
                n = os.readv(fd, [view[:_CHUNK]])
                if n == 0:
                    raise EOFError(f"{path} is shorter than the buffers")
                view = view[n:]
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    """fsync a file, or every file under a directory and the directory itself."""
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] + [path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(path: Path) -> None:
    """Drop the page cache of a file, or of every file under a directory.

    fsyncs first: ``POSIX_FADV_DONTNEED`` only drops clean pages. A file that vanishes
    meanwhile (a live manager's owner heartbeat replaces ``.owner``) is skipped.
    """
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in files:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def evict_all(path: Path) -> None:
    """:func:`evict`, and what safeckpt keeps parsed in this process (the last ``.metadata`` and
    checksums, safeckpt._dcp.safe_metadata): a cold restore then starts as a restarted job's does."""
    evict(path)
    try:
        from safeckpt._dcp.safe_metadata import forget_parsed
    except ImportError:  # a checkout from before the split (trace_restore.py with PYTHONPATH)
        from safeckpt._dcp.io import forget_parsed  # type: ignore[attr-defined,no-redef]
    forget_parsed()


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --- machine --------------------------------------------------------------------------


def machine() -> dict[str, str]:
    """What the numbers depend on: CPUs, memory, the filesystem, versions."""
    info = {
        "cpu": _cpu_model(),
        "cores": str(os.cpu_count()),
        "memory": f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} GiB",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch threads": str(torch.get_num_threads()),
        "kernel": platform.release(),
    }
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def filesystem_of(path: Path) -> str:
    """``device type`` of the mount holding ``path`` (from /proc/mounts)."""
    best, found = "", "unknown"
    target = str(path.resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype, *_ = line.split()
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, found = mnt, f"{fstype} on {dev} (mounted at {mnt})"
    except OSError:
        pass
    return found
