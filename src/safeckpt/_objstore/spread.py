"""Where a save's data objects go: one level below their directory, under a short hash of their name.

S3 serves a few thousand requests a second per key prefix and splits a busy
prefix only as its load grows. Every rank's file of one save shares the save's
area, so each data file (DCP's ``*.distcp``, one or more per rank: the bulk of a
save's requests) is written under two hex digits of its name's CRC32:
``.staging/step_7.<token>/3f/__0_0.distcp``. The ranks' multipart uploads and a
restore's ranged GETs then go to up to 256 prefixes, which S3 can serve apart,
as the request-rate guidance of S3 (and the prefix strategies of AWS's own
PyTorch connector) ask.

Only the object key changes. Names, records, DCP's metadata and checksums say
``__0_0.distcp``, and a listing shows the file at that name. Only a save's area
(under ``.staging/``) is spread, so a DCP checkpoint written by another tool,
elsewhere under the bucket, is read at the keys it has.
"""

from __future__ import annotations

import re
import zlib

from .._format.layout import DATA_SUFFIX, STAGING_NAME

_SHARD = re.compile(r"[0-9a-f]{2}")


def shard(leaf: str) -> str:
    """The two hex digits a data file named ``leaf`` goes under."""
    return f"{zlib.crc32(leaf.encode()) & 0xFF:02x}"


class Spread:
    """Maps the keys of one root (``prefix``, ``""`` or ending in ``/``) to where objects are."""

    def __init__(self, prefix: str) -> None:
        self._areas = prefix + STAGING_NAME + "/"

    def applies(self, key: str) -> bool:
        """Whether ``key`` (or a file directly under directory key ``key/``) is in a save's area."""
        return key.startswith(self._areas) and "/" in key[len(self._areas) :]

    def lists_an_area(self, prefix: str) -> bool:
        """Whether directory key ``prefix`` (ending in ``/``) is a save's area, or below one."""
        return prefix.startswith(self._areas) and len(prefix) > len(self._areas)

    def key(self, key: str) -> str:
        """The object key of the file at ``key``."""
        directory, _, leaf = key.rpartition("/")
        if not self.applies(key) or not leaf.endswith(DATA_SUFFIX):
            return key
        return f"{directory}/{shard(leaf)}/{leaf}"

    def name(self, key: str) -> str:
        """The inverse: the key a listed object is known by (``key`` itself if it is not spread)."""
        directory, _, leaf = key.rpartition("/")
        parent, _, hashed = directory.rpartition("/")
        if (
            _SHARD.fullmatch(hashed)
            and leaf.endswith(DATA_SUFFIX)
            and shard(leaf) == hashed
            and self.applies(f"{parent}/{leaf}")
        ):
            return f"{parent}/{leaf}"
        return key
