"""The storage seam's POSIX implementation: a root on a local disk, NFS or Lustre.

:class:`PosixStore` keeps everything a root needs from a POSIX filesystem:
``renameat2(RENAME_EXCHANGE)`` commits, fsyncs of files and directories,
``O_DIRECT`` writes and reads, ``flock``, regular-file-only opens (``store``),
DCP's readers on it (``readers``), and what an ``OSError`` on it means (``errors``).
Importing it registers it for local paths (:func:`safeckpt._store.open_store`).
"""

from .store import PosixStore

__all__ = ["PosixStore"]
