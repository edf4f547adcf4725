"""The record (sidecar) of a checkpoint: ``<checkpoint>/metadata.json``.

The record is what makes a checkpoint committed: it lists every file with its
size and says ``"status": "committed"``. Every write and amend goes through
:func:`write_record` / :func:`amend_record`, which hold the sidecar lock and
write atomically (temp file, fsync, ``os.replace``, directory fsync), so a
reader sees the old record or the new one, never a torn one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .._store.base import FILE, Lock
from .._store.loc import Loc, as_loc
from .._version import __version__
from ..errors import IncompleteCheckpointError, InvalidSaveError, NewerFormatError, UnsafeCheckpointError
from . import kept
from .contents import FileContents, contents_from_json, contents_to_json
from .layout import RECORD_NAME
from .tier_fields import Lineage, Part, Upload

FORMAT_VERSION = 2
_FLAT_NAME = re.compile(r"[^/\\\x00]+")
# A record is a few KiB, up to a few MiB with the checksums of 10^5 tensors; more is damage.
MAX_RECORD_BYTES = 64 << 20
COMMITTED = "committed"


@dataclass(frozen=True)
class Record:
    """What a committed checkpoint says about itself."""

    step: int
    time: float
    files: Mapping[str, int]
    status: str = COMMITTED
    metrics: Mapping[str, float | None] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    world_size: int = 1
    pinned: bool = False
    registration: Mapping[str, Any] | None = None
    retention: Mapping[str, Any] | None = None
    """The retention of the job that wrote it (``Retention.to_json()``), for ``safeckpt ls``."""
    library_version: str = __version__
    torch_version: str = ""
    format_version: int = FORMAT_VERSION
    checksums: Mapping[str, Any] | None = None
    """Per file, CRC32 segments covering it (see :mod:`safeckpt._format.checksums`); None in records written
    before format 2, whose bytes cannot be verified."""
    seq: int | None = None
    """The commit sequence: commits are ordered by it, never by step or mtime (None before format 2)."""
    uploaded: Upload | None = None
    """With two tiers (``local_dir=``): on the durable copy, when it was uploaded and from where; on
    the local copy, once its upload committed, when and to where (see :mod:`.tier_fields`)."""
    part: Part | None = None
    """With a local tier on each node's own disk: this node's part of a save; its ``files`` are
    those this node's ranks wrote."""
    local: Lineage | None = None
    """With two tiers, on a local commit: the durable root it follows (see :mod:`.lineage`). None
    on the durable copy."""
    contents: Mapping[str, FileContents] | None = None
    """Per data file of untrained tensors, its items by content digest and, for a file shared
    with an earlier checkpoint instead of written, where from (see :mod:`.contents`)."""

    @property
    def part_id(self) -> str | None:
        """The save this part belongs to (see ``part``), or None for a whole checkpoint (a part that
        names none is a part all the same: never taken for a whole checkpoint)."""
        return None if self.part is None else str(self.part.save)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "step": self.step,
            "status": self.status,
            "seq": self.seq,
            "time": self.time,
            "time_iso": utc_iso(self.time),
            "metrics": {k: encode_float(v) for k, v in self.metrics.items()},
            "files": dict(sorted(self.files.items())),
            "world_size": self.world_size,
            "pinned": self.pinned,
            "extra": encode_json(dict(self.extra)),
            "registration": None if self.registration is None else dict(self.registration),
            "retention": None if self.retention is None else dict(self.retention),
            "library_version": self.library_version,
            "torch_version": self.torch_version,
            **({} if self.uploaded is None else {"uploaded": self.uploaded.to_json()}),
            **({} if self.part is None else {"part": self.part.to_json()}),
            **({} if self.local is None else {"local": self.local.to_json()}),
            **({} if self.contents is None else {"contents": contents_to_json(self.contents)}),
            "checksums": None if self.checksums is None else dict(sorted(self.checksums.items())),
        }

    @classmethod
    def from_json(cls, data: Any, *, path: str = "", step: int | None = None) -> Record:
        """Parse and validate a record; ``step``: the step its directory's name stands for.

        Everything is checked before it is used (a record is untrusted input): types, a finite
        time, file names inside the checkpoint, and that the step is the directory's.
        """
        _refuse_newer(data, path)
        try:
            if not isinstance(data, dict):
                raise TypeError("not a JSON object")
            files = data["files"]
            if not isinstance(files, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in files.items()
            ):
                raise TypeError("'files' must map names to sizes")
            for name in files:
                if not _FLAT_NAME.fullmatch(name) or name in (".", ".."):
                    raise UnsafeCheckpointError(
                        f"the record {path} lists the file {name!r}, which is not inside the "
                        "checkpoint; the record was modified. Restore another checkpoint.",
                        path=path,
                    )
            record_time = data["time"]
            if isinstance(record_time, bool) or not isinstance(record_time, (int, float)):
                raise TypeError("'time' must be a number")
            # Any finite time the writer can write is read back: a host clock set before 1970 (or far
            # ahead) writes such times, and refusing them would skip whole checkpoints on resume.
            if not math.isfinite(record_time):
                raise ValueError(f"'time' {record_time!r} is not a finite number")
            checksums = _optional_dict(data.get("checksums"))
            if checksums is not None and set(checksums) != set(files):
                raise ValueError("'checksums' must cover exactly the files the record lists")
            seq = data.get("seq")
            record = cls(
                step=_int(data["step"]),
                time=float(record_time),
                files=files,
                status=_str(data["status"]),
                metrics=_metrics(data.get("metrics") or {}),
                extra=_dict(decode_json(data.get("extra") or {})),
                world_size=_int(data.get("world_size", 1)),
                pinned=_bool(data.get("pinned", False)),
                registration=_optional_dict(data.get("registration")),
                retention=_optional_dict(data.get("retention")),
                library_version=str(data.get("library_version", "")),
                torch_version=str(data.get("torch_version", "")),
                format_version=_int(data.get("format_version", 1)),
                checksums=checksums,
                seq=None if seq is None else _int(seq),
                uploaded=_optional(Upload, data.get("uploaded")),
                part=_optional(Part, data.get("part")),
                local=_optional(Lineage, data.get("local")),
                contents=contents_from_json(data.get("contents"), files),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise IncompleteCheckpointError(
                f"the record {path} is not a valid safeckpt record ({type(e).__name__}: {e}); the "
                "checkpoint cannot be trusted. Restore another step, or delete this directory.",
                path=path,
            ) from e
        if step is not None and record.step != step:
            raise IncompleteCheckpointError(
                f"the record {path} says step {record.step}, but its directory is step {step}; it "
                "was copied or edited. Restore another step.",
                path=path,
                step=step,
            )
        return record

    @property
    def committed(self) -> bool:
        return self.status == COMMITTED

    @property
    def size(self) -> int:
        return sum(self.files.values())


def _refuse_newer(data: Any, path: str) -> None:
    """A record of a newer format is refused before anything in it is read: its fields may mean
    what this safeckpt does not know, and skipping it would silently resume from an older step."""
    version = data.get("format_version") if isinstance(data, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise NewerFormatError(
            f"the record {path} was written by a newer safeckpt (record format {version}; this one "
            f"reads formats up to {FORMAT_VERSION}). Upgrade safeckpt to read this root; nothing in "
            "it is read, resumed from or pruned as if it were older.",
            path=path,
        )


def utc_iso(seconds: float) -> str | None:
    """``seconds`` (Unix time) as ISO 8601 UTC; None when the platform cannot represent it."""
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
    except (OverflowError, OSError, ValueError):  # far beyond year 9999 or before year 1
        return None


def _metrics(value: Any) -> dict[str, float | None]:
    # Retention compares these numbers: a hand-edited string here must not reach it.
    if not isinstance(value, dict):
        raise TypeError("'metrics' must map names to numbers or null")
    decoded = {k: decode_json(v) for k, v in value.items()}
    if not all(
        isinstance(k, str) and (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)))
        for k, v in decoded.items()
    ):
        raise TypeError("'metrics' must map names to numbers or null")
    return decoded


