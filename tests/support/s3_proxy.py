"""A fault-injecting HTTP proxy in front of the test S3 server (pytest plugin).

Real S3 answers ``503 SlowDown``, drops connections in the middle of an upload part or of a GET
body, and is sometimes slow. moto does none of that, so this proxy sits between the client and
moto on 127.0.0.1 and does it on request, for the next *n* matching requests:

* ``fail_next``: answer with an S3 XML error (503 ``SlowDown`` by default) without forwarding;
* ``reset_next``: read part of the request body, then reset the connection (RST, not FIN);
* ``reset_response_next``: forward, then cut the response body midway with a reset;
* ``delay_next``: sleep, then forward;
* ``corrupt_next``: flip one byte of the request body, then forward (moto does not check
  ``x-amz-checksum-crc32``; real S3 refuses such a body with 400 ``BadDigest``).

And for every request until told otherwise:

* ``go_down(how)`` plays an outage: ``"refuse"`` closes the port (connection refused),
  ``"drop"`` resets each connection as it comes, ``"hang"`` accepts and never answers (a
  black-holed route); ``come_back()`` ends it, on the same port;
* ``edit_responses(fn)``: ``fn(headers)`` rewrites the headers of every answer (a server whose
  ``Date`` is duplicated or malformed);
* ``strip_conditions()``: drops ``If-None-Match`` and ``If-Match`` from every request before it
  goes upstream, as a server that ignores them would (every conditional write then succeeds);
  ``strip_headers(names)`` drops the headers named.

Everything the proxy sees is recorded in ``requests`` (:class:`Seen`), with whether the body that
went upstream matches its ``x-amz-checksum-crc32`` header, so tests can assert that every data
upload carried a correct CRC32.

The client's request goes upstream byte for byte where it matters: the same method, path and
query, and the same headers, ``Host`` included (SigV4 signs it; moto by default checks no
signature, but real S3 would, and the client signed the proxy's host:port). Hop-by-hop headers are dropped
and the body is sent with a ``Content-Length``. Each connection carries one request and is then
closed (``Connection: close``): no keep-alive state to get wrong, and a client that pools
connections just opens a new one.

* ``s3_proxy``: a proxy in front of the session's server, with ``AWS_ENDPOINT_URL`` pointing at it
  for one test (the ``s3_bucket`` fixture's bucket and credentials stay as they are).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import http.server
import socket
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import urlsplit

import pytest

if TYPE_CHECKING:
    from s3_server import S3Bucket

# Headers about one connection, not the request (RFC 9110 7.6.1), and ``Expect``: the proxy has
# answered ``100 Continue`` itself and sends upstream a body it already holds. botocore signs
# none of them (SIGNED_HEADERS_BLACKLIST), so dropping them leaves the signature valid.
_HOP_BY_HOP = frozenset(
    (
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
    )
)
_UPSTREAM_TIMEOUT = 60.0
_CLIENT_TIMEOUT = 60.0  # a client that stops sending mid-body does not hold a thread forever


class Seen(NamedTuple):
    """One request as the proxy saw it."""

    method: str
    path: str
    query: str
    status: int | None
    """What the client was answered; None when the proxy reset the connection before any status."""
    headers: dict[str, str]
    """The client's request headers, names in lower case."""
    checksum_ok: bool | None
    """Whether ``x-amz-checksum-crc32`` matches the body sent upstream (after any corruption);
    None without that header, or when the body was not read in full (a reset)."""
    fault: str | None
    """The rule that hit it: ``fail``, ``reset``, ``reset_response``, ``delay``, ``corrupt``
    (``upstream`` when moto could not be reached, ``down`` during an outage), or None."""


@dataclass
class _Rule:
    kind: str
    remaining: int
    method: str | None
    path_contains: str | None
    query_contains: str | None
    status: int = 503
    code: str = "SlowDown"
    seconds: float = 0.0
    after_bytes: int | None = None

    def matches(self, method: str, path: str, query: str) -> bool:
        return (
            (self.method is None or self.method.upper() == method)
            and (self.path_contains is None or self.path_contains in path)
            and (self.query_contains is None or self.query_contains in query)
        )


