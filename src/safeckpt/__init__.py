"""safeckpt: crash-safe, async checkpointing for PyTorch training.

from safeckpt import CheckpointManager, Retention

with CheckpointManager("runs/exp1/ckpt", retention=Retention(keep_last=3)) as mgr:
    start = (r := mgr.restore(state)).step or 0
    ...
    mgr.save(step, state, metrics={"val_loss": v})
"""

from . import _posix, _s3  # noqa: F401  (register the stores: local paths, s3:// URLs)
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
