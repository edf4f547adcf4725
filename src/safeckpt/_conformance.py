"""The storage seam's implementations, checked against its protocols by the type checker.

``make test`` runs mypy over ``src/``; each function below returns an implementation as
the protocol it implements, so a method whose parameters or result drift from the
protocol's (a keyword added on one side only, a changed return type) fails the check.
The protocols are :class:`~safeckpt._store.base.Store` (with the handles and lock its
methods return) and :class:`~safeckpt._objstore.client.ObjectClient` (S3's, GCS's and
Azure's clients). Nothing calls these functions, and nothing imports this module at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._azure.client import AzureClient
    from ._gcs.client import GcsClient
    from ._objstore.client import ObjectClient
    from ._objstore.store import ObjectRootStore
    from ._posix.store import PosixStore
    from ._s3.client import S3Client
    from ._store.base import Store


def posix_store(store: PosixStore) -> Store:
    return store


def object_root_store(store: ObjectRootStore) -> Store:
    return store


def s3_client(client: S3Client) -> ObjectClient:
    return client


def gcs_client(client: GcsClient) -> ObjectClient:
    return client


def azure_client(client: AzureClient) -> ObjectClient:
    return client
