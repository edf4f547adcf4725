"""Storage backends from outside: serve a URL scheme with a store of your own.

A *store* holds every name and byte of a checkpoint root (:class:`Store`, the
contract of ``docs/architecture.md``). For an object store, write only its
*client* (:class:`ObjectClient`: a few requests and the errors they raise) and let
:class:`ObjectRootStore` build the root on it, with the same guarantees as
``s3://`` (a conditional-write commit, the lease, every byte verified)::

    import safeckpt.storage as storage

    def open_root(url, *, ops=None, options=None):
        bucket, _, prefix = url.removeprefix("mystore://").partition("/")
        client = MyClient(bucket, **(options or {}))          # an ObjectClient
        prefix = "".join(p + "/" for p in prefix.split("/") if p)
        return storage.ObjectRootStore(client, url.rstrip("/"), prefix,
                                       storage.Transfer(part_size=16 << 20, max_concurrency=8))

    storage.register_store("mystore", open_root)
    # CheckpointManager("mystore://bucket/run"), safeckpt.load, the CLI: all take it now

An installed package can register its scheme without being imported, through the
``safeckpt.stores`` entry-point group (``mystore = mypackage.store:open_root``).
``tests/test_conformance.py`` is the suite a store must pass.
"""

from __future__ import annotations

from ._objstore.client import (
    Got,
    Head,
    NotFound,
    ObjectClient,
    ObjectStoreError,
    PreconditionFailed,
    Unreachable,
)
from ._objstore.store import ObjectRootStore, Transfer
from ._store.base import Entry, Lock, Store
from ._store.registry import ENTRY_POINTS
from ._store.registry import register as register_store

__all__ = [
    "ENTRY_POINTS",
    "Entry",
    "Got",
    "Head",
    "Lock",
    "NotFound",
    "ObjectClient",
    "ObjectRootStore",
    "ObjectStoreError",
    "PreconditionFailed",
    "Store",
    "Transfer",
    "Unreachable",
    "register_store",
]
