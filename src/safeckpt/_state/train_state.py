"""The per-rank train-state file: a state's structure and its non-tensor values, without pickle.

The file is a safetensors blob. Its metadata holds one JSON document::

    {"format": 2,                              # 3 where the tree has a per_rank value
     "tree": {"D": [[key, node], ...]},         # the container structure of the state
     "values": [<leaf>, ...],                  # every non-tensor leaf, in walk order
     "rng": <the RNG states or null>}

A node is one of ``{"T": fqn}`` (a tensor, stored by DCP under ``fqn``),
``{"V": i}`` (``values[i]``), ``{"D": [[key, node], ...]}`` (a dict; keys keep
their type, str or int), ``{"L": [...]}`` (a list), ``{"U": [...]}`` (a tuple),
the wrappers ``{"M": node}`` (an ``nn.Module``), ``{"O": node}`` (an
optimizer) and ``{"S": node}`` (a ``Stateful``), and ``{"R": i}``
(``values[i]`` is a ``per_rank`` value, whole). Its tensors are the RNG
states' (torch's generator state is a tensor) and those of ``per_rank``
values. Loading it never unpickles anything. :func:`read_tree` reads a checkpoint's tree for loading: verified
against the record's checksums, one rank's or every rank's merged.
"""

from __future__ import annotations

import base64
import functools
import json
import random
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from .._dcp import safe_metadata
from .._format.checksums import read_verified
from .._format.record import Record
from .._store.loc import Loc
from ..errors import IncompleteCheckpointError, NewerFormatError, UnsupportedStateError
from .per_rank import PerRank

TRAIN_STATE_FORMAT = 2
# A file with ``{"R": i}`` nodes (per_rank values, tensors included). The safeckpt before per_rank()
# took those for damage; a format number it does not know makes it name another version instead.
PER_RANK_FORMAT = 3
READABLE_FORMATS = (1, TRAIN_STATE_FORMAT, PER_RANK_FORMAT)
_METADATA_KEY = "safeckpt.train_state"
RNG_KEY = "rng"
_RANK_FILE = re.compile(r"train_state\.rank(\d+)\.safetensors")


def train_state_filename(rank: int) -> str:
    return f"train_state.rank{rank}.safetensors"


_JSON_SCALARS = frozenset((type(None), bool, int, float, str))


