"""The storage seam's S3 implementation: a root under an ``s3://bucket/prefix`` URL.

Importing it registers the ``s3`` scheme (:func:`safeckpt._store.open_store`);
the client library (boto3) is imported only when an ``s3://`` root is opened.
Nothing above the seam knows a root is on S3: another object store (``gs://``,
``az://``) registers its own scheme beside this one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._store.registry import register


def _open(root: str, *, ops: Any = None, options: Mapping[str, Any] | None = None) -> Any:
    from .store import S3Store

    return S3Store(root, ops=ops, options=options)


register("s3", _open)
