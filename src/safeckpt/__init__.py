"""safeckpt: crash-safe, async checkpointing for PyTorch training.

from safeckpt import CheckpointManager, Retention

with CheckpointManager("runs/exp1/ckpt", retention=Retention(keep_last=3)) as mgr:
    start = (r := mgr.restore(state)).step or 0
    ...
    mgr.save(step, state, metrics={"val_loss": v})

The public names are imported on first use (:func:`__getattr__`): ``import safeckpt``
and the ``safeckpt`` command's help and listing never pay for torch and DCP.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# register the stores (local paths, s3:// URLs) and the second tier (local_dir=)
from . import _azure, _gcs, _posix, _s3, _tiers  # noqa: F401
from ._version import __version__
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidSaveError,
    LockTimeoutError,
    ManagerClosedError,
    NewerFormatError,
    RankAgreementError,
    RootInUseError,
    RootNotWritableError,
    RootUnreachableError,
    SaveFailedError,
    UnsafeCheckpointError,
    UnsupportedStateError,
)

if TYPE_CHECKING:  # what __getattr__ imports, for type checkers and editors
    from ._format.record import Record, read_record
    from ._fs.fileops import FileOps
    from ._manager.manager import CheckpointManager
    from ._manager.saves import CheckpointStatus
    from ._policy.retention import (
        CheckpointInfo,
        KeepAll,
        KeepAny,
        KeepBest,
        KeepEvery,
        KeepLast,
        KeepMilestones,
        KeepPinned,
        KeepTimeInterval,
        Policy,
        Retention,
    )
    from ._policy.schedule import Milestones, SaveSchedule
    from ._registration.pending import register_pending
    from ._registration.registrar import JsonlIndexRegistrar, Registrar
    from ._registration.worker import CommitInfo
    from ._restore.load import load
    from ._restore.restored import Restored
    from ._root.ownership import Owner, read_owner
    from ._state.per_rank import PerRank, per_rank

# public name -> the module that defines it, imported when the name is first used
_LAZY = {
    "CheckpointInfo": "._policy.retention",
    "CheckpointManager": "._manager.manager",
    "CheckpointStatus": "._manager.saves",
    "CommitInfo": "._registration.worker",
    "FileOps": "._fs.fileops",
    "JsonlIndexRegistrar": "._registration.registrar",
    "KeepAll": "._policy.retention",
    "KeepAny": "._policy.retention",
    "KeepBest": "._policy.retention",
    "KeepEvery": "._policy.retention",
    "KeepLast": "._policy.retention",
    "KeepMilestones": "._policy.retention",
    "KeepPinned": "._policy.retention",
    "KeepTimeInterval": "._policy.retention",
    "Milestones": "._policy.schedule",
    "Owner": "._root.ownership",
    "PerRank": "._state.per_rank",
    "Policy": "._policy.retention",
    "Record": "._format.record",
    "Registrar": "._registration.registrar",
    "Restored": "._restore.restored",
    "Retention": "._policy.retention",
    "SaveSchedule": "._policy.schedule",
    "load": "._restore.load",
    "per_rank": "._state.per_rank",
    "read_owner": "._root.ownership",
    "read_record": "._format.record",
    "register_pending": "._registration.pending",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointStatus",
    "CommitInfo",
    "ConfigError",
    "CorruptCheckpointError",
    "FileOps",
    "IncompleteCheckpointError",
    "InvalidSaveError",
    "JsonlIndexRegistrar",
    "KeepAll",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepMilestones",
    "KeepPinned",
    "KeepTimeInterval",
    "LockTimeoutError",
    "ManagerClosedError",
    "Milestones",
    "NewerFormatError",
    "Owner",
    "PerRank",
    "Policy",
    "RankAgreementError",
    "Record",
    "Registrar",
    "Restored",
    "Retention",
    "RootInUseError",
    "RootNotWritableError",
    "RootUnreachableError",
    "SaveFailedError",
    "SaveSchedule",
    "UnsafeCheckpointError",
    "UnsupportedStateError",
    "__version__",
    "load",
    "per_rank",
    "read_owner",
    "read_record",
    "register_pending",
]
