"""Model weights out of a checkpoint (safetensors, Hugging Face-style folder) and back in.

:func:`export_weights` writes the tensors saved under one key of the state
(``"model"`` by default) with the key prefix stripped, so the names are those
of ``model.state_dict()``. It works from DCP's ``.metadata`` alone (shapes and
dtypes) and loads the tensors a group at a time through :func:`dcp_io.load`,
which reads only the chunks the group needs and assembles sharded (multi-rank)
tensors, so memory stays near one group (``read_budget`` bytes, or one tensor
when that is larger) whatever the model's size. The safetensors files are
written as a stream: header first (its offsets follow from the shapes), then
each tensor as it is loaded.

Guarantees: the output appears whole or not at all (written under a temp name,
fsynced, renamed into place; a folder is swapped in with ``RENAME_EXCHANGE``
where the filesystem has it); an existing output is replaced only with
``force=True``. Every byte read is verified as :func:`dcp_io.load` verifies it.

:func:`~safeckpt._ops.export.import_weights` (in :mod:`safeckpt._ops.weights_import`) is the reverse.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._dcp import io as dcp_io
from .._dcp import safe_metadata
from .._format.layout import Layout
from .._format.record import Record
from .._restore.choose import check_own_files, choose_checkpoint, read_chosen
from .._store.base import DIR
from .._store.loc import Loc, as_loc, as_root
from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError

logger = logging.getLogger(__name__)

SAFETENSORS = "safetensors"
HF = "hf"
FORMATS = (SAFETENSORS, HF)
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_SHARD_SIZE = 5 * 10**9
DEFAULT_READ_BUDGET = 256 << 20
INDEX_NAME = "model.safetensors.index.json"
HF_CONFIG = "hf_config"
"""A record's ``extra`` key holding a Hugging Face model config (``safeckpt.hf.attach`` saves it);
the ``"hf"`` format writes it as ``config.json``, so ``from_pretrained`` loads the folder."""

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


class ExportExistsError(CheckpointError, FileExistsError):
    """The output of an export (or the step of an import) exists already; nothing was written."""


@dataclass(frozen=True)
class ExportTensor:
    """One tensor to export: its name in the output, its FQN in the checkpoint, dtypes, shape."""

    name: str
    fqn: str
    saved_dtype: torch.dtype
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes in the output (in ``dtype``)."""
        return self.numel * self.dtype.itemsize

    @property
    def saved_nbytes(self) -> int:
        return self.numel * self.saved_dtype.itemsize


@dataclass(frozen=True)
class ExportPlan:
    """What :func:`write_export` will write: from which checkpoint, which tensors, in which files."""

    directory: Loc
    step: int | None
    key: str
    format: str
    shards: tuple[tuple[ExportTensor, ...], ...]
    record: Record | None = None

    @property
    def tensors(self) -> list[ExportTensor]:
        return [t for shard in self.shards for t in shard]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def shard_names(self) -> list[str]:
        n = len(self.shards)
        return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


@dataclass
class ExportResult:
    """What :func:`export_weights` wrote."""

    path: Path | str
    step: int | None
    source: Path | str
    format: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "step": self.step,
            "source": str(self.source),
            "format": self.format,
            "files": self.files,
            "tensors": self.tensors,
            "bytes": self.bytes,
        }


@safe_metadata.parsed_kept()  # the checkpoint is chosen, verified and read: one unpickle of .metadata
def plan_export(
    root: Loc | str | os.PathLike[str],
    *,
    step: int | None = None,
    key: str = "model",
    format: str = SAFETENSORS,
    dtype: str | torch.dtype | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
) -> ExportPlan:
    """Choose the checkpoint (``step``, or what auto-resume would take) and lay out the output.

    Reads only records and ``.metadata``. ``dtype`` converts floating-point tensors
    (``"bf16"``, ``"fp16"``, ``"fp32"`` or a torch dtype); others keep theirs. ``shard_size``
    (bytes) bounds each file of the ``"hf"`` format; a larger tensor gets a file of its own.
    """
    _check_options(format, shard_size)
    target = _dtype(dtype)
    layout = _run_root(root)
    chosen = choose_checkpoint(layout, step, None)
    if chosen is None:
        raise _nothing_to_export(layout)
    return _plan(*chosen, key=key, format=format, dtype=target, shard_size=shard_size)