# Strict JSON has no NaN or Infinity: a non-finite float is written as {"$float": "inf"}.
_FLOAT_TAG = "$float"
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def encode_float(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT_TAG: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    return value


def encode_json(value: Any) -> Any:
    """``value`` with every non-finite float spelled as strict JSON (see :func:`decode_json`)."""
    if isinstance(value, float):
        return encode_float(value)
    if isinstance(value, dict):
        return {k: encode_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_json(v) for v in value]
    return value


def decode_json(value: Any) -> Any:
    if isinstance(value, dict):
        if len(value) == 1 and _FLOAT_TAG in value and value[_FLOAT_TAG] in _NON_FINITE:
            return _NON_FINITE[value[_FLOAT_TAG]]
        return {k: decode_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_json(v) for v in value]
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def _dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, got {value!r}")
    return value


def _optional_dict(value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"expected a JSON object or null, got {value!r}")
    return value


_Field = TypeVar("_Field", Part, Upload, Lineage)


def _optional(kind: type[_Field], value: Any) -> _Field | None:
    found = _optional_dict(value)
    return None if found is None else kind.from_json(found)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def encode(record: Record) -> bytes:
    """The record as JSON, indented for a reader, but for the checksums and contents: a row per item,
    10^4 of them for a state of small tensors, written compact by the C encoder. The indenting
    encoder is pure Python (several times slower) and holds the GIL while training runs."""
    data = record.to_json()
    compact = {k: data.pop(k) for k in ("contents", "checksums") if data.get(k)}
    if not compact:
        return (json.dumps(data, indent=2, allow_nan=False) + "\n").encode()
    head = json.dumps(data, indent=2, allow_nan=False)  # "{\n  ...\n}": the same object, continued
    rows = "".join(
        f',\n  "{k}": {json.dumps(v, separators=(",", ":"), allow_nan=False)}' for k, v in compact.items()
    )
    return f"{head[:-2]}{rows}\n}}\n".encode()


def read_record(checkpoint_dir: Loc | str | os.PathLike[str], *, step: int | None = None) -> Record | None:
    """The record of ``checkpoint_dir`` (a path, or a name in a root's store); None when it has none.

    Raises :class:`IncompleteCheckpointError` when the record exists but cannot
    be parsed or validated (``step``: the step the directory stands for), and
    :class:`UnsafeCheckpointError` when it is not a regular file or names files
    outside the checkpoint. Takes no lock: records are replaced atomically.
    """
    path = as_loc(checkpoint_dir) / RECORD_NAME
    try:
        raw = path.store.read_small(path.key, limit=MAX_RECORD_BYTES, what="record")
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except ValueError as e:
        raise IncompleteCheckpointError(
            f"the record {path} is not valid JSON ({e}); restore another step, or delete this directory.",
            path=str(path),
        ) from e
    return Record.from_json(data, path=str(path), step=step)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def write_record(checkpoint_dir: Loc, record: Record, lock: Lock) -> None:
    """Write ``record`` atomically into ``checkpoint_dir``. Holds the sidecar lock."""
    path = checkpoint_dir / RECORD_NAME
    with lock:
        path.store.write_atomic(path.key, encode(record))


def amend_record(checkpoint_dir: Loc, lock: Lock, **changes: Any) -> Record:
    """Re-read the record under the sidecar lock, change ``changes`` and write it back."""
    path = checkpoint_dir / RECORD_NAME
    with lock:
        current = read_record(checkpoint_dir)
        if current is None:
            raise IncompleteCheckpointError(
                f"{checkpoint_dir} has no record to amend; it is not a committed checkpoint.",
                path=str(checkpoint_dir),
            )
        amended = dataclasses.replace(current, **changes)
        path.store.write_atomic(path.key, encode(amended))
        return amended


# Hidden files a network or FUSE filesystem keeps for a deleted file that is still
# open (NFS silly rename); they vanish on their own and are no part of a checkpoint.
_TRANSIENT_PREFIXES = (".nfs", ".fuse_hidden")


def list_files(checkpoint_dir: Loc | str | os.PathLike[str]) -> dict[str, int]:
    """Every regular file in ``checkpoint_dir`` except the record and NFS silly-rename files, with sizes.

    A checkpoint is flat (DCP with one file per rank, the train-state files): a
    directory or link inside one is not part of it.
    """
    directory = as_loc(checkpoint_dir)
    files: dict[str, int] = {}
    for entry in directory.store.entries(directory.key):
        name = entry.name
        if name == RECORD_NAME or name.startswith(_TRANSIENT_PREFIXES) or _is_temp_name(name):
            continue
        if entry.kind == FILE:
            files[name] = entry.size
    return files


_TEMP_NAME = re.compile(r"^\..+\.tmp\.[0-9a-f]{12}$|^\.metadata\.tmp$")


def _is_temp_name(name: str) -> bool:
    """A temp file of safeckpt's atomic writes (``.<name>.tmp.<token>``) or DCP's ``.metadata.tmp``."""
    return _TEMP_NAME.match(name) is not None


def same_checkpoint(a: Record, b: Record) -> bool:
    """The same checkpoint in two roots (a local copy and its upload): the same step and bytes, as
    their recorded checksums say (a record without checksums is never the same as anything)."""
    return a.step == b.step and a.checksums is not None and a.checksums == b.checksums


def missing_or_wrong_files(checkpoint_dir: Loc | str | os.PathLike[str], record: Record) -> list[str]:
    """What makes ``checkpoint_dir`` disagree with its record; empty when complete.

    Stats only (``lstat``): a FIFO or a link where a file should be is a problem, never a hang.
    One listing of the directory, not a look per file: on object storage each look is a round
    trip, and a checkpoint has a file per rank. Inside a :func:`~safeckpt._format.kept.keeping`
    scope, a directory found complete for a commit is not listed again for it.
    """
    directory = as_loc(checkpoint_dir)
    commit = (record.step, record.seq, record.time, tuple(sorted(record.files.items())))
    if kept.files_matched(directory, commit):
        return []
    listed = {e.name: e for e in directory.store.entries(directory.key)}
    problems = []
    for rel, size in sorted(record.files.items()):
        entry = listed.get(rel) if "/" not in rel else (directory / rel).entry()
        if entry is None:
            problems.append(f"{rel} is missing")
        elif entry.kind != FILE:
            problems.append(f"{rel} is not a regular file")
        elif entry.size != size:
            problems.append(f"{rel} has {entry.size} bytes, the record says {size}")
    if not problems:
        kept.note_files_match(directory, commit)
    return problems


def check_json_value(value: Any, what: str) -> None:
    """Raise :class:`InvalidSaveError` naming the first part of ``value`` JSON cannot hold."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError, RecursionError) as e:
        try:
            where = _first_non_json(value, what, set()) or what
        except RecursionError:  # nested too deeply to walk
            where = what
        raise InvalidSaveError(
            f"{what} must be JSON data (dict, list, str, int, float, bool, None), but {where} is "
            f"not: {e}. Convert the value (e.g. tensor.item(), str(path)) before saving; nothing "
            "was written."
        ) from e


def _first_non_json(value: Any, path: str, seen: set[int]) -> str | None:
    """Where in ``value`` the first part JSON cannot hold is (``extra['a'][0]``), or None."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    if not isinstance(value, (dict, list, tuple)) or id(value) in seen:
        return path  # not JSON, or a reference cycle
    seen.add(id(value))
    if isinstance(value, dict):
        items: Any = value.items()
        for key in value:
            if key is not None and not isinstance(key, (str, int, float, bool)):
                return f"the key {key!r} of {path}"
    else:
        items = enumerate(value)
    for key, item in items:
        found = _first_non_json(item, f"{path}[{key!r}]", seen)
        if found is not None:
            return found
    seen.discard(id(value))
    return None


def clean_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float | None]:
    """Metrics as plain floats; NaN becomes None (a missing value for ranking)."""
    if metrics is not None and not isinstance(metrics, Mapping):
        raise InvalidSaveError(
            f"metrics must be a dict of name -> number, got {type(metrics).__name__}; nothing was written."
        )
    cleaned: dict[str, float | None] = {}
    for name, value in (metrics or {}).items():
        if not isinstance(name, str):
            raise InvalidSaveError(f"metric names must be strings, got {name!r}; nothing was written.")
        if hasattr(value, "item") and callable(value.item):  # 0-d tensors and numpy scalars
            try:
                value = value.item()
            except (ValueError, RuntimeError) as e:
                raise InvalidSaveError(
                    f"metric {name!r} must be a number, got a tensor with several elements; "
                    "pass a scalar. Nothing was written."
                ) from e
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidSaveError(
                f"metric {name!r} must be a number, got {type(value).__name__}; nothing was written."
            )
        try:
            value = float(value)
        except OverflowError as e:  # an int beyond the float range
            raise InvalidSaveError(
                f"metric {name!r} is too large for a float ({e}); nothing was written."
            ) from e
        cleaned[name] = None if math.isnan(value) else value
    return cleaned