def crc32_header(body: bytes) -> str:
    """``x-amz-checksum-crc32`` for ``body``: base64 of the big-endian 4-byte CRC32."""
    return base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()


def _error_body(code: str, message: str, request_id: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message><RequestId>{request_id}</RequestId></Error>"
    ).encode()


def _reset(sock: socket.socket) -> None:
    """Close with an RST, as a crashed server or a dropped route does: SO_LINGER 0 drops what is
    unsent and aborts instead of the orderly FIN a plain close sends."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class S3FaultProxy:
    """A threaded HTTP/1.1 proxy on ``127.0.0.1``, a free port, in front of ``upstream_endpoint``."""

    def __init__(self, upstream_endpoint: str) -> None:
        parts = urlsplit(upstream_endpoint)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.requests: list[Seen] = []
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._count = 0
        self._server = _Server(("127.0.0.1", 0), _make_handler(self))
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread: threading.Thread | None = None
        self.down: str | None = None  # "drop" or "hang" while an outage is played (see go_down)
        self._back = threading.Event()
        self.response_editor: Callable[[list[tuple[str, str]]], list[tuple[str, str]]] | None = None
        self.stripped: tuple[str, ...] = ()  # request headers dropped before they go upstream

    # --- lifetime ---------------------------------------------------------------------------------

    def start(self) -> S3FaultProxy:
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def go_down(self, how: str = "refuse") -> None:
        """An outage, until :meth:`come_back` (see the module docstring)."""
        assert how in ("refuse", "drop", "hang"), how
        self._back.clear()
        if how == "refuse":
            self.stop()  # the port closes: a connect is refused
        self.down = how

    def come_back(self) -> None:
        if self.down == "refuse":
            self._server = _Server(("127.0.0.1", self.port), _make_handler(self))
            self._thread = None
            self.start()
        self.down = None
        self._back.set()  # hung requests end (with a reset: the client has given up on them)

    def edit_responses(self, editor: Callable[[list[tuple[str, str]]], list[tuple[str, str]]] | None) -> None:
        self.response_editor = editor

    def strip_conditions(self, on: bool = True) -> None:
        self.strip_headers(("if-none-match", "if-match") if on else ())

    def strip_headers(self, names: tuple[str, ...]) -> None:
        """Drop these request headers (lower case) before forwarding: a server that ignores them."""
        self.stripped = tuple(n.lower() for n in names)

    def __enter__(self) -> S3FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- fault rules: each hits the next n matching requests, first added first -------------------

    def fail_next(
        self,
        n: int = 1,
        status: int = 503,
        code: str = "SlowDown",
        method: str | None = None,
        path_contains: str | None = None,
        query_contains: str | None = None,
    ) -> None:
        """Answer ``status`` with an S3 error ``code`` (the body is read, nothing is forwarded)."""
        self._add(_Rule("fail", n, method, path_contains, query_contains, status=status, code=code))

    def reset_next(
        self,
        n: int = 1,
        method: str | None = None,
        path_contains: str | None = None,
        query_contains: str | None = None,
        after_bytes: int | None = None,
    ) -> None:
        """Read ``after_bytes`` of the request body (None: half of it), then reset the connection."""
        self._add(_Rule("reset", n, method, path_contains, query_contains, after_bytes=after_bytes))

    def reset_response_next(
        self,
        n: int = 1,
        method: str | None = None,
        path_contains: str | None = None,
        query_contains: str | None = None,
        after_bytes: int | None = None,
    ) -> None:
        """Forward, send the status, headers and ``after_bytes`` of the body (None: half), then reset."""
        self._add(_Rule("reset_response", n, method, path_contains, query_contains, after_bytes=after_bytes))

    def delay_next(
        self,
        n: int = 1,
        seconds: float = 1.0,
        method: str | None = None,
        path_contains: str | None = None,
        query_contains: str | None = None,
    ) -> None:
        """Sleep ``seconds`` after reading the request, then forward it."""
        self._add(_Rule("delay", n, method, path_contains, query_contains, seconds=seconds))

    def corrupt_next(
        self,
        n: int = 1,
        method: str | None = None,
        path_contains: str | None = None,
        query_contains: str | None = None,
    ) -> None:
        """Flip the bits of the body's middle byte, then forward (headers, checksums unchanged)."""
        self._add(_Rule("corrupt", n, method, path_contains, query_contains))

    def clear(self) -> None:
        """Drop every rule not used up yet (the records stay; ``requests.clear()`` drops those)."""
        with self._lock:
            self._rules.clear()

    def pending(self) -> int:
        """How many faults are still to come (0 once every rule has hit)."""
        with self._lock:
            return sum(rule.remaining for rule in self._rules)

    def seen(
        self, method: str | None = None, path_contains: str | None = None, query_contains: str | None = None
    ) -> list[Seen]:
        """The records matching these filters (the same as the rules')."""
        probe = _Rule("", 0, method, path_contains, query_contains)
        with self._lock:
            return [s for s in self.requests if probe.matches(s.method, s.path, s.query)]

    def _add(self, rule: _Rule) -> None:
        if rule.remaining < 1:
            raise ValueError(f"n must be at least 1, not {rule.remaining}")
        with self._lock:
            self._rules.append(rule)

    def _take(self, method: str, path: str, query: str) -> _Rule | None:
        """The first rule that matches, used once (the decision is made as the headers arrive)."""
        with self._lock:
            for rule in self._rules:
                if rule.matches(method, path, query):
                    rule.remaining -= 1
                    if rule.remaining == 0:
                        self._rules.remove(rule)
                    return rule
        return None

    def _record(self, seen: Seen) -> None:
        # Recorded before the client gets its answer: a test that looks right after its call
        # returned finds the request there.
        with self._lock:
            self.requests.append(seen)

    def _request_id(self) -> str:
        with self._lock:
            self._count += 1
            return f"S3FAULTPROXY{self._count:08d}"


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True  # a request stuck in a delay does not hold up stop()

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client gone is no news here
            super().handle_error(request, client_address)


