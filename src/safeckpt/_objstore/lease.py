"""The root's lock on an object store: a lease object taken and renewed with conditional writes.

Taking it is a create-only PUT of ``.lock`` (or one replacing the token, an
ETag or generation, of a released lease); a holder renews it by replacing its
own token every third of the lease, so a process that dies holding it frees
the root within one lease, never forever. Releasing it is a conditional PUT of
a *released* body (a conditional DELETE is not implemented by every
S3-compatible server, and a plain DELETE could remove another holder's lease).
A lease is free when it is released, when its holder ran on this machine and
its process is gone, or when it has expired: by the server's clock (the
object's time against the reply's, both the server's; no client clock is
compared), or, where the server's dates cannot be read, by the taker's own
monotonic clock (the same token seen for longer than the lease). It is taken by
replacing the token read, so two processes that both find it free cannot both
win. A holder that could
not renew in time has lost the lock: from the moment its lease may have run
out (by its own clock, with a margin), every write its store makes under the
lock raises :class:`LockTimeoutError` instead (:func:`check_held`), until a
renewal succeeds again; a lease taken over is lost for good.

Within one process the lock is reentrant per thread and excludes the other
threads, as the local sidecar lock does. The first time a process takes it, it
checks that the server honours conditional writes (:mod:`.conditions`), and
refuses the root if it does not.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
import uuid
from types import TracebackType

from .._util.failure_log import FailureLog
from .._util.processes import machine, pid_alive, process_start
from ..errors import LockTimeoutError
from .client import NotFound, ObjectClient, PreconditionFailed, put_new, put_over
from .conditions import check_conditional_writes

logger = logging.getLogger(__name__)

LEASE_SECONDS = 20.0


class _Lease:
    """The state of one root's lease in this process, shared by every handle on it."""

    def __init__(self, client: ObjectClient, key: str, url: str, lease: float) -> None:
        self.client = client
        self.key = key
        self.url = url
        self.lease = lease
        self.thread_lock = threading.Lock()
        self.owner: int | None = None
        self.depth = 0
        self.version: str | None = None  # our lease object's token (ETag, generation) as last written
        self.token = uuid.uuid4().hex
        self.renewer: threading.Thread | None = None
        self.stop = threading.Event()
        self.valid_until = 0.0  # monotonic: the lease may run out after this (the last PUT's start + lease)
        self.lost = False  # taken over by another process while held
        self.released: str | None = None  # the token of our own released body, to take it back at once
        self.seen: tuple[str, float] | None = None  # a holder's ETag and when this process first saw it
        self.checked = False  # the server was found to honour conditional writes (.conditions)
        self.writes = 0
        self.said = FailureLog(logger, f"the lock {url}")


_leases: dict[tuple[str, str, str], _Lease] = {}  # by endpoint, bucket and key
_leases_guard = threading.Lock()


# An object's age is the server's Date less its Last-Modified, both in whole seconds: it can read
# up to a second more than it is, so a takeover waits that much longer than the lease. Otherwise
# it could come before the holder's own clock says its lease ran out, and both would write.
_DATE_RESOLUTION = 1.0


def check_held(client: ObjectClient, key: str) -> None:
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


def _shared(client: ObjectClient, key: str, url: str, lease: float) -> _Lease:
    where = (client.endpoint, client.bucket, key)
    with _leases_guard:
        found = _leases.get(where)
        if found is None:
            found = _leases[where] = _Lease(client, key, url, lease)
        return found


def _free(body: dict[str, object], age: float | None, lease: float, seen_for: float) -> str | None:
    """Why a lease with ``body`` is free to take (its holder released it, died, or let it expire),
    or None while it holds. ``age``: by the server's clock, None where its dates are unusable."""
    if body.get("released"):
        return "released"
    host, boot, namespace = machine()
    if (body.get("host"), body.get("boot_id"), body.get("pid_ns")) == (host, boot, namespace) and boot:
        pid, start = body.get("pid"), body.get("pid_start")
        reused = start is not None and process_start(pid) != start if isinstance(pid, int) else False
        if isinstance(pid, int) and (not pid_alive(pid) or reused):
            return f"(pid {pid}, this machine) is gone"
    if age is not None:
        return "let it expire" if age > lease + _DATE_RESOLUTION else None
    if seen_for > lease + _DATE_RESOLUTION:  # by our own clock: the server's dates told nothing
        return "let it expire (unchanged for longer than the lease)"
    return None


