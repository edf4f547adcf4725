"""Requests of an object store's REST API over urllib3, each within a deadline, errors as the
client protocol's (for clients that speak HTTP themselves: GCS, Azure Blob).

One :class:`Http` per client: a pool of keep-alive connections, a request retried
on 5xx, 429 and dropped or timed-out connections with backoff until its attempts
or its deadline run out, and a service that stops answering marked down for every
request (:mod:`safeckpt._util.reachability`). A reply that answers is returned
as it is (status, headers, body); the client says what its status means.
urllib3 is imported on the first request (it comes with the ``gcs`` and ``azure``
extras), never by ``import safeckpt``.
"""

from __future__ import annotations

import datetime
import errno
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

from .._util.reachability import Outcome, Reachability, call_with_deadline
from .client import NotFound, ObjectStoreError, Unreachable

_PROBE_TIMEOUT = 2.0


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]
    """Lowercase names."""
    body: bytes


class _Failing(Exception):
    """A reply worth another try (5xx, 429), raised inside an attempt."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.status)
        self.reply = reply


@dataclass(frozen=True)
class Limits:
    max_attempts: int
    timeout: float
    connect_timeout: float
    read_timeout: float
    connections: int


class Http:
    """The requests of one service endpoint (thread-safe: urllib3's pools are)."""

    def __init__(self, endpoint: str, limits: Limits, *, explain_code: Callable[[Reply], str]) -> None:
        import urllib3

        self.endpoint = endpoint.rstrip("/")
        self.limits = limits
        self.reach = Reachability()
        self._code = explain_code
        timeout = urllib3.Timeout(connect=limits.connect_timeout, read=limits.read_timeout)
        self._pool = urllib3.PoolManager(maxsize=limits.connections, timeout=timeout, retries=False)
        short = urllib3.Timeout(
            connect=min(_PROBE_TIMEOUT, limits.connect_timeout), read=min(_PROBE_TIMEOUT, limits.read_timeout)
        )
        self._probe_timeout = short

    def request(
        self,
        method: str,
        url: str,
        key: str,
        *,
        body: bytes | memoryview = b"",
        headers: Mapping[str, str] | None = None,
        sign: Callable[[str, str, dict[str, str]], dict[str, str]] | None = None,
        again: Callable[[], None] | None = None,
    ) -> Reply:
        """``method`` on ``url`` (the whole URL), retried within the deadline; a 5xx or 429 that
        lasts, or silence, is :class:`Unreachable`. ``sign`` adds credentials to each attempt's
        headers (a token may be refreshed between attempts); ``again`` runs before each retry."""
        first = [True]

        def attempt() -> Reply:
            if not first[0] and again is not None:
                again()
            first[0] = False
            sent = dict(headers or {})
            if body:
                sent["Content-Length"] = str(len(body))  # signed (Azure's Shared Key), so set here
            if sign is not None:
                sent = sign(method, url, sent)
            raw = self._pool.request(method, url, body=bytes(body) if body else None, headers=sent)
            reply = Reply(raw.status, {k.lower(): v for k, v in raw.headers.items()}, raw.data)
            if (reply.status >= 500 and reply.status != 501) or reply.status in (408, 429):
                raise _Failing(reply)
            return reply

        def unreachable(error: BaseException, down: float) -> Unreachable:
            if isinstance(error, _Failing):
                code = self._code(error.reply)
                how = f"kept failing ({code}, {error.reply.status})"
            else:
                how = f"does not answer ({type(error).__name__})"
            return Unreachable("Unreachable", 0, f"{self.endpoint} {how}, for {down:.0f} s so far", key)

        return call_with_deadline(
            attempt,
            _classify,
            self.reach,
            attempts=self.limits.max_attempts,
            deadline=self.limits.timeout,
            unreachable=unreachable,
            probe=self._probe,
        )

    def _probe(self) -> None:
        """Any reply, even a refusal, shows the service answers."""
        self._pool.request("HEAD", self.endpoint + "/", timeout=self._probe_timeout)

    def ok(self, reply: Reply, key: str) -> Reply:
        """``reply`` if it is a success (2xx), else its :meth:`refusal` raised."""
        if 200 <= reply.status < 300:
            return reply
        raise self.refusal(reply, key)

    def refusal(self, reply: Reply, key: str) -> OSError:
        """What a reply that refused means: :class:`NotFound` for 404, else the service's code."""
        code = self._code(reply)
        message = reply.body[:300].decode("utf-8", "replace").strip()
        if reply.status == 404 and "bucket" not in code.lower() and "container" not in code.lower():
            return NotFound(errno.ENOENT, "no such object", key)
        return ObjectStoreError(code or "Error", reply.status, message, key)


def _classify(error: BaseException) -> Outcome:
    if isinstance(error, _Failing):
        return Outcome.RETRY
    import urllib3.exceptions

    if isinstance(error, (urllib3.exceptions.HTTPError, OSError)):
        return Outcome.SILENT  # refused, reset, timed out, a body cut short
    return Outcome.DONE


def age(last_modified: str | None, date: str | None) -> float | None:
    """Seconds between ``Last-Modified`` and the reply's ``Date`` (both the server's clock); None
    where either cannot be read."""
    try:
        then = parsedate_to_datetime(last_modified or "")
        now = parsedate_to_datetime(date or "")
    except (TypeError, ValueError, IndexError):
        return None
    if then is None or now is None:
        return None
    utc = datetime.timezone.utc
    then = then if then.tzinfo else then.replace(tzinfo=utc)
    now = now if now.tzinfo else now.replace(tzinfo=utc)
    return max(0.0, (now - then).total_seconds())


def content_size(reply: Reply) -> int:
    """The whole object's size from a (ranged) GET's reply."""
    whole = reply.headers.get("content-range", "").rpartition("/")[2]
    if whole.isdigit():
        return int(whole)
    return int(reply.headers.get("content-length", len(reply.body)))


def positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


def check_limits(limits: Limits, scheme: str) -> None:
    from ..errors import ConfigError

    if (
        not isinstance(limits.max_attempts, int)
        or isinstance(limits.max_attempts, bool)
        or limits.max_attempts < 1
    ):
        raise ConfigError(
            f"storage_options['max_attempts'] of a {scheme}:// root must be a positive int, got "
            f"{limits.max_attempts!r}."
        )
    for name in ("timeout", "connect_timeout", "read_timeout"):
        if not positive(getattr(limits, name)):
            raise ConfigError(
                f"storage_options[{name!r}] of a {scheme}:// root must be a positive number of seconds, "
                f"got {getattr(limits, name)!r}."
            )
