"""The root's lock on S3: a lease object taken and renewed with conditional writes.

Taking it is ``PUT .lock`` with ``If-None-Match: *``; a holder renews it with
``If-Match`` on its own ETag every third of the lease, so a process that dies
holding it frees the root within one lease, never forever. A lease found
expired (by the server's clock: the object's ``Last-Modified`` against the
``Date`` of the reply) is taken over with ``If-Match`` on the ETag read, so
two processes that both find it expired cannot both win. A holder that could
not renew in time has lost the lock: from the moment its lease may have run
out (by its own clock, with a margin), every write its store makes under the
lock raises :class:`LockTimeoutError` instead (:func:`check_held`), until a
renewal succeeds again; a lease taken over is lost for good.

Within one process the lock is reentrant per thread and excludes the other
threads, as the local sidecar lock does.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from types import TracebackType

from ..errors import LockTimeoutError
from .client import Client, NotFound, PreconditionFailed

logger = logging.getLogger(__name__)

LEASE_SECONDS = 30.0


class _Lease:
    """The state of one root's lease in this process, shared by every handle on it."""

    def __init__(self, client: Client, key: str, url: str, lease: float) -> None:
        self.client = client
        self.key = key
        self.url = url
        self.lease = lease
        self.thread_lock = threading.Lock()
        self.owner: int | None = None
        self.depth = 0
        self.etag: str | None = None
        self.token = uuid.uuid4().hex
        self.renewer: threading.Thread | None = None
        self.stop = threading.Event()
        self.valid_until = 0.0  # monotonic: the lease may run out after this (the last PUT's start + lease)
        self.lost = False  # taken over by another process while held


_leases: dict[tuple[str, str], _Lease] = {}
_leases_guard = threading.Lock()


# An object's age is the server's Date less its Last-Modified, both in whole seconds: it can read
# up to a second more than it is, so a takeover waits that much longer than the lease. Otherwise
# it could come before the holder's own clock says its lease ran out, and both would write.
_DATE_RESOLUTION = 1.0


def check_held(client: Client, key: str) -> None:
    """Before a write under the lease of ``key``: raise :class:`LockTimeoutError` if this thread
    holds it but it may have run out (renewals failed for too long) or was taken over. A thread
    that does not hold it is not checked (reads, and writes that need no lock)."""
    with _leases_guard:
        state = _leases.get((client.endpoint, client.bucket, key))
    if state is None or state.owner != threading.get_ident() or state.depth == 0:
        return
    margin = state.lease / 6  # a write checked now has this long to land before the lease may end
    if state.lost or time.monotonic() > state.valid_until - margin:
        why = "another process took it over" if state.lost else "its renewals have failed for too long"
        raise LockTimeoutError(
            f"lost the lock of {state.url} while holding it ({why}): nothing more is written under "
            "it. What was committed before is untouched; this write is not made. Check the storage's "
            "reachability, then save again (a new save takes the lock anew).",
            path=state.url,
        )


def _shared(client: Client, key: str, url: str, lease: float) -> _Lease:
    where = (client.endpoint, client.bucket, key)
    with _leases_guard:
        found = _leases.get(where)
        if found is None:
            found = _leases[where] = _Lease(client, key, url, lease)
        return found


class LeaseLock:
    """The lock of one S3 root (see the module docstring); a reentrant context manager."""

    def __init__(
        self, client: Client, key: str, *, url: str, timeout: float, lease: float | None = None
    ) -> None:
        # LEASE_SECONDS read at each call: a test's dying process shortens the wait of its successor
        self._state = _shared(client, key, url, LEASE_SECONDS if lease is None else lease)
        self.path = url
        self.timeout = timeout

    def held(self) -> bool:
        state = self._state
        return state.owner == threading.get_ident() and state.depth > 0

    def acquire(self) -> None:
        state = self._state
        if self.held():
            state.depth += 1
            return
        deadline = time.monotonic() + self.timeout
        if not state.thread_lock.acquire(timeout=self.timeout):
            raise self._timeout_error()
        try:
            self._take(deadline)
        except BaseException:
            state.thread_lock.release()
            raise
        state.owner = threading.get_ident()
        state.depth = 1
        state.stop.clear()
        state.renewer = threading.Thread(target=self._renew, name="safeckpt-s3-lease", daemon=True)
        state.renewer.start()

    def release(self) -> None:
        state = self._state
        if not self.held():
            raise RuntimeError("LeaseLock released by a thread that does not hold it")
        state.depth -= 1
        if state.depth:
            return
        state.stop.set()
        if state.renewer is not None:
            state.renewer.join()
            state.renewer = None
        try:
            if state.etag is not None:
                state.client.delete(state.key, if_match=state.etag)  # never another holder's lease
        except OSError as e:  # it expires by itself within one lease
            logger.warning(
                "safeckpt: could not release the lock %s (%s); it expires in %g s", self.path, e, state.lease
            )
        finally:
            state.etag = None
            state.owner = None
            state.thread_lock.release()

    def close(self) -> None:
        pass  # nothing is held open between acquisitions

    def _body(self) -> bytes:
        state = self._state
        return json.dumps(
            {"token": state.token, "pid": os.getpid(), "host": socket.gethostname(), "lease": state.lease}
        ).encode()

    def _take(self, deadline: float) -> None:
        state = self._state
        delay = 0.05
        while True:
            started = time.monotonic()
            try:
                state.etag = state.client.put_new(state.key, self._body())
                state.valid_until, state.lost = started + state.lease, False
                return
            except PreconditionFailed:
                pass
            if self._take_over_expired():
                return
            if time.monotonic() >= deadline:
                raise self._timeout_error()
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 1.0)

    def _take_over_expired(self) -> bool:
        state = self._state
        try:
            got = state.client.get(state.key)
        except NotFound:
            return False  # released meanwhile: the next PUT takes it
        try:
            lease = float(json.loads(got.data).get("lease", state.lease))
        except (ValueError, AttributeError):
            lease = state.lease
        if got.age <= lease + _DATE_RESOLUTION:
            return False
        started = time.monotonic()
        try:
            state.etag = state.client.put_over(state.key, self._body(), got.etag)
        except (PreconditionFailed, NotFound):
            return False  # someone else took it over first, or it was released: the next PUT takes it
        state.valid_until, state.lost = started + state.lease, False
        logger.warning("safeckpt: took over the lock %s, which its holder let expire", self.path)
        return True

    def _renew(self) -> None:
        state = self._state
        while not state.stop.wait(state.lease / 3):
            started = time.monotonic()
            try:
                assert state.etag is not None
                state.etag = state.client.put_over(state.key, self._body(), state.etag)
                state.valid_until = started + state.lease
            except (PreconditionFailed, NotFound):
                state.lost = True
                logger.error("safeckpt: the lock %s was taken over while held (a lease ran out)", self.path)
                return
            except OSError as e:
                logger.warning("safeckpt: could not renew the lock %s (%s); retrying", self.path, e)

    def _timeout_error(self) -> LockTimeoutError:
        return LockTimeoutError(
            f"could not take the lock of {self.path} within {self.timeout:g} s: another process (a "
            "training job or a `safeckpt` command) holds it. Wait for it to finish, or raise "
            "lock_timeout if it is expected to hold it this long. A lock whose holder died frees "
            f"itself within {self._state.lease:g} s.",
            path=self.path,
        )

    def __enter__(self) -> LeaseLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