class _Encoder:
    """Turns a tree of plain values (and, for RNG states and ``per_rank`` values, tensors) into JSON
    plus a tensor table (``tensors``: shared by the encoders of one file, names never repeat)."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] = {} if tensors is None else tensors

    def encode(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            name = f"t{len(self.tensors)}"
            tensor = value.detach()
            if type(tensor).__name__ == "DTensor":
                raise unsupported(value, path, " in per_rank() (DCP saves a DTensor's shards: leave it out)")
            if tensor.layout != torch.strided or not _safetensors_dtype(tensor.dtype):
                raise unsupported(value, path)
            self.tensors[name] = tensor.to("cpu", copy=True).contiguous()
            return {"__tensor__": name}
        if isinstance(value, (list, tuple)) and all(type(v) in _JSON_SCALARS for v in value):
            # As the element-wise encoding below gives it, without a call per element: the
            # Python RNG state alone is 625 ints, encoded at every save().
            return list(value) if isinstance(value, list) else {"__tuple__": list(value)}
        if isinstance(value, list):
            return [self.encode(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, Mapping):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: self.encode(v, f"{path}.{k}") for k, v in value.items()}
            return {
                "__dict__": [
                    [self.encode(k, f"{path} key"), self.encode(v, f"{path}.{k}")] for k, v in value.items()
                ]
            }
        if isinstance(value, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(value)).decode()}
        if isinstance(value, torch.dtype):
            return {"__dtype__": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"__device__": str(value)}
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
        raise unsupported(value, path, _hint(value))


def _hint(value: Any) -> str:
    """What to do instead, for the values people try."""
    if isinstance(value, torch.Generator):
        return " (save its get_state(), a uint8 tensor, and set_state() it after restore)"
    if isinstance(value, PerRank):
        return " inside per_rank() (all of a per_rank() value is the rank's own already: drop the inner one)"
    return ""


def unsupported(value: Any, path: str, why: str = "") -> UnsupportedStateError:
    """The error for a value that cannot be saved without pickle, naming where it sits."""
    what = f"{type(value).__module__}.{type(value).__qualname__}"
    return UnsupportedStateError(
        f"{path} is a {what}{why}, which safeckpt cannot save without pickle. Keep training state "
        "to tensors, numbers, strings, bytes, lists, tuples and dicts with str or int keys (convert "
        "the value in your state_dict(), or leave it out of the state). Nothing was written."
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
        if tag == "__dtype__":
            dtype = getattr(torch, body)  # a name, looked up among torch's dtypes only
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{body!r} is not a torch dtype")
            return dtype
        if tag == "__device__":
            return torch.device(body)
        if tag == "__ndarray__":
            import numpy

            return numpy.array(body["data"], dtype=numpy.dtype(body["dtype"])).reshape(body["shape"])
    return {k: _decode(v, tensors) for k, v in value.items()}


def encode_values(
    values: list[Any], paths: list[str] | None = None, tensors: dict[str, torch.Tensor] | None = None
) -> str:
    """The JSON text of the non-tensor leaves (``paths`` name them in errors); tensors inside them
    (``per_rank`` values) are copied into ``tensors``, for :func:`encode_train_state`."""
    encoder = _Encoder(tensors)
    encoded = [
        encoder.encode(v, paths[i] if paths is not None else f"leaf {i}") for i, v in enumerate(values)
    ]
    return json.dumps(encoded, allow_nan=True)


def encode_train_state(
    tree_json: str,
    values_json: str,
    rng: Mapping[str, Any] | None,
    tensors: dict[str, torch.Tensor] | None = None,
    *,
    per_rank: bool = False,
) -> bytes:
    """The train-state file's bytes from the (cached) tree JSON, the values' JSON (and the tensors
    :func:`encode_values` put in ``tensors``) and the RNG states; ``per_rank``: the tree has
    ``{"R": i}`` nodes (format 3, which an earlier safeckpt refuses by its number)."""
    encoder = _Encoder(tensors)
    rng_json = "null" if rng is None else json.dumps(encoder.encode(dict(rng), "rng state"), allow_nan=True)
    version = PER_RANK_FORMAT if per_rank else TRAIN_STATE_FORMAT
    # Assembled as text: the tree of a large state is encoded once per structure, not per save.
    document = (
        f'{{"format": {version}, "tree": {tree_json}, "values": {values_json}, "{RNG_KEY}": {rng_json}}}'
    )
    return safetensors_save(encoder.tensors, metadata={_METADATA_KEY: document})


def decode_train_state(blob: bytes, *, source: str) -> dict[str, Any]:
    """``{"format": 2, "tree": ..., "values": [...], "rng": ...}`` from a train-state file's bytes
    (``{"format": 1, "entries": ..., "rng": ...}`` for a file of safeckpt 0.1)."""
    try:
        tensors = safetensors_load(blob)
        header_len = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + header_len])
        document = json.loads(header["__metadata__"][_METADATA_KEY])
        if document.get("format") == 1:  # safeckpt 0.1: top-level entries (see legacy_state.py)
            return {
                "format": 1,
                "entries": _decode(document["entries"], tensors),
                RNG_KEY: _decode(document.get(RNG_KEY), tensors),
            }
        version = document.get("format")
        if isinstance(version, int) and version > max(READABLE_FORMATS):
            raise NewerFormatError(
                f"{source} was written by a newer safeckpt (train-state format {version}; this one "
                f"reads formats up to {max(READABLE_FORMATS)}). Upgrade safeckpt to load it, or "
                "restore an earlier checkpoint by its step."
            )
        if version not in (TRAIN_STATE_FORMAT, PER_RANK_FORMAT):
            raise ValueError(f"format {version!r}, expected one of {READABLE_FORMATS}")
        tree = document["tree"]
        if not isinstance(tree, dict):
            raise ValueError("the tree is not a JSON object")
        # Inside the try: a document naming a tensor the file lacks is damage too.
        return {
            "format": version,
            "tree": tree,
            "values": _decode(document["values"], tensors),
            RNG_KEY: _decode(document.get(RNG_KEY), tensors),
        }
    except NewerFormatError:
        raise
    except Exception as e:
        raise IncompleteCheckpointError(
            f"{source} is not a readable train-state file ({type(e).__name__}: {e}); the "
            "checkpoint is damaged or was written by another safeckpt version. Restore another one.",
            path=source,
        ) from e


# --- the recorded structure of a checkpoint ------------------------------------------------


def resolve(tree: Any, values: list[Any], *, source: str) -> Any:
    """``tree`` with each ``{"V": i}`` replaced by ``{"v": values[i]}`` (the value itself), and each
    ``{"R": i}`` by ``{"R": node}``: ``values[i]`` as a tree whose tensors are ``{"t": tensor}``."""

    def value(index: Any) -> Any:
        if not isinstance(index, int) or not 0 <= index < len(values):
            raise IncompleteCheckpointError(f"{source}: value {index!r} is not in the file", path=source)
        return values[index]

    def walk(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) != 1:
            raise IncompleteCheckpointError(f"{source}: malformed state tree entry {node!r}", path=source)
        ((tag, body),) = node.items()
        if tag == "V":
            return {"v": value(body)}
        if tag == "R":
            return {"R": as_tree(value(body))}
        if tag == "D":
            return {"D": [[k, walk(child)] for k, child in body]}
        if tag in ("L", "U"):
            return {tag: [walk(child) for child in body]}
        if tag in ("M", "O", "S"):
            return {tag: walk(body)}
        return node

    return walk(tree)


def as_tree(value: Any) -> Any:
    """A decoded value as tree nodes, so that it loads like the rest of the state (in place)."""
    if isinstance(value, torch.Tensor):
        return {"t": value}
    if isinstance(value, dict):
        return {"D": [[k, as_tree(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"U" if isinstance(value, tuple) else "L": [as_tree(v) for v in value]}
    return {"v": value}


def merge(trees: list[Any]) -> Any:
    """One tree from several ranks' trees: the union of their dict keys, the first rank's value
    where several have one (ranks holding disjoint keys, such as pipeline stages, add up)."""
    first = trees[0]
    if len(trees) == 1:
        return first
    ((tag, _),) = first.items()
    if tag in ("M", "O", "S"):
        inner = [t[tag] for t in trees if tag in t]
        return {tag: merge(inner)}
    if tag != "D":
        return first
    order: list[Any] = []
    children: dict[Any, list[Any]] = {}
    for tree in trees:
        if "D" not in tree:
            continue
        for k, child in tree["D"]:
            if k not in children:
                order.append(k)
                children[k] = []
            children[k].append(child)
    return {"D": [[k, merge(children[k])] for k in order]}


@dataclass
class Legacy:
    """The top-level ``entries`` of a safeckpt 0.1 train-state file (see :mod:`.legacy_state`)."""

    entries: dict[str, Any]


def _rank_files(record: Record) -> list[str]:
    """The train-state files ``record`` lists, by rank."""
    found = []
    for name in record.files:
        match = _RANK_FILE.fullmatch(name)
        if match:
            found.append((int(match.group(1)), name))
    return [name for _, name in sorted(found)]


def _read(directory: Loc, name: str, record: Record) -> dict[str, Any]:
    checksums = safe_metadata.checksums_of(record, directory)
    blob = read_verified(
        directory / name,
        size=record.files.get(name),
        checksum=None if checksums is None else checksums.get(name),
        step=record.step,
    )
    train = decode_train_state(blob, source=str(directory / name))
    if train["format"] == 1:
        train["tree"] = Legacy(train["entries"])
    else:
        train["tree"] = resolve(train["tree"], train["values"], source=str(directory / name))
    return train


def read_tree(directory: Loc, record: Record, rank: int | None) -> tuple[Any, Any]:
    """The state tree to load, verified: ``rank``'s own, else every rank's merged. Also ``rank``'s
    RNG states (None when that rank has no file)."""
    own = train_state_filename(rank) if rank is not None else None
    if own is not None and own in record.files:
        train = _read(directory, own, record)
        return train["tree"], train["rng"]
    names = _rank_files(record)
    if not names:
        raise IncompleteCheckpointError(
            f"{directory} has no train-state file: it is not a complete safeckpt checkpoint. "
            "Restore another one.",
            path=str(directory),
        )
    trees = [_read(directory, name, record)["tree"] for name in names]
    if isinstance(trees[0], Legacy):
        return trees[0], None  # safeckpt 0.1 loaded rank 0's entries on other ranks
    merged = merge(trees)
    # A rank the run did not have (restored at a larger world size) has no per_rank values of its own:
    # another rank's would repeat that rank's data stream, so they are marked absent instead.
    return (merged if rank is None else _no_per_rank(merged)), None


def _no_per_rank(node: Any) -> Any:
    ((tag, body),) = node.items()
    if tag == "R":
        return {"R": None}
    if tag == "D":
        return {"D": [[k, _no_per_rank(child)] for k, child in body]}
    if tag in ("L", "U"):
        return {tag: [_no_per_rank(child) for child in body]}
    if tag in ("M", "O", "S"):
        return {tag: _no_per_rank(body)}
    return node


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
