"""safeckpt: crash-safe, async checkpointing for PyTorch training.

from safeckpt import CheckpointManager, Retention

with CheckpointManager("runs/exp1/ckpt", retention=Retention(keep_last=3)) as mgr:
    step = mgr.restore(state)
    ...
    mgr.save(step, state, metrics={"val_loss": v})
"""

from ._version import __version__
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    InvalidSaveError,
    LockTimeoutError,
    ManagerClosedError,
    RankAgreementError,
    SaveFailedError,
    UnsafeCheckpointError,
    UnsupportedStateError,
)
from .fileops import FileOps
from .manager import CheckpointManager
from .record import Record, read_record
from .registry import JsonlIndexRegistrar, Registrar
from .retention import (
    CheckpointInfo,
    KeepAll,
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepPinned,
    Policy,
    Retention,
)
from .view import CheckpointStatus

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointStatus",
    "ConfigError",
    "FileOps",
    "IncompleteCheckpointError",
    "InvalidSaveError",
    "JsonlIndexRegistrar",
    "KeepAll",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepPinned",
    "LockTimeoutError",
    "ManagerClosedError",
    "Policy",
    "RankAgreementError",
    "Record",
    "Registrar",
    "Retention",
    "SaveFailedError",
    "UnsafeCheckpointError",
    "UnsupportedStateError",
    "__version__",
    "read_record",
]
