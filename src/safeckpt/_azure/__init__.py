"""Azure Blob Storage: the client of the generic object-root store for ``az://`` roots.

Importing it registers the ``az`` scheme; the client's libraries (urllib3, and
azure-identity for ``DefaultAzureCredential``) are imported only when an ``az://``
root is opened. The root itself (the commit object, ``latest``, the lease,
verified reads) is :mod:`safeckpt._objstore`'s; this package is only Blob
Storage's requests (``client``), its signing (``auth``) and its URL, settings and
credentials (``location``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._store.registry import register


def open_root(root: str, *, ops: Any = None, options: Mapping[str, Any] | None = None) -> Any:
    """The store of the ``az://container/prefix`` root ``root``."""
    from .._objstore.store import ObjectRootStore, Transfer
    from .client import AzureClient
    from .location import parse_url, settings

    del ops  # FileOps is the local store's fault seam; Azure's faults come from the service
    location = parse_url(str(root))
    chosen = settings(options, location.url)
    client = AzureClient(location, chosen)
    transfer = Transfer(part_size=chosen.part_size, max_concurrency=chosen.max_concurrency)
    return ObjectRootStore(client, location.url, location.prefix, transfer)


register("az", open_root)
