"""Whether a server honours the conditional writes a writer relies on: checked, not assumed.

The commit object, ``latest`` and the lease rest on create-only writes (S3's
``If-None-Match: *``) and replace-if-unchanged ones (``If-Match``, a GCS generation
match). Some S3-compatible servers ignore them
and overwrite (older or degraded MinIO, s3rver, a Ceph gateway with the check
inverted), or refuse them as not implemented (Backblaze B2). On such a server two
writers could both hold the lease and a stale ``latest`` could undo a newer one,
silently. So a writer probes once per process and root before its first write
(the first time it takes the lease) and refuses a server that fails, with a
:class:`ConfigError` naming the check and the server. Readers write nothing and
need no probe.

The probe writes one object under the root's own prefix (credentials are often
limited to it), with a name no other writer uses, and deletes it; it runs before
the lease is taken, so on a refused server nothing else is ever written. A probe
cut short by a kill leaves its object, which ``safeckpt gc`` collects.
"""

from __future__ import annotations

import contextlib
import threading
import uuid

from ..errors import ConfigError
from .client import NotFound, ObjectClient, ObjectStoreError, PreconditionFailed

PROBE_PREFIX = ".probe-"

_checked: set[tuple[str, str, str]] = set()  # (endpoint, bucket, prefix) found to honour both
_guard = threading.Lock()


def check_conditional_writes(client: ObjectClient, prefix: str, url: str) -> None:
    """Raise :class:`ConfigError` unless the server refuses both conflicting conditional writes
    (and accepts the matching one). Once per process and root; ``OSError`` if it cannot be asked."""
    where = (client.endpoint, client.bucket, prefix)
    with _guard:
        if where in _checked:
            return
    problem = _probe(client, f"{prefix}{PROBE_PREFIX}{uuid.uuid4().hex}")
    if problem is not None:
        raise ConfigError(
            f"{url}: the server at {client.endpoint} {problem}. safeckpt commits a checkpoint, moves "
            "`latest` and holds its lock with conditional writes; on a server that does not honour "
            "them, two writers could both win and a stale write could undo a newer one, so it is "
            "not written to. Use a server that honours them (AWS S3, a current MinIO or Ceph RGW; "
            "Google Cloud Storage or fake-gcs-server; Azure Blob Storage or Azurite), or open the "
            "root with read_only=True to only read.",
            path=url,
        )
    with _guard:
        _checked.add(where)


def another_token(token: str) -> str:
    """A token of the same form as ``token`` (an ETag, a generation) that is surely not it: its
    last letter or digit changed, so a service that parses tokens takes it and finds no match."""
    for i in range(len(token) - 1, -1, -1):
        if token[i].isalnum():
            return token[:i] + ("1" if token[i] == "0" else "0") + token[i + 1 :]
    return token + "0"


def _probe(client: ObjectClient, key: str) -> str | None:
    """What the server got wrong (a phrase), or None."""
    try:
        etag = client.put(key, b"first")
        try:
            client.put(key, b"second", create_only=True)
            return "ignores If-None-Match: * (a create-only PUT over an existing object succeeded)"
        except PreconditionFailed:
            pass
        except ObjectStoreError as e:
            if e.status in (400, 501):
                return f"does not implement If-None-Match on PUT ({e.code}, {e.status})"
            raise
        wrong = another_token(etag)
        try:
            client.put(key, b"third", replacing=wrong)
            return "ignores If-Match (a PUT on a wrong ETag or generation succeeded)"
        except PreconditionFailed:
            pass
        except ObjectStoreError as e:
            if e.status in (400, 501):
                return f"does not implement If-Match on PUT ({e.code}, {e.status})"
            raise
        try:
            client.put(key, b"fourth", replacing=etag)
        except PreconditionFailed:
            return "refuses If-Match on the object's own ETag (its check is inverted)"
        return None
    finally:
        with contextlib.suppress(NotFound, OSError):
            client.delete(key)  # our own key: nobody else writes it
