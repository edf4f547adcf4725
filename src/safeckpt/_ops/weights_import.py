"""Model weights into a checkpoint: a safetensors file or a Hugging Face-style folder saved as
step ``step`` of a root through :class:`CheckpointManager`, so a run can start from it
(``mgr.restore({"model": model})``). The reverse of :mod:`safeckpt._ops.export`.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._format.layout import Layout
from .._store.base import DIR, FILE
from .._store.loc import as_loc, as_root
from .._util.torch_private import child_module
from ..errors import CheckpointError, CheckpointNotFoundError
from .export import INDEX_NAME, ExportExistsError


def read_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or of a folder (its index file, else every ``*.safetensors``)."""
    from safetensors.torch import load_file

    source = as_loc(path)
    found = source.entry()
    if found is not None and found.kind == FILE:
        files = [source]
    elif found is not None and found.kind == DIR:
        index = source / INDEX_NAME
        names = {e.name: e.kind for e in source.store.entries(source.key)}
        if names.get(INDEX_NAME) == FILE:
            text = index.store.read_small(index.key, limit=64 << 20, what="weights index")
            weight_map = json.loads(text).get("weight_map", {})
            files = [source / name for name in sorted(set(weight_map.values()))]
        else:
            files = [source / n for n in sorted(fnmatch.filter(names, "*.safetensors"))]
        if not files:
            raise CheckpointNotFoundError(
                f"{path} holds no .safetensors files; pass a safetensors file or a folder of them.",
                path=str(source),
            )
    else:
        raise CheckpointNotFoundError(f"{path} does not exist.", path=str(source))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            loaded = load_file(str(file.where))  # a local file: safetensors reads it itself
        except Exception as e:  # safetensors raises its own SafetensorError
            raise CheckpointError(
                f"{file} is not a readable safetensors file ({type(e).__name__}: {e}).", path=str(file)
            ) from e
        duplicated = sorted(set(loaded) & set(tensors))
        if duplicated:
            raise CheckpointError(
                f"{file} repeats tensors of another file: {duplicated[:5]}.", path=str(file)
            )
        tensors.update(loaded)
    return tensors


def weights_module(tensors: Mapping[str, torch.Tensor]) -> nn.Module:
    """A module whose ``state_dict()`` is ``tensors`` (dotted names become submodules)."""
    module = nn.Module()
    for name, tensor in tensors.items():
        *parents, leaf = name.split(".")
        owner = module
        try:
            for part in parents:
                child = child_module(owner, part)
                if child is None:
                    child = nn.Module()
                    owner.add_module(part, child)
                owner = child
            owner.register_buffer(leaf, tensor)
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"the tensor name {name!r} cannot be a state_dict key ({e}); rename it before importing."
            ) from e
    return module


def import_weights(
    weights: str | os.PathLike[str],
    root: str | os.PathLike[str],
    *,
    step: int = 0,
    key: str = "model",
    overwrite: bool = False,
    **manager_options: Any,
) -> Path:
    """Save the weights at ``weights`` (file or folder) as checkpoint ``step`` of ``root``.

    The state saved is ``{key: module}`` with the tensor names as FQNs, through
    :class:`CheckpointManager`, so ``mgr.restore({"model": model})`` loads it into a
    model with those ``state_dict()`` keys. Takes ownership of ``root`` while it
    saves: it waits for (and then fails on) a root a live job writes to.
    """
    from .._manager.manager import CheckpointManager
    from .._root.ownership import in_use_error, live_writer

    tensors = read_weights(weights)
    source = str(as_loc(weights))
    top = as_root(root)
    directory = Layout(top).step_dir(step)
    if directory.entry() is not None and not overwrite:
        raise ExportExistsError(
            f"{root} has a checkpoint of step {step} already; pass --overwrite (overwrite=True) to "
            "replace it, or import as another --step.",
            path=str(directory),
            step=step,
        )
    writer = live_writer(top)
    if writer is not None:  # refused at once, as the save would refuse it, before opening anything
        raise in_use_error(top, writer)
    with CheckpointManager(root, async_save=False, **manager_options) as mgr:
        mgr.save(step, {key: weights_module(tensors)}, extra={"imported_from": source}, overwrite=overwrite)
    return directory.where  # type: ignore[return-value]
