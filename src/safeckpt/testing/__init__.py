"""Test helpers for filesystems with NFS semantics (needs FUSE and ``mfusepy`` to mount).

Not imported by ``import safeckpt``; ``mfusepy`` is imported only by the
filesystem process itself.
"""

from .counting import CleanupPass, CountingFileOps
from .holder import FileHolder, Hold, hold_open
from .nfs import NFSMount, NFSMountError, fuse_unavailable_reason, is_mounted, mount_nfs
from .nfs_model import Linger, NFSConfig

__all__ = [
    "CleanupPass",
    "CountingFileOps",
    "FileHolder",
    "Hold",
    "Linger",
    "NFSConfig",
    "NFSMount",
    "NFSMountError",
    "fuse_unavailable_reason",
    "hold_open",
    "is_mounted",
    "mount_nfs",
]
