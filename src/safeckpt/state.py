"""Training state in and out, without pickle.

A state is a mapping the user hands to ``save()`` and ``restore()``:

* ``nn.Module`` and ``Optimizer`` values go through DCP with the
  ``torch.distributed.checkpoint.state_dict`` helpers (FQN-keyed, so optimizer
  moments load into a fresh optimizer and sharded models reshard);
* ``torch.Tensor`` values go through DCP as they are (loaded in place);
* objects with ``state_dict()``/``load_state_dict()`` (LR schedulers, stateful
  data loaders) and plain JSON values go into the per-rank train-state file,
  together with the RNG states.

The train-state file is a safetensors file: its tensors are the tensors found
inside those values, its metadata a JSON document that describes the rest.
Loading it never unpickles anything.
"""

from __future__ import annotations

import base64
import functools
import json
import random
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .errors import IncompleteCheckpointError, UnsupportedStateError

TRAIN_STATE_FORMAT = 1
_METADATA_KEY = "safeckpt.train_state"
RNG_KEY = "rng"


def train_state_filename(rank: int) -> str:
    return f"train_state.rank{rank}.safetensors"


# --- classification ---------------------------------------------------------


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _module_for(optimizer: torch.optim.Optimizer, key: str, state: Mapping[str, Any]) -> nn.Module:
    """The module in ``state`` that owns ``optimizer``'s parameters (the helpers need it)."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for value in state.values():
        if isinstance(value, nn.Module) and wanted <= {id(p) for p in value.parameters()}:
            return value
    raise UnsupportedStateError(
        f"state[{key!r}] is an optimizer, but no nn.Module in the same state holds all of its "
        "parameters. Put the model in the state too (e.g. {'model': model, 'optim': optim}), so "
        "the optimizer is saved by parameter name and loads into a fresh optimizer."
    )


@dataclass
class Captured:
    """A state at ``save()`` time: the DCP part (live tensors) and the train-state file."""

    dcp: dict[str, Any]
    train_state: bytes


def capture(state: Mapping[str, Any], *, rng: bool) -> Captured:
    """Split ``state`` and encode its non-DCP part (and the RNG states) now.

    The DCP part still references live tensors; the train-state bytes are a
    snapshot. Raises :class:`UnsupportedStateError` for a value that cannot be
    saved without pickle; nothing has been written then.
    """
    if not isinstance(state, Mapping):
        raise UnsupportedStateError(
            f"state must be a dict of name -> model/optimizer/tensor/stateful/JSON value, got "
            f"{type(state).__name__}."
        )
    dcp_part: dict[str, Any] = {}
    train_part: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise UnsupportedStateError(f"state keys must be strings, got {key!r}.")
        if isinstance(value, nn.Module):
            dcp_part[key] = get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            dcp_part[key] = get_optimizer_state_dict(_module_for(value, key, state), value)
        elif isinstance(value, torch.Tensor):
            dcp_part[key] = value
        elif _is_stateful(value):
            train_part[key] = {"kind": "stateful", "state": value.state_dict()}
        else:
            train_part[key] = {"kind": "value", "value": value}
    return Captured(dcp_part, encode_train_state(train_part, capture_rng() if rng else None))


# --- the train-state file -----------------------------------------------------


class _Encoder:
    """Turns a tree of plain values and tensors into JSON plus a tensor table."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def encode(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            name = f"t{len(self.tensors)}"
            tensor = value.detach()
            if tensor.layout != torch.strided or not _safetensors_dtype(tensor.dtype):
                raise self._unsupported(value, path)
            self.tensors[name] = tensor.to("cpu", copy=True).contiguous()
            return {"__tensor__": name}
        if isinstance(value, list):
            return [self.encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, Mapping):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: self.encode(v, f"{path}[{k!r}]") for k, v in value.items()}
            return {
                "__dict__": [
                    [self.encode(k, f"{path} key"), self.encode(v, f"{path}[{k!r}]")]
                    for k, v in value.items()
                ]
            }
        if isinstance(value, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(value)).decode()}
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            if isinstance(value, numpy.ndarray) and value.dtype.kind in "biuf":
                return {
                    "__ndarray__": {
                        "dtype": value.dtype.str,
                        "shape": list(value.shape),
                        "data": value.ravel().tolist(),
                    }
                }
            if isinstance(value, numpy.generic) and value.dtype.kind in "biuf":
                return value.item()
        raise self._unsupported(value, path)

    @staticmethod
    def _unsupported(value: Any, path: str) -> UnsupportedStateError:
        return UnsupportedStateError(
            f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which safeckpt "
            "cannot save without pickle. Keep training state to tensors, numbers, strings, "
            "lists and dicts (convert the value in your state_dict()), or put the object's "
            "tensors at the top level of the state. Nothing was written."
        )


@functools.cache
def _safetensors_dtype(dtype: torch.dtype) -> bool:
    """Whether safetensors stores ``dtype`` (complex128 and quantized dtypes it does not)."""
    try:
        safetensors_save({"t": torch.empty(0, dtype=dtype)})
    except Exception:
        return False
    return True


