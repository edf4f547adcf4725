"""safeckpt: crash-safe, async checkpointing for PyTorch training.

from safeckpt import CheckpointManager, Retention

with CheckpointManager("runs/exp1/ckpt", retention=Retention(keep_last=3)) as mgr:
    start = (r := mgr.restore(state)).step or 0
    ...
    mgr.save(step, state, metrics={"val_loss": v})
"""

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
    SaveFailedError,
    UnsafeCheckpointError,
    UnsupportedStateError,
)
from .fileops import FileOps
from .loading import load
from .manager import CheckpointManager
from .ownership import Owner, read_owner
from .pending_registration import register_pending
from .record import Record, read_record
from .registration import CommitInfo
from .registry import JsonlIndexRegistrar, Registrar
from .restored import Restored
from .retention import (
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
from .schedule import Milestones, SaveSchedule
from .state import PerRank, per_rank
from .view import CheckpointStatus

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
