"""The small protocol an object store's client implements, and the errors it raises.

Everything a checkpoint root needs from an object store (S3, GCS, Azure Blob, an
in-memory one for tests) is here: whole-object PUTs that can be conditional on a
*token* (an ETag, a generation: whatever the service compares), GETs of a range,
listings, deletions, and multipart (or block) uploads. :mod:`.store` builds the
root on it once, for every service: the commit object, ``latest``, the lease,
leftovers and verified reads.

Call rules: thread-safe; every call ends within the client's own deadline; what goes
wrong is one of the errors below (an ``OSError``, so the layers above handle them as
they handle a filesystem's):

* :class:`NotFound` (a ``FileNotFoundError``): no such object, bucket or upload;
* :class:`PreconditionFailed`: a conditional write lost (the object exists, or its
  token changed);
* :class:`Unreachable` (a ``ConnectionError``): the service did not answer, or kept
  failing, within the deadline: not available now, never a sign of damage;
* :class:`ObjectStoreError`: any other refusal, with the service's code and status.
"""

from __future__ import annotations

import builtins
import errno
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class NotFound(FileNotFoundError):
    """No object (or no bucket, or no upload) at that key."""


class PreconditionFailed(OSError):
    """A conditional write lost: the object exists (create only) or changed (its token differs)."""

    def __init__(self, key: str) -> None:
        super().__init__(errno.EEXIST, "the object exists or changed since it was read", key)
        self.key = key

    def __reduce__(self) -> tuple[object, ...]:  # errors cross ranks pickled
        return (PreconditionFailed, (self.key,))


class ObjectStoreError(OSError):
    """Any other refusal, with the service's error code (``AccessDenied``, ``SlowDown``, ...) and
    HTTP status (0 where no reply came)."""

    def __init__(self, code: str, status: int, message: str, key: str) -> None:
        number = errno.EACCES if status in (401, 403) else errno.EIO
        super().__init__(number, f"{code} ({status}): {message}", key)
        self.code = code
        self.status = status
        self._args = (code, status, message, key)

    def __reduce__(self) -> tuple[object, ...]:  # errors cross ranks pickled
        return (type(self), self._args)


class Unreachable(ObjectStoreError, ConnectionError):
    """The service is not available: nothing answered (refused, reset, timed out) or it kept
    failing (5xx, throttling) until the deadline, or not tried while it is known to be down. A
    ``ConnectionError``, so the core tells it from a refusal and never from damage."""

    def __init__(self, code: str, status: int, message: str, key: str) -> None:
        super().__init__(code, status, message, key)
        self.errno = errno.EHOSTUNREACH
        self.strerror = message  # the message says it all: no code or status of a reply to show


@dataclass(frozen=True)
class Head:
    size: int
    token: str
    """What a conditional write compares: the ETag, or the generation."""
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Got:
    data: bytes
    token: str
    size: int
    """The whole object's size (a ranged GET returns part of it)."""
    metadata: Mapping[str, str] = field(default_factory=dict)
    age: float | None = 0.0
    """Seconds since it was written, by the service's clock (its reply's date against the object's
    time); None where the service's dates cannot be read."""


class ObjectClient(Protocol):
    """One bucket (or container) of one service (see the module docstring for the call rules).

    ``metadata`` is the object's user metadata (small ``str`` to ``str``), stored and returned as
    given. Every write sends the data's checksum where the service checks one, so a body
    corrupted on the way is refused there.
    """

    endpoint: str
    """Where the service is, for messages."""
    bucket: str

    def put(
        self,
        key: str,
        data: bytes,
        *,
        create_only: bool = False,
        replacing: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> str:
        """Write ``data`` at ``key`` whole; its new token. ``create_only``: only if nothing is
        there; ``replacing``: only if the object there still has this token. Either failing is
        :class:`PreconditionFailed`."""
        ...

    def get(self, key: str, *, start: int | None = None, length: int | None = None) -> Got: ...

    def head(self, key: str) -> Head: ...

    def delete(self, key: str) -> None:
        """Delete ``key`` (gone already: no error)."""
        ...

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete every key, in as few requests as the service allows; a key it failed to
        delete raises."""
        ...

    def list(
        self, prefix: str, *, delimiter: str | None = "/", limit: int | None = None
    ) -> tuple[list[tuple[str, int]], list[str]]:
        """Objects ``(key, size)`` and sub-prefixes under ``prefix`` (everything below it when
        ``delimiter`` is None); only the first page of at most ``limit``, when given."""
        ...

    # --- uploads in parts: a large object appears whole when its upload finishes ------------------

    def start_upload(self, key: str) -> str:
        """A new upload to ``key``; its id."""
        ...

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | memoryview) -> Any:
        """Part ``number`` (from 1); what :meth:`finish_upload` needs of it."""
        ...

    # builtins.list: below the method list(), the name `list` in this class is that method
    def finish_upload(self, key: str, upload_id: str, parts: builtins.list[Any]) -> str:
        """The object appears, whole; its token."""
        ...

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Abandon it (finished or abandoned already: no error)."""
        ...

    def uploads(self, prefix: str) -> builtins.list[tuple[str, str]]:
        """Unfinished uploads under ``prefix``: ``(key, upload id)`` (none where the service cannot
        list them: say so once)."""
        ...

    def upload_size(self, key: str, upload_id: str) -> int:
        """Bytes in the parts of an unfinished upload (0 once it is gone)."""
        ...

    def explain(self, error: OSError) -> tuple[str, str]:
        """What ``error`` (raised by this client) means in words, and what to do about it."""
        ...


def put_new(client: ObjectClient, key: str, data: bytes, *, metadata: Mapping[str, str] | None = None) -> str:
    """PUT only if nothing is at ``key``; :class:`PreconditionFailed` if something else is. Our own
    earlier attempt, applied before a retry the client made, counts as success."""
    try:
        return client.put(key, data, create_only=True, metadata=metadata)
    except PreconditionFailed:
        return _ours_or_raise(client, key, data, metadata)


def put_over(
    client: ObjectClient, key: str, data: bytes, token: str, *, metadata: Mapping[str, str] | None = None
) -> str:
    """PUT only if ``key`` still has ``token``, with the same rule for a retried request."""
    try:
        return client.put(key, data, replacing=token, metadata=metadata)
    except PreconditionFailed:
        return _ours_or_raise(client, key, data, metadata)


def _ours_or_raise(client: ObjectClient, key: str, data: bytes, metadata: Mapping[str, str] | None) -> str:
    try:
        there = client.get(key)
    except NotFound:
        raise PreconditionFailed(key) from None
    if there.data == data and dict(there.metadata) == dict(metadata or {}):
        return there.token
    raise PreconditionFailed(key)
