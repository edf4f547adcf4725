"""S3 (and S3-compatible servers): the client of the generic object-root store for ``s3://`` roots.

Importing it registers the ``s3`` scheme (:func:`safeckpt._store.open_store`); the
client library (boto3) is imported only when an ``s3://`` root is opened. What a
root on an object store is (the commit object, ``latest``, the lease, leftovers,
verified reads) is :mod:`safeckpt._objstore`'s, once for every service; this
package is only S3's requests (``client``), its URL and settings (``location``)
and what its errors mean (``errors``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._store.registry import register


def open_root(root: str, *, ops: Any = None, options: Mapping[str, Any] | None = None) -> Any:
    """The store of the ``s3://bucket/prefix`` root ``root``."""
    from .._objstore.store import ObjectRootStore, Transfer
    from .client import S3Client
    from .location import parse_url, settings

    del ops  # FileOps is the local store's fault seam; S3's faults come from the server
    location = parse_url(str(root))
    chosen = settings(options)
    client = S3Client(location, chosen)
    transfer = Transfer(part_size=chosen.part_size, max_concurrency=chosen.max_concurrency)
    return ObjectRootStore(client, location.url, location.prefix, transfer)


register("s3", open_root)