def _decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, body),) = value.items()
        if tag == "__tensor__":
            return tensors[body]
        if tag == "__tuple__":
            return tuple(_decode(v, tensors) for v in body)
        if tag == "__dict__":
            return {_decode(k, tensors): _decode(v, tensors) for k, v in body}
        if tag == "__bytes__":
            return base64.b64decode(body, validate=True)
        if tag == "__ndarray__":
            import numpy

            return numpy.array(body["data"], dtype=numpy.dtype(body["dtype"])).reshape(body["shape"])
    return {k: _decode(v, tensors) for k, v in value.items()}


def encode_train_state(train_part: Mapping[str, Any], rng: Mapping[str, Any] | None) -> bytes:
    """The train-state file's bytes (a safetensors blob with a JSON document in its metadata)."""
    encoder = _Encoder()
    document = {
        "format": TRAIN_STATE_FORMAT,
        "entries": {key: _encode_entry(encoder, key, entry) for key, entry in train_part.items()},
        RNG_KEY: None if rng is None else encoder.encode(dict(rng), "rng state"),
    }
    metadata = {_METADATA_KEY: json.dumps(document, allow_nan=True)}
    return safetensors_save(encoder.tensors, metadata=metadata)


def _encode_entry(encoder: _Encoder, key: str, entry: Any) -> Any:
    # Errors name the place in the user's state (state['sched'].state_dict()['fn']), not in
    # the {"kind": ..., ...} wrapper, which the user never wrote.
    where = f"state[{key!r}]"
    if isinstance(entry, Mapping) and entry.keys() == {"kind", "state"} and entry["kind"] == "stateful":
        return {"kind": "stateful", "state": encoder.encode(entry["state"], f"{where}.state_dict()")}
    if isinstance(entry, Mapping) and entry.keys() == {"kind", "value"} and entry["kind"] == "value":
        return {"kind": "value", "value": encoder.encode(entry["value"], where)}
    return encoder.encode(entry, where)


def decode_train_state(blob: bytes, *, source: str) -> dict[str, Any]:
    """``{"entries": ..., "rng": ...}`` from a train-state file's bytes."""
    try:
        tensors = safetensors_load(blob)
        header_len = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + header_len])
        document = json.loads(header["__metadata__"][_METADATA_KEY])
        # Inside the try: a document naming a tensor the file lacks is damage too.
        return {
            "entries": _decode(document["entries"], tensors),
            RNG_KEY: _decode(document.get(RNG_KEY), tensors),
        }
    except Exception as e:
        raise IncompleteCheckpointError(
            f"{source} is not a readable train-state file ({type(e).__name__}: {e}); the "
            "checkpoint is damaged. Restore another one.",
            path=source,
        ) from e


# --- RNG -------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """Python, numpy (if imported), torch CPU and CUDA (if initialised) RNG states."""
    rng: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        rng["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: Mapping[str, Any]) -> None:
    if "python" in rng:
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "numpy" in rng:
        import numpy

        numpy.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        states = list(rng["cuda"])
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


# --- restore ------------------------------------------------------------------------


@dataclass
class LoadTargets:
    """Where a checkpoint's DCP part lands: the tensors to fill, then how to apply them."""

    dcp: dict[str, Any] = field(default_factory=dict)
    modules: dict[str, nn.Module] = field(default_factory=dict)
    optimizers: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = field(default_factory=dict)


def load_targets(state: Mapping[str, Any], keys: set[str] | None = None) -> LoadTargets:
    """State dicts to load the DCP part into (only ``keys`` when given)."""
    targets = LoadTargets()
    for key, value in state.items():
        if keys is not None and key not in keys:
            continue
        if isinstance(value, nn.Module):
            targets.dcp[key] = get_model_state_dict(value)
            targets.modules[key] = value
        elif isinstance(value, torch.optim.Optimizer):
            module = _module_for(value, key, state)
            targets.dcp[key] = get_optimizer_state_dict(module, value)
            targets.optimizers[key] = (module, value)
        elif isinstance(value, torch.Tensor):
            targets.dcp[key] = value
    return targets


def apply_targets(targets: LoadTargets) -> None:
    """Push loaded state dicts into their modules and optimizers."""
    for key, module in targets.modules.items():
        set_model_state_dict(module, targets.dcp[key])
    for key, (module, optimizer) in targets.optimizers.items():
        set_optimizer_state_dict(module, optimizer, targets.dcp[key])


def apply_train_state(state: MutableMapping[str, Any], entries: Mapping[str, Any]) -> None:
    """Load stateful objects and put plain values back into ``state``."""
    for key, entry in entries.items():
        if key not in state:
            continue
        if entry["kind"] == "stateful":
            state[key].load_state_dict(entry["state"])
        else:
            state[key] = entry["value"]


def dcp_keys(state: Mapping[str, Any]) -> Iterator[str]:
    for key, value in state.items():
        if isinstance(value, (nn.Module, torch.optim.Optimizer, torch.Tensor)):
            yield key


def read_train_state(path: Path) -> dict[str, Any]:
    return decode_train_state(path.read_bytes(), source=str(path))
