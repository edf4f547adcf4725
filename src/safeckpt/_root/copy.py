"""Copying a committed checkpoint's files from one root to another, every byte checked on the way.

An upload reads the local copy once: each chunk goes into the running CRC32 of
its segment and on to the destination. A segment that does not match its
recorded checksum stops the copy before the destination is committed, so a
damaged local copy is never made durable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._format.checksums import FileChecksum, parse_checksums, verify_handle
from .._format.record import Record
from .._store.loc import Loc
from ..errors import IncompleteCheckpointError


class CopyStopped(Exception):
    """``should_stop`` said to stop (the manager is closing); the target is incomplete."""


def copy_checkpoint(
    source: Loc, record: Record, target: Loc, *, should_stop: Callable[[], bool] | None = None
) -> None:
    """Every file ``record`` lists, from checkpoint directory ``source`` into ``target`` (made);
    ``should_stop`` is asked between chunks."""
    checksums = parse_checksums(record.checksums, record.files, where=str(source))
    target.store.make_dir(target.key)
    for name, size in sorted(record.files.items()):
        checksum = None if checksums is None else checksums.get(name)
        copy_file(
            source / name,
            target / name,
            size=size,
            checksum=checksum,
            step=record.step,
            should_stop=should_stop,
        )


def copy_file(
    source: Loc,
    target: Loc,
    *,
    size: int,
    checksum: FileChecksum | None,
    step: int,
    should_stop: Callable[[], bool] | None = None,
) -> None:
    """``source`` to ``target``: its recorded size first, then each segment's CRC32 as it streams."""
    if checksum is None:
        raise IncompleteCheckpointError(
            f"{source} was written before safeckpt recorded checksums: its bytes cannot be checked, "
            "so it is not copied.",
            path=str(source),
            step=step,
        )
    with source.store.open_read(source.key) as handle:
        if handle.size != size:
            raise IncompleteCheckpointError(
                f"{source} has {handle.size} bytes, its record says {size}: the copy was damaged "
                "after it was committed; it is not uploaded.",
                path=str(source),
                step=step,
            )

        def copy(out: Any) -> None:
            def write(chunk: bytes) -> None:
                if should_stop is not None and should_stop():
                    raise CopyStopped(f"stopped copying {source}")
                out.write(chunk)

            verify_handle(handle, source, checksum, step=step, sink=write)

        target.store.write_stream(target.key, copy)