def _make_handler(proxy: S3FaultProxy) -> type[http.server.BaseHTTPRequestHandler]:
    return type("Handler", (_Handler,), {"proxy": proxy})  # the server makes one handler per request


class _Handler(http.server.BaseHTTPRequestHandler):
    # HTTP/1.1: BaseHTTPRequestHandler then answers "Expect: 100-continue" with "100 Continue" by
    # itself (handle_expect_100), so botocore sends the body at once instead of waiting for it.
    protocol_version = "HTTP/1.1"
    timeout = _CLIENT_TIMEOUT
    proxy: S3FaultProxy

    def log_message(self, format: str, *args: object) -> None:
        pass  # the records are the log

    def do_GET(self) -> None:
        self._proxy()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    # --- one request --------------------------------------------------------------------------------

    def _proxy(self) -> None:
        self.close_connection = True  # one request per connection: see the module's docstring
        parts = urlsplit(self.path)
        if self.proxy.down is not None:  # recorded: how many requests an outage costs is a test's
            seen = Seen(self.command, parts.path, parts.query, None, {}, None, "down")
            self.proxy._record(seen)
            if self.proxy.down == "hang":
                self.proxy._back.wait(_CLIENT_TIMEOUT)
            self._abort()
            return
        method, path, query = self.command, parts.path, parts.query
        headers = {k.lower(): v for k, v in self.headers.items()}
        rule = self.proxy._take(method, path, query)
        kind = rule.kind if rule else None

        def record(status: int | None, body: bytes | None, fault: str | None = kind) -> None:
            expected = headers.get("x-amz-checksum-crc32")
            ok = None if expected is None or body is None else crc32_header(body) == expected
            self.proxy._record(Seen(method, path, query, status, headers, ok, fault))

        if rule is not None and rule.kind == "reset":
            length = int(headers.get("content-length", 0) or 0)
            want = length // 2 if rule.after_bytes is None else min(rule.after_bytes, length)
            self._read_exactly(want)
            record(None, None)
            self._abort()
            return

        body = self._read_body(headers)
        if rule is not None and rule.kind == "fail":
            record(rule.status, body)
            message = f"Injected by the test proxy ({rule.status} {rule.code})"
            self._answer(
                rule.status,
                [("Content-Type", "application/xml")],
                _error_body(rule.code, message, self.proxy._request_id()),
            )
            return
        if rule is not None and rule.kind == "delay":
            time.sleep(rule.seconds)
        if rule is not None and rule.kind == "corrupt" and body:
            middle = len(body) // 2
            body = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1 :]

        try:
            status, reason, response_headers, response_body = self._forward(body)
        except (OSError, http.client.HTTPException):  # moto is down (a test killed it) or broken:
            record(None, body, "upstream")  # the client sees the connection drop, as it would
            self._abort()
            return
        record(status, body)
        if rule is not None and rule.kind == "reset_response":
            cut = len(response_body) // 2 if rule.after_bytes is None else rule.after_bytes
            self._answer(status, response_headers, response_body, reason, cut_at=cut)
            return
        self._answer(status, response_headers, response_body, reason)

    def _read_exactly(self, n: int) -> bytes:
        data = self.rfile.read(n) if n else b""
        if len(data) != n:
            raise ConnectionError(f"the client sent {len(data)} of {n} body bytes")
        return data

    def _read_body(self, headers: dict[str, str]) -> bytes:
        """The whole request body: Content-Length bytes, or the decoded chunks of a chunked one."""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline().strip():  # trailer fields, up to the empty line
                        pass
                    return b"".join(chunks)
                chunks.append(self._read_exactly(size))
                self._read_exactly(2)  # the CRLF after each chunk
        return self._read_exactly(int(headers.get("content-length", 0) or 0))

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Send the request to moto as the client sent it (Host included); its whole answer."""
        conn = http.client.HTTPConnection(*self.proxy.upstream, timeout=_UPSTREAM_TIMEOUT)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            stripped = self.proxy.stripped
            for name, value in self.headers.items():
                lower = name.lower()
                if lower not in _HOP_BY_HOP and lower != "content-length" and lower not in stripped:
                    conn.putheader(name, value)
            if body or "content-length" in (k.lower() for k in self.headers):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            response = conn.getresponse()  # skips any 1xx, reads chunked or sized bodies
            payload = response.read()
            kept = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
            return response.status, response.reason, kept, payload
        finally:
            conn.close()

    def _answer(
        self,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        reason: str | None = None,
        cut_at: int | None = None,
    ) -> None:
        """Send the status, headers and body; with ``cut_at``, only that much body, then a reset."""
        self.send_response_only(status, reason)
        if self.proxy.response_editor is not None:
            headers = self.proxy.response_editor(list(headers))
        no_body = self.command == "HEAD" or status in (204, 304)
        for name, value in headers:
            # The body is sent whole, so its length is known; a HEAD keeps the object's length.
            if name.lower() != "content-length" or no_body:
                self.send_header(name, value)
        if not no_body:
            self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if no_body:
            return
        if cut_at is None:
            self.wfile.write(body)
            return
        self.wfile.write(body[:cut_at])
        self.wfile.flush()
        time.sleep(0.05)  # let the partial body reach the client before the RST overtakes it
        self._abort()

    def _abort(self) -> None:
        _reset(self.connection)
        # socketserver's own shutdown and close after this find a closed socket and ignore it.


@pytest.fixture
def s3_proxy(s3_bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3FaultProxy]:
    """A fault proxy in front of the session's S3 server; ``AWS_ENDPOINT_URL`` points at it.

    ``s3_bucket.endpoint_url`` still reaches moto directly (to look at what was really stored).
    """
    with S3FaultProxy(s3_bucket.endpoint_url) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        yield proxy