def _check_options(format: str, shard_size: int) -> None:
    if format not in FORMATS:
        raise ConfigError(f"format={format!r}: choose one of {', '.join(FORMATS)}.")
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ConfigError(f"shard_size={shard_size!r}: must be a positive number of bytes.")


def _run_root(root: Loc | str | os.PathLike[str]) -> Layout:
    layout = Layout(as_root(root))
    top = layout.root.entry()
    if top is None or top.kind != DIR:
        raise CheckpointNotFoundError(f"{root} does not exist or is not a directory.", path=str(layout.root))
    return layout


def _nothing_to_export(layout: Layout) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"{layout.root} has no complete checkpoint to export; `safeckpt ls {layout.root}` shows "
        "what is there.",
        path=str(layout.root),
    )


def _plan(
    directory: Loc, record: Record, *, key: str, format: str, dtype: torch.dtype | None, shard_size: int
) -> ExportPlan:
    """The output of ``directory``'s tensors under ``key``, from its ``.metadata`` alone."""
    metadata = safe_metadata.read_metadata(directory)
    prefix = f"{key}."
    tensors = []
    for fqn, meta in metadata.state_dict_metadata.items():
        if not fqn.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
            continue
        saved = meta.properties.dtype
        if saved not in _ST_DTYPES:
            raise CheckpointError(
                f"{fqn} is a {saved} tensor, which safetensors cannot store; export without it is "
                "not supported.",
                path=str(directory),
            )
        out = dtype if dtype is not None and saved.is_floating_point else saved
        tensors.append(ExportTensor(fqn[len(prefix) :], fqn, saved, out, tuple(meta.size)))
    if not tensors:
        keys = sorted({fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata})
        raise ConfigError(
            f"step {record.step} in {directory} has no tensors under the key {key!r}; its keys are "
            f"{', '.join(keys) or 'none'}. Pass one of them (--key)."
        )
    shards = [tensors] if format == SAFETENSORS else _pack(tensors, shard_size)
    return ExportPlan(directory, record.step, key, format, tuple(tuple(s) for s in shards), record)


