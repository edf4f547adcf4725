"""Shared pieces of the benchmarks: states, raw I/O limits, cache eviction, tables.

Every benchmark measures a ratio against a limit measured in the same run and
the same repetition (raw memcpy, raw write + fsync, raw cold read), so a noisy,
shared machine moves numerator and denominator together. Repetitions are
interleaved (the order of the variants rotates from one repetition to the next),
and a table reports the median and the max of the per-repetition ratios.

A benchmark script prints its tables as Markdown on stdout, which ``run_all.py``
puts into the generated blocks of ``docs/performance.md``; ``--json PATH`` also
writes them as data (:meth:`Report.load` reads it back).
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

GIB = 1 << 30
MIB = 1 << 20
_CHUNK = 64 * MIB  # one os.write/os.readv call; large enough to keep the syscall count negligible


# --- timing -----------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes (monotonic clock)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rotated(items: Sequence[Any], rep: int) -> list[Any]:
    """``items`` rotated by ``rep``: interleaves variants so none always runs first."""
    k = rep % len(items) if items else 0
    return [*items[k:], *items[:k]]


def settle() -> None:
    """Collect garbage and let dirty pages of earlier variants reach the disk."""
    gc.collect()
    os.sync()


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
    """Write the tensors' bytes back to back into one file, then fsync it."""
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

    fsyncs first: ``POSIX_FADV_DONTNEED`` only drops clean pages.
    """
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --- results ---------------------------------------------------------------------------


@dataclass
class Row:
    """One variant of a measurement: a value per repetition (a ratio, or milliseconds)."""

    name: str
    values: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    target: float | None = None
    """Upper bound on the median value (None: a peer, shown for comparison)."""
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan

    @property
    def max(self) -> float:
        return max(self.values) if self.values else math.nan

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds) if self.seconds else math.nan

    @property
    def verdict(self) -> str:
        if self.target is None or not self.values:
            return ""
        if self.median <= self.target:
            return "met"
        return f"**missed** by {self.median / self.target - 1:.1%}"


@dataclass
class Table:
    """One measurement: what is divided by what (or measured in ms), and a row per variant."""

    key: str
    title: str
    measure: str
    """What a value is, e.g. ``save() return time / memcpy``."""
    limit: str = ""
    limit_seconds: list[float] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    unit: str = "x"
    """``"x"``: values are ratios against the limit; ``"ms"``: values are milliseconds."""
    notes: list[str] = field(default_factory=list)

    def row(self, name: str, *, target: float | None = None, note: str = "") -> Row:
        """The row called ``name``, created (with ``target``) on first use."""
        for row in self.rows:
            if row.name == name:
                return row
        row = Row(name, target=target, note=note)
        self.rows.append(row)
        return row

    def add_ratio(self, name: str, seconds: float, limit: float) -> None:
        row = self.row(name)
        row.seconds.append(seconds)
        row.values.append(seconds / limit)

    def add_value(self, name: str, value: float, seconds: float = math.nan) -> None:
        row = self.row(name)
        row.values.append(value)
        row.seconds.append(seconds)

    def to_markdown(self) -> str:
        lines = [f"#### {self.title}", "", f"Value: {self.measure}."]
        if self.limit:
            limit_s = statistics.median(self.limit_seconds) if self.limit_seconds else math.nan
            lines[-1] += f" Limit: {self.limit}, median {_fmt_s(limit_s)}."
        lines += [
            "",
            "| variant | median | max | median time | target | verdict |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for r in self.rows:
            target = "" if r.target is None else f"<= {_fmt_v(r.target, self.unit)}"
            name = r.name + (f" ({r.note})" if r.note else "")
            lines.append(
                f"| {name} | {_fmt_v(r.median, self.unit)} | {_fmt_v(r.max, self.unit)} | "
                f"{_fmt_s(r.median_seconds)} | {target} | {r.verdict} |"
            )
        if self.notes:
            lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Table:
        data = dict(data)
        rows = [Row(**r) for r in data.pop("rows")]
        return cls(**data, rows=rows)


def _fmt_v(value: float, unit: str) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.2f}x" if unit == "x" else f"{value:.2f} {unit}"


def _fmt_s(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


@dataclass
class Report:
    """What one benchmark script produced: its tables, the command, the machine."""

    section: str
    command: str
    machine: dict[str, str]
    parameters: dict[str, Any]
    tables: list[Table]
    wall_seconds: float = 0.0

    def to_markdown(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.parameters.items())
        lines = [
            f"Produced by `{self.command}` in {self.wall_seconds:.0f} s; parameters: {params}.",
            "",
        ]
        for table in self.tables:
            lines += [table.to_markdown(), ""]
        return "\n".join(lines).rstrip() + "\n"

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Report:
        data = json.loads(path.read_text())
        tables = [Table.from_json(t) for t in data.pop("tables")]
        return cls(**data, tables=tables)


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