class LeaseLock:
    """The lock of one root on an object store (see the module docstring); a reentrant context manager."""

    def __init__(
        self, client: ObjectClient, key: str, *, url: str, timeout: float, lease: float | None = None
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
            if not state.checked:  # before the lease itself: on a server that ignores conditions,
                # nothing but the probe (removed again) is ever written
                prefix = state.key[: len(state.key) - len(state.key.rsplit("/", 1)[-1])]
                check_conditional_writes(state.client, prefix, state.url.rsplit("/", 1)[0])
                state.checked = True
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
            if state.version is not None and not state.lost:  # never another holder's lease
                state.released = put_over(state.client, state.key, self._body(released=True), state.version)
        except OSError as e:  # it expires by itself within one lease
            logger.warning(
                "safeckpt: could not release the lock %s (%s); it expires in %g s", self.path, e, state.lease
            )
        finally:
            state.version = None
            state.owner = None
            state.thread_lock.release()

    def close(self) -> None:
        pass  # nothing is held open between acquisitions

    def _body(self, *, released: bool = False) -> bytes:
        state = self._state
        pid = os.getpid()
        host, boot, namespace = machine()
        state.writes += 1  # each write of the lease a new body, so a new ETag: a renewal is seen
        body = {
            "token": state.token,
            "write": state.writes,
            "pid": pid,
            "pid_start": process_start(pid),
            "host": host,
            "boot_id": boot,
            "pid_ns": namespace,
            "lease": state.lease,
        }
        if released:
            body["released"] = True
        return json.dumps(body).encode()

    def _take(self, deadline: float) -> None:
        state = self._state
        state.seen = None  # a holder is watched afresh at each taking
        delay = 0.05
        while True:
            started = time.monotonic()
            try:
                if state.released is not None:  # ours, released: take it back in one request
                    state.version = put_over(state.client, state.key, self._body(), state.released)
                else:
                    state.version = put_new(state.client, state.key, self._body())
                state.valid_until, state.lost = started + state.lease, False
                return
            except (PreconditionFailed, NotFound):
                state.released = None
            if self._take_over_free():
                return
            if time.monotonic() >= deadline:
                raise self._timeout_error()
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 1.0)

    def _take_over_free(self) -> bool:
        """Take the lease if it is free (see the module docstring); whether this process has it."""
        state = self._state
        try:
            got = state.client.get(state.key)
        except NotFound:
            return False  # released meanwhile: the next PUT takes it
        try:
            body = json.loads(got.data)
            lease = float(body.get("lease", state.lease))
        except (ValueError, AttributeError, TypeError):
            body, lease = {}, state.lease
        why = _free(body, got.age, lease, self._seen_for(got.token))
        if why is None:
            return False
        started = time.monotonic()
        try:
            state.version = put_over(state.client, state.key, self._body(), got.token)
        except (PreconditionFailed, NotFound):
            return False  # someone else took it first, or it was removed: the next PUT takes it
        state.valid_until, state.lost, state.seen = started + state.lease, False, None
        if why != "released":
            logger.warning("safeckpt: took over the lock %s, whose holder %s", self.path, why)
        return True

    def _seen_for(self, etag: str) -> float:
        """How long this process has seen the lease with ``etag``, by its own monotonic clock."""
        state, now = self._state, time.monotonic()
        if state.seen is None or state.seen[0] != etag:
            state.seen = (etag, now)
        return now - state.seen[1]

    def _renew(self) -> None:
        state = self._state
        while not state.stop.wait(state.lease / 3):
            started = time.monotonic()
            try:
                assert state.version is not None
                state.version = put_over(state.client, state.key, self._body(), state.version)
                state.valid_until = started + state.lease
            except (PreconditionFailed, NotFound):
                state.lost = True
                logger.error("safeckpt: the lock %s was taken over while held (a lease ran out)", self.path)
                return
            except OSError as e:  # said once per kind, while it keeps failing
                state.said.failed(type(e).__name__, "could not renew it (%s); retrying", e)
            else:
                state.said.worked()

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
