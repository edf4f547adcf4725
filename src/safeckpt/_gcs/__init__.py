"""Google Cloud Storage: the client of the generic object-root store for ``gs://`` roots.

Importing it registers the ``gs`` scheme; the client's libraries (urllib3, and
google-auth for credentials) are imported only when a ``gs://`` root is opened.
The root itself (the commit object, ``latest``, the lease, verified reads) is
:mod:`safeckpt._objstore`'s; this package is only GCS's requests (``client``) and
its URL, settings and credentials (``location``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._store.registry import register


def open_root(root: str, *, ops: Any = None, options: Mapping[str, Any] | None = None) -> Any:
    """The store of the ``gs://bucket/prefix`` root ``root``."""
    from .._objstore.store import ObjectRootStore, Transfer
    from .client import GcsClient
    from .location import parse_url, settings

    del ops  # FileOps is the local store's fault seam; GCS's faults come from the service
    location = parse_url(str(root))
    chosen = settings(options)
    client = GcsClient(location, chosen)
    transfer = Transfer(part_size=chosen.part_size, max_concurrency=chosen.max_concurrency)
    return ObjectRootStore(client, location.url, location.prefix, transfer)


register("gs", open_root)
register("gcs", open_root)  # gcsfs's other spelling