def export_chosen(
    root: Loc | str | os.PathLike[str],
    write: Callable[[ExportPlan], ExportResult],
    *,
    step: int | None = None,
    key: str = "model",
    format: str = SAFETENSORS,
    dtype: str | torch.dtype | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
) -> ExportResult:
    """Plan the export of the checkpoint auto-resume would take (or ``step``) and ``write`` it.

    Chosen as auto-resume chooses: damage found while writing falls back to the
    commit before (with ``step``, it raises), and a checkpoint replaced or
    pruned meanwhile is chosen anew. ``write`` replaces an earlier attempt's
    output, which never appears (outputs appear whole or not at all).
    """
    _check_options(format, shard_size)
    target = _dtype(dtype)
    layout = _run_root(root)

    def attempt(directory: Loc, record: Record) -> ExportResult:
        check_own_files(directory, record, 0)  # what a restore checks first: the same choice
        plan = _plan(directory, record, key=key, format=format, dtype=target, shard_size=shard_size)
        return write(plan)

    return read_chosen(layout, step, None, attempt, nothing=lambda: _nothing_to_export(layout))


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def _pack(tensors: list[ExportTensor], shard_size: int) -> list[list[ExportTensor]]:
    shards: list[list[ExportTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def export_weights(
    root: Loc | str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    key: str = "model",
    format: str = SAFETENSORS,
    dtype: str | torch.dtype | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    read_budget: int = DEFAULT_READ_BUDGET,
) -> ExportResult:
    """Write the weights of ``root``'s checkpoint to ``out``: :func:`export_chosen` with
    :func:`write_export`. ``progress(n)`` is called with byte counts as tensors are written."""
    return export_chosen(
        root,
        lambda plan: write_export(plan, out, force=force, progress=progress, read_budget=read_budget),
        step=step,
        key=key,
        format=format,
        dtype=dtype,
        shard_size=shard_size,
    )


@safe_metadata.parsed_kept()  # each group's load reads the same .metadata
def write_export(
    plan: ExportPlan,
    out: str | os.PathLike[str],
    *,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    read_budget: int = DEFAULT_READ_BUDGET,
) -> ExportResult:
    """Write ``plan`` to ``out`` (a file for ``"safetensors"``, a folder for ``"hf"``), atomically.

    ``out`` is written through the store of its parent (made if missing), under a temp
    name, and renamed into place (a folder is swapped in whole).
    """
    target = as_loc(out)
    store = target.store
    found = target.entry()
    if found is not None and not force:
        raise ExportExistsError(
            f"{out} exists already; pass --force (force=True) to replace it, or choose another path.",
            path=str(target),
        )
    if plan.format == SAFETENSORS and found is not None and found.kind == DIR:
        raise ExportExistsError(
            f"{out} is a directory; the safetensors format writes one file. Use --format hf for a "
            "folder, or name a file.",
            path=str(target),
        )
    store.make_dir(target.parent.key)
    tmp = target.parent / f".{target.name}.tmp.{uuid.uuid4().hex[:12]}"
    advance = progress or (lambda n: None)
    metadata = {"format": "pt", "safeckpt.step": str(plan.step), "safeckpt.key": plan.key}
    result = ExportResult(
        target.where, plan.step, plan.directory.where, plan.format, tensors=len(plan.tensors)
    )
    result.bytes = plan.total_bytes
    try:
        if plan.format == SAFETENSORS:
            _write_safetensors(tmp, plan, plan.shards[0], metadata, advance, read_budget)
            store.move(tmp.key, target.key)
            result.files = [target.name]
        else:
            store.make_dir(tmp.key)
            names = plan.shard_names()
            weight_map = {}
            for name, shard in zip(names, plan.shards, strict=True):
                _write_safetensors(tmp / name, plan, shard, metadata, advance, read_budget)
                weight_map.update({t.name: name for t in shard})
            index = {"metadata": {"total_size": plan.total_bytes, **metadata}, "weight_map": weight_map}
            store.write_new((tmp / INDEX_NAME).key, (json.dumps(index, indent=2) + "\n").encode())
            config = plan.record.extra.get(HF_CONFIG) if plan.record is not None else None
            if isinstance(config, Mapping):
                store.write_new((tmp / "config.json").key, (json.dumps(config, indent=2) + "\n").encode())
            store.sync(tmp.key)
            # no moment without a whole output: the old folder ends at the temp name, removed below
            store.commit_dir(tmp.key, target.key, displaced=f"{tmp.key}.old", retired=tmp.key)
            result.files = [*names, INDEX_NAME, *(["config.json"] if isinstance(config, Mapping) else [])]
        store.sync(target.parent.key)
    finally:
        for leftover in (tmp, target.parent / f"{tmp.name}.old"):
            if leftover.entry() is not None:
                store.remove(leftover.key)
    logger.info("exported %d tensors of %s to %s", result.tensors, plan.directory, target)
    return result


def _write_safetensors(
    path: Loc,
    plan: ExportPlan,
    tensors: tuple[ExportTensor, ...],
    metadata: Mapping[str, str],
    advance: Callable[[int], None],
    read_budget: int,
) -> None:
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned

    def write(f: Any) -> None:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for group in _groups(tensors, read_budget):
            loaded = _load(plan, group)
            for t in group:
                tensor = loaded.pop(t.fqn).to(t.dtype).contiguous().reshape(-1)
                # numpy declares ndarray.__buffer__ only for Python >= 3.12 (it has the buffer protocol)
                f.write(memoryview(tensor.view(torch.uint8).numpy()))  # type: ignore[arg-type]
                del tensor
                advance(t.nbytes)

    path.store.write_stream(path.key, write)


def _groups(tensors: tuple[ExportTensor, ...], budget: int) -> Iterator[list[ExportTensor]]:
    group: list[ExportTensor] = []
    size = 0
    for t in tensors:
        if group and size + t.saved_nbytes > budget:
            yield group
            group, size = [], 0
        group.append(t)
        size += t.saved_nbytes
    if group:
        yield group


def _load(plan: ExportPlan, group: list[ExportTensor]) -> dict[str, torch.Tensor]:
    # DCP reads only what the state_dict asks for, assembling each tensor from the chunks
    # of every rank that saved a piece of it.
    state_dict: dict[str, Any] = {t.fqn: torch.empty(t.shape, dtype=t.saved_dtype) for t in group}
    dcp_io.load(state_dict, plan.directory, None, record=plan.record)
    return state_dict
