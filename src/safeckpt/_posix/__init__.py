"""The storage seam's POSIX implementation: a root on a local disk, NFS or Lustre.

:class:`PosixStore` keeps everything a root needs from a POSIX filesystem:
``renameat2(RENAME_EXCHANGE)`` commits, fsyncs of files and directories,
``O_DIRECT`` writes and reads, ``flock``, regular-file-only opens. :func:`open_store`
is how the layers above get a store for a root; :mod:`.local` holds the few file
operations on paths that are not a root (weights files, an index file).
"""

from .store import PosixStore, open_store

__all__ = ["PosixStore", "open_store"]
