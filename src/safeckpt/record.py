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
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._version import __version__
from .atomic import atomic_write
from .errors import IncompleteCheckpointError, InvalidSaveError
from .fileops import FileOps
from .layout import RECORD_NAME
from .lock import SidecarLock

FORMAT_VERSION = 1
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

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "step": self.step,
            "status": self.status,
            "time": self.time,
            "time_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time)),
            "metrics": dict(self.metrics),
            "files": dict(sorted(self.files.items())),
            "world_size": self.world_size,
            "pinned": self.pinned,
            "extra": dict(self.extra),
            "registration": None if self.registration is None else dict(self.registration),
            "retention": None if self.retention is None else dict(self.retention),
            "library_version": self.library_version,
            "torch_version": self.torch_version,
        }

    @classmethod
    def from_json(cls, data: Any, *, path: str = "") -> Record:
        try:
            if not isinstance(data, dict):
                raise TypeError("not a JSON object")
            files = data["files"]
            if not isinstance(files, dict) or not all(
                isinstance(k, str) and isinstance(v, int) for k, v in files.items()
            ):
                raise TypeError("'files' must map names to sizes")
            return cls(
                step=_int(data["step"]),
                time=float(data["time"]),
                files=files,
                status=str(data["status"]),
                metrics=_metrics(data.get("metrics") or {}),
                extra=dict(data.get("extra") or {}),
                world_size=_int(data.get("world_size", 1)),
                pinned=bool(data.get("pinned", False)),
                registration=data.get("registration"),
                retention=_optional_dict(data.get("retention")),
                library_version=str(data.get("library_version", "")),
                torch_version=str(data.get("torch_version", "")),
                format_version=_int(data.get("format_version", FORMAT_VERSION)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise IncompleteCheckpointError(
                f"the record {path} is not a valid safeckpt record ({e}); the checkpoint "
                "cannot be trusted. Restore another step, or delete this directory.",
                path=path,
            ) from e

    @property
    def committed(self) -> bool:
        return self.status == COMMITTED

    @property
    def size(self) -> int:
        return sum(self.files.values())


def _metrics(value: Any) -> dict[str, float | None]:
    # Retention compares these numbers: a hand-edited string here must not reach it.
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)))
        for k, v in value.items()
    ):
        raise TypeError("'metrics' must map names to numbers or null")
    return dict(value)


def _optional_dict(value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"expected a JSON object or null, got {value!r}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def encode(record: Record) -> bytes:
    return (json.dumps(record.to_json(), indent=2, allow_nan=True) + "\n").encode()


def read_record(checkpoint_dir: Path) -> Record | None:
    """The record of ``checkpoint_dir``; None when it has none.

    Raises :class:`IncompleteCheckpointError` when the record exists but cannot
    be parsed. Takes no lock: records are replaced atomically.
    """
    path = checkpoint_dir / RECORD_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise IncompleteCheckpointError(
            f"the record {path} is not valid JSON ({e}); restore another step, or delete this directory.",
            path=str(path),
        ) from e
    return Record.from_json(data, path=str(path))


def write_record(checkpoint_dir: Path, record: Record, lock: SidecarLock, ops: FileOps) -> None:
    """Write ``record`` atomically into ``checkpoint_dir``. Holds the sidecar lock."""
    with lock:
        atomic_write(checkpoint_dir / RECORD_NAME, encode(record), ops)


def amend_record(checkpoint_dir: Path, lock: SidecarLock, ops: FileOps, **changes: Any) -> Record:
    """Re-read the record under the sidecar lock, change ``changes`` and write it back."""
    with lock:
        current = read_record(checkpoint_dir)
        if current is None:
            raise IncompleteCheckpointError(
                f"{checkpoint_dir} has no record to amend; it is not a committed checkpoint.",
                path=str(checkpoint_dir),
            )
        amended = dataclasses.replace(current, **changes)
        atomic_write(checkpoint_dir / RECORD_NAME, encode(amended), ops)
        return amended


# Hidden files a network or FUSE filesystem keeps for a deleted file that is still
# open (NFS silly rename); they vanish on their own and are no part of a checkpoint.
_TRANSIENT_PREFIXES = (".nfs", ".fuse_hidden")


def list_files(checkpoint_dir: Path) -> dict[str, int]:
    """Every file under ``checkpoint_dir`` except the record and NFS silly-rename files, with sizes."""
    files: dict[str, int] = {}
    for dirpath, _dirnames, filenames in os.walk(checkpoint_dir):
        for name in filenames:
            if name.startswith(_TRANSIENT_PREFIXES):
                continue
            full = Path(dirpath) / name
            rel = full.relative_to(checkpoint_dir).as_posix()
            if rel != RECORD_NAME:
                files[rel] = full.stat().st_size
    return files


def missing_or_wrong_files(checkpoint_dir: Path, record: Record) -> list[str]:
    """What makes ``checkpoint_dir`` disagree with its record; empty when complete."""
    problems = []
    for rel, size in sorted(record.files.items()):
        try:
            actual = (checkpoint_dir / rel).stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            problems.append(f"{rel} is missing")
            continue
        if actual != size:
            problems.append(f"{rel} has {actual} bytes, the record says {size}")
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
