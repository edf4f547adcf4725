"""What is in a checkpoint, as plain data (``safeckpt inspect`` prints it).

Read-only and cheap: reads the record, lists the files, and reads DCP's
``.metadata`` (through the restricted unpickler) and the headers of the
train-state files. No tensor data is loaded and no lock is taken.
"""

from __future__ import annotations

import fnmatch
import json
import os
import struct
from pathlib import Path
from typing import Any

from .._dcp import safe_metadata
from .._format.catalog import Catalog, scan, verify_files
from .._format.layout import Layout, parse_step_dirname
from .._format.record import list_files, read_record
from .._policy.retention import Retention, explain
from .._store.base import DIR
from .._store.loc import Loc, as_loc, as_root
from ..errors import CheckpointError, CheckpointNotFoundError
from .maintenance import infos, protected_steps, recorded_retention

SCHEMA_VERSION = 1

# chosen_by values of inspect_checkpoint()
LATEST = "latest"
NEWEST_COMPLETE = "newest complete"
GIVEN = "given"


def kept_because(catalog: Catalog, retention: Retention | None) -> dict[int, list[str]]:
    """Why each checkpoint with a record is kept: ``latest`` (or the newest one when
    ``latest`` is missing or broken), ``pinned``, and the rules of ``retention`` that keep
    it. An empty list: the next prune with ``retention`` removes it."""
    protected = {
        step: "latest" if step == catalog.pointer_step else "newest (`latest` is missing or broken)"
        for step in protected_steps(catalog)
    }
    reasons = explain(infos(catalog), retention, protected) if retention is not None else {}
    out: dict[int, list[str]] = {}
    for entry in catalog.entries:
        if entry.record is None:
            continue
        kept = reasons.get(entry.step)
        if kept is None:
            kept = [protected[entry.step]] if entry.step in protected else []
            kept += ["pinned"] if entry.record.pinned else []
        out[entry.step] = kept
    return out


def resolve_checkpoint(root: Loc, target: int | str | os.PathLike[str] | None) -> tuple[Loc, str]:
    """The directory ``target`` names in ``root``, and how it was chosen.

    None: what auto-resume would take (``restore()``'s own choice: ``latest``, or the
    newest complete checkpoint). An int: that step. A path: that directory (relative
    paths are tried against ``root`` first, so ``step_10`` works). Raises
    :class:`CheckpointNotFoundError` when there is no such directory.
    """
    if target is None:
        from .._restore.choose import choose_checkpoint  # imports torch: `safeckpt ls` never gets here

        chosen = choose_checkpoint(Layout(root), None, None)
        if chosen is None:
            raise CheckpointNotFoundError(
                f"{root} has no complete checkpoint: auto-resume would start fresh. "
                f"`safeckpt ls {root}` shows what is there.",
                path=str(root),
            )
        directory = chosen[0]
        latest = scan(root).pointer_step
        return directory, LATEST if parse_step_dirname(directory.name) == latest else NEWEST_COMPLETE
    if isinstance(target, int):
        directory = Layout(root).step_dir(target)
        if not _is_dir(directory):
            raise CheckpointNotFoundError(
                f"there is no checkpoint of step {target} in {root}; `safeckpt ls {root}` lists "
                "the steps there.",
                path=str(directory),
                step=target,
            )
        return directory, GIVEN
    text = os.fspath(target)
    relative = Path(text).as_posix()
    inside = not Path(text).is_absolute() and "://" not in text and ".." not in Path(text).parts
    directory = root / relative if inside and _is_dir(root / relative) else as_loc(text)
    if not _is_dir(directory):
        raise CheckpointNotFoundError(
            f"there is no checkpoint directory {target}; pass a step number or a step_<N> "
            f"directory (`safeckpt ls {root}` lists them).",
            path=str(directory),
        )
    return directory, GIVEN


def _is_dir(loc: Loc) -> bool:
    entry = loc.entry()
    return entry is not None and entry.kind == DIR


