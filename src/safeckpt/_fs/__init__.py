"""POSIX file mechanism on paths: the FileOps seam, atomic replace and fsync, the sidecar lock, direct I/O."""