def tensor_table(checkpoint_dir: Loc | str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every entry of DCP's ``.metadata``: FQN, kind, dtype, shape, bytes and chunks.

    A chunk is one rank's piece of a tensor (``offsets``/``sizes`` per dimension, and
    the file that holds it); an unsharded tensor has one chunk covering it.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # not for `safeckpt ls`

    checkpoint_dir = as_loc(checkpoint_dir)
    metadata = safe_metadata.read_metadata(checkpoint_dir)
    files: dict[tuple[str, tuple[int, ...] | None], str] = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        offset = tuple(index.offset) if index.offset is not None else None
        files[(index.fqn, offset)] = str(getattr(info, "relative_path", ""))
    table: list[dict[str, Any]] = []
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            table.append({"fqn": fqn, "kind": "bytes", "file": files.get((fqn, None))})
            continue
        dtype = meta.properties.dtype
        shape = list(meta.size)
        chunks = [
            {
                "offsets": list(c.offsets),
                "sizes": list(c.sizes),
                "file": files.get((fqn, tuple(c.offsets))),
            }
            for c in meta.chunks
        ]
        numel = 1
        for n in shape:
            numel *= n
        table.append(
            {
                "fqn": fqn,
                "kind": "tensor",
                "dtype": str(dtype).removeprefix("torch."),
                "shape": shape,
                "bytes": numel * dtype.itemsize,
                "sharded": len(chunks) != 1 or chunks[0]["sizes"] != shape,
                "chunks": chunks,
            }
        )
    return table


def train_state_summary(checkpoint_dir: Loc | str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON part of each rank's train-state file, read from its header only.

    ``entries`` is the state's structure with its plain values: a tensor (stored by DCP)
    appears as ``{"__tensor__": fqn}``, a module as ``{"module": ...}``, an optimizer as
    ``{"optimizer": ...}``, a ``Stateful`` as ``{"stateful": ...}``, a ``per_rank`` value as
    ``{"per_rank": ...}`` (its tensors as dtype and shape), tuples as lists, int keys as strings,
    dtypes as their names. The
    RNG state is summarised by the generators it holds.
    """
    checkpoint_dir = as_loc(checkpoint_dir)
    out = {}
    names = [e.name for e in checkpoint_dir.store.entries(checkpoint_dir.key)]
    for path in [checkpoint_dir / n for n in sorted(fnmatch.filter(names, "train_state.rank*.safetensors"))]:
        header = _safetensors_header(path)
        try:
            document = json.loads(header["__metadata__"]["safeckpt.train_state"])
            if not isinstance(document, dict):
                raise TypeError("not a JSON object")
            if "tree" in document:
                values = document.get("values") or []
                entries = _render_tree(document["tree"], values, header)
            else:  # format 1: the entries themselves
                entries = _describe_tensors(document.get("entries", {}), header)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CheckpointError(
                f"{path} has no readable safeckpt train state ({type(e).__name__}: {e}); the "
                "checkpoint is damaged. Run `safeckpt verify` on it.",
                path=str(path),
            ) from e
        rng = document.get("rng")
        out[path.name] = {
            "format": document.get("format"),
            "entries": entries,
            "rng": sorted(rng) if isinstance(rng, dict) else None,
        }
    return out


_WRAPPERS = {"M": "module", "O": "optimizer", "S": "stateful"}


def _render_tree(node: Any, values: list[Any], header: dict[str, Any]) -> Any:
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"unexpected node {str(node)[:80]}")
    ((tag, body),) = node.items()
    if tag == "T":
        return {"__tensor__": body}
    if tag == "V":
        return _describe_tensors(values[body], header)
    if tag == "R":
        return {"per_rank": _describe_tensors(values[body], header)}
    if tag == "D":
        return {str(k): _render_tree(v, values, header) for k, v in body}
    if tag in ("L", "U"):
        return [_render_tree(v, values, header) for v in body]
    if tag in _WRAPPERS:
        return {_WRAPPERS[tag]: _render_tree(body, values, header)}
    raise ValueError(f"unknown node tag {tag!r}")


def _safetensors_header(path: Loc) -> dict[str, Any]:
    try:
        with path.store.open_read(path.key) as f:
            (length,) = struct.unpack("<Q", f.read(0, 8))
            if length > 100 << 20:
                raise ValueError(f"header of {length} bytes")
            header = json.loads(f.read(8, length))
    except (OSError, struct.error, ValueError) as e:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({e}); the checkpoint is damaged. Run "
            "`safeckpt verify` on it.",
            path=str(path),
        ) from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a malformed safetensors header.", path=str(path))
    return header


def _describe_tensors(value: Any, header: dict[str, Any]) -> Any:
    """A plain value as JSON shows it: tuples as lists, dicts with int (or ``__``) keys as dicts with
    string keys, dtypes and devices as their names, a tensor (``per_rank``) as its dtype and shape."""
    if isinstance(value, list):
        return [_describe_tensors(v, header) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, body),) = value.items()
        if tag == "__tensor__" and isinstance(body, str):
            info = header.get(body, {})
            return {"__tensor__": {"dtype": info.get("dtype"), "shape": info.get("shape")}}
        if tag == "__tuple__" and isinstance(body, list):
            return [_describe_tensors(v, header) for v in body]
        if tag == "__dict__" and isinstance(body, list):
            return {str(k): _describe_tensors(v, header) for k, v in body}
        if tag == "__dtype__" and isinstance(body, str):
            return f"torch.{body}"
        if tag == "__device__" and isinstance(body, str):
            return body
    return {k: _describe_tensors(v, header) for k, v in value.items()}


def inspect_checkpoint(
    root: Loc | str | os.PathLike[str], target: int | str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """Everything about one checkpoint of ``root`` as JSON data (schema in docs/cli.md).

    ``target``: see :func:`resolve_checkpoint`. A damaged checkpoint is still described:
    ``status`` is ``"incomplete"`` and ``problems`` says why; parts that cannot be read
    are None with the reason in ``problems``.
    """
    top = as_root(root)
    root_path = top.where
    if not _is_dir(top):
        raise CheckpointNotFoundError(f"{root} does not exist or is not a directory.", path=str(root_path))
    directory, chosen_by = resolve_checkpoint(top, target)
    catalog = scan(top)
    step = parse_step_dirname(directory.name)
    entry = next((e for e in catalog.entries if e.path == directory), None)
    problems: list[str] = []
    if entry is not None:
        problems += verify_files(entry)
        record = entry.record
    else:
        record = read_record(directory)
        if record is None:
            problems.append("no record (a save that never finished, or not a safeckpt checkpoint)")
    if record is not None and step is None:
        step = record.step
    reasons = kept_because(catalog, recorded_retention(catalog)) if entry is not None else {}
    recorded = dict(record.files) if record is not None else {}
    try:
        on_disk = list_files(directory)
    except OSError as e:
        on_disk = {}
        problems.append(f"cannot list the files: {e}")
    files = [
        {"name": name, "size": on_disk.get(name), "recorded_size": recorded.get(name)}
        for name in sorted(set(on_disk) | set(recorded))
    ]
    tensors: list[dict[str, Any]] | None
    try:
        tensors = tensor_table(directory)
    except CheckpointError as e:
        tensors = None
        problems.append(str(e))
    try:
        train_state: dict[str, Any] | None = train_state_summary(directory)
    except CheckpointError as e:
        train_state = None
        problems.append(str(e))
    return {
        "schema_version": SCHEMA_VERSION,
        "root": str(root_path),
        "path": str(directory),
        "step": step,
        "chosen_by": chosen_by,
        "latest": step is not None and step == catalog.pointer_step,
        "status": "committed" if not problems and record is not None else "incomplete",
        "problems": problems,
        "kept_because": reasons.get(step, []) if step is not None and not problems else [],
        "record": record.to_json() if record is not None else None,
        "files": files,
        "size": sum(on_disk.values()),
        "tensors": tensors,
        "train_state": train_state,
    }
