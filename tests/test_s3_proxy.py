"""The fault proxy (tests/support/s3_proxy.py), each rule proven with a plain boto3 client through it.

The clients are configured like safeckpt's (botocore retries mode "standard", path-style, checksums
only where the caller gives them), so what these tests find about retries holds for safeckpt too.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import os
import socket
import threading
import time
from typing import Any

import pytest

from s3_proxy import S3FaultProxy, crc32_header
from s3_server import S3Bucket

pytestmark = pytest.mark.s3

MiB = 1024 * 1024


def client(endpoint: str | None, attempts: int = 5, **config: Any) -> Any:
    """A boto3 S3 client making at most ``attempts`` attempts per request (retries: one fewer);
    ``endpoint=None`` takes ``AWS_ENDPOINT_URL`` (and the credentials) from the environment."""
    import boto3
    from botocore.config import Config

    settings = Config(
        # total_max_attempts counts the first attempt; botocore's "max_attempts" key counts only
        # the retries (see test_botocore_max_attempts_counts_retries_not_attempts).
        retries={"mode": "standard", "total_max_attempts": attempts},
        s3={"addressing_style": "path"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        **config,
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=settings)


def error_of(e: Exception) -> tuple[str, int]:
    response = e.response  # type: ignore[attr-defined]
    return response["Error"]["Code"], response["ResponseMetadata"]["HTTPStatusCode"]


def test_the_fixture_points_the_environment_at_the_proxy(s3_proxy: S3FaultProxy, s3_bucket: S3Bucket) -> None:
    assert os.environ["AWS_ENDPOINT_URL"] == s3_proxy.endpoint != s3_bucket.endpoint_url
    client(None).put_object(Bucket=s3_bucket.name, Key="k", Body=b"via the environment")
    assert [(s.method, s.path, s.status) for s in s3_proxy.requests] == [("PUT", f"/{s3_bucket.name}/k", 200)]


class _Echo(http.server.BaseHTTPRequestHandler):
    """An upstream that answers with what reached it: Host, Content-Length, Expect and the body."""

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        seen = {k: self.headers.get(k) for k in ("Host", "Content-Length", "Expect", "Transfer-Encoding")}
        answer = json.dumps({**seen, "body": body.decode()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_upstream_gets_the_clients_host_and_a_sized_body() -> None:
    # SigV4 signs Host: upstream must see the proxy's host:port the client signed, not its own.
    # A chunked body goes upstream decoded, with a Content-Length.
    upstream = http.server.HTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        with S3FaultProxy(f"http://127.0.0.1:{upstream.server_address[1]}") as proxy:
            host = proxy.endpoint.removeprefix("http://")
            conn = http.client.HTTPConnection(host, timeout=10)
            conn.request("PUT", "/b/k?x=1", body=iter([b"chunk-one,", b"chunk-two"]), encode_chunked=True)
            echoed = json.loads(conn.getresponse().read())
            conn.close()
    finally:
        upstream.shutdown()
        upstream.server_close()
    assert echoed == {
        "Host": host,
        "Content-Length": "19",
        "Expect": None,
        "Transfer-Encoding": None,
        "body": "chunk-one,chunk-two",
    }
    assert [(s.method, s.path, s.query, s.status) for s in proxy.requests] == [("PUT", "/b/k", "x=1", 200)]


def test_an_unreachable_upstream_drops_the_connection() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # nothing listens there
    with S3FaultProxy(f"http://127.0.0.1:{port}") as proxy:
        conn = http.client.HTTPConnection(proxy.endpoint.removeprefix("http://"), timeout=10)
        with pytest.raises(ConnectionError):
            conn.request("GET", "/b/k")
            conn.getresponse()
        conn.close()
    assert [(s.status, s.fault) for s in proxy.requests] == [(None, "upstream")]


def test_put_and_get_pass_through_unchanged(s3_proxy: S3FaultProxy, s3_bucket: S3Bucket) -> None:
    body = os.urandom(3 * MiB + 17)
    proxied, direct = client(s3_proxy.endpoint), client(s3_bucket.endpoint_url)
    put = proxied.put_object(Bucket=s3_bucket.name, Key="a", Body=body, ChecksumCRC32=crc32_header(body))
    etag = direct.put_object(Bucket=s3_bucket.name, Key="b", Body=body)["ETag"]
    assert put["ETag"] == etag == f'"{hashlib.md5(body).hexdigest()}"'
    assert proxied.get_object(Bucket=s3_bucket.name, Key="a")["Body"].read() == body
    assert direct.get_object(Bucket=s3_bucket.name, Key="a")["Body"].read() == body
    assert proxied.head_object(Bucket=s3_bucket.name, Key="b")["ContentLength"] == len(body)
    assert proxied.get_object(Bucket=s3_bucket.name, Key="b", Range="bytes=5-9")["Body"].read() == body[5:10]
    seen = [(s.method, s.status, s.checksum_ok, s.fault) for s in s3_proxy.requests]
    assert seen == [
        ("PUT", 200, True, None),
        ("GET", 200, None, None),
        ("HEAD", 200, None, None),
        ("GET", 206, None, None),
    ]


def test_expect_100_continue_is_answered(s3_proxy: S3FaultProxy, s3_bucket: S3Bucket) -> None:
    # botocore sends "Expect: 100-continue" on every S3 PUT/POST with a body (bytes too: it makes
    # them file-like) and waits up to 1 s for the 100 before sending the body.
    client(s3_proxy.endpoint).put_object(Bucket=s3_bucket.name, Key="boto", Body=b"x" * 1000)
    assert (s3_proxy.requests[-1].headers.get("expect"), s3_proxy.requests[-1].status) == (
        "100-continue",
        200,
    )
    # The proxy answers the 100 itself, before the body comes (a raw client, to see the 100 the
    # way botocore does), and sends moto the body without the Expect.
    port = int(s3_proxy.endpoint.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = f"PUT /{s3_bucket.name}/raw HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        sock.sendall(f"{head}Content-Length: 5\r\nExpect: 100-continue\r\n\r\n".encode())
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"hello")
        assert sock.recv(100).startswith(b"HTTP/1.1 200 ")
    stored = client(s3_bucket.endpoint_url).get_object(Bucket=s3_bucket.name, Key="raw")["Body"].read()
    assert stored == b"hello"


def test_a_conditional_put_412_passes_through(s3_proxy: S3FaultProxy, s3_bucket: S3Bucket) -> None:
    proxied = client(s3_proxy.endpoint)
    proxied.put_object(Bucket=s3_bucket.name, Key="k", Body=b"first", IfNoneMatch="*")
    with pytest.raises(proxied.exceptions.ClientError) as raised:
        proxied.put_object(Bucket=s3_bucket.name, Key="k", Body=b"second", IfNoneMatch="*")
    assert error_of(raised.value) == ("PreconditionFailed", 412)
    assert [s.status for s in s3_proxy.requests] == [200, 412]  # a 412 is not retried


def test_slowdown_is_retried_until_it_succeeds(s3_proxy: S3FaultProxy, s3_bucket: S3Bucket) -> None:
    s3_proxy.fail_next(2, method="PUT")
    client(s3_proxy.endpoint, attempts=5).put_object(Bucket=s3_bucket.name, Key="k", Body=b"data")
    assert [(s.status, s.fault) for s in s3_proxy.seen(method="PUT")] == [
        (503, "fail"),
        (503, "fail"),
        (200, None),
    ]
    assert s3_proxy.pending() == 0


def test_slowdown_past_max_attempts_reaches_the_caller(s3_proxy: S3FaultProxy, s3_bucket: S3Bucket) -> None:
    s3_proxy.fail_next(2, method="PUT")
    proxied = client(s3_proxy.endpoint, attempts=2)
    with pytest.raises(proxied.exceptions.ClientError) as raised:
        proxied.put_object(Bucket=s3_bucket.name, Key="k", Body=b"data")
    assert error_of(raised.value) == ("SlowDown", 503)
    assert [s.status for s in s3_proxy.requests] == [503, 503]  # never forwarded
    assert s3_bucket.keys() == []


def test_botocore_max_attempts_counts_retries_not_attempts(
    s3_proxy: S3FaultProxy, s3_bucket: S3Bucket
) -> None:
    # Config(retries={"max_attempts": 2}) is 2 retries after the first attempt, so 3 in all: two
    # SlowDowns are survived. (AWS_MAX_ATTEMPTS and total_max_attempts count the first attempt.)
    import boto3
    from botocore.config import Config

    s3_proxy.fail_next(2, method="PUT")
    config = Config(retries={"mode": "standard", "max_attempts": 2}, s3={"addressing_style": "path"})
    proxied = boto3.session.Session().client("s3", endpoint_url=s3_proxy.endpoint, config=config)
    proxied.put_object(Bucket=s3_bucket.name, Key="k", Body=b"data")
    assert [s.status for s in s3_proxy.requests] == [503, 503, 200]


def test_fail_next_hits_only_matching_requests(s3_proxy: S3FaultProxy, s3_bucket: S3Bucket) -> None:
    s3_proxy.fail_next(1, status=500, code="InternalError", query_contains="uploads")
    proxied = client(s3_proxy.endpoint, attempts=1)
    proxied.put_object(Bucket=s3_bucket.name, Key="k", Body=b"data")  # no query: not hit
    with pytest.raises(proxied.exceptions.ClientError) as raised:
        proxied.create_multipart_upload(Bucket=s3_bucket.name, Key="m")
    assert error_of(raised.value) == ("InternalError", 500)


def test_a_reset_upload_part_is_retried_and_the_upload_completes(
    s3_proxy: S3FaultProxy, s3_bucket: S3Bucket
) -> None:
    first, last = os.urandom(5 * MiB), os.urandom(1000)  # moto's least size for all parts but the last
    proxied = client(s3_proxy.endpoint)
    upload = proxied.create_multipart_upload(Bucket=s3_bucket.name, Key="m", ChecksumAlgorithm="CRC32")
    # Cut the first part 1 MiB in: the client is still sending when the RST comes.
    s3_proxy.reset_next(1, method="PUT", query_contains="partNumber=1", after_bytes=MiB)
    parts = []
    for number, data in enumerate((first, last), start=1):
        part = proxied.upload_part(
            Bucket=s3_bucket.name,
            Key="m",
            UploadId=upload["UploadId"],
            PartNumber=number,
            Body=data,
            ChecksumCRC32=crc32_header(data),
        )
        parts.append({"PartNumber": number, "ETag": part["ETag"], "ChecksumCRC32": crc32_header(data)})
    proxied.complete_multipart_upload(
        Bucket=s3_bucket.name, Key="m", UploadId=upload["UploadId"], MultipartUpload={"Parts": parts}
    )
    stored = client(s3_bucket.endpoint_url).get_object(Bucket=s3_bucket.name, Key="m")["Body"].read()
    assert stored == first + last
    part_one = s3_proxy.seen(method="PUT", query_contains="partNumber=1")
    assert [(s.status, s.fault, s.checksum_ok) for s in part_one] == [
        (None, "reset", None),
        (200, None, True),
    ]


def test_a_reset_before_any_response_is_retried(s3_proxy: S3FaultProxy, s3_bucket: S3Bucket) -> None:
    client(s3_bucket.endpoint_url).put_object(Bucket=s3_bucket.name, Key="k", Body=b"data")
    s3_proxy.reset_next(1, method="GET")
    assert client(s3_proxy.endpoint).get_object(Bucket=s3_bucket.name, Key="k")["Body"].read() == b"data"
    assert [s.status for s in s3_proxy.seen(method="GET")] == [None, 200]


def test_a_response_cut_midway_is_a_short_read(s3_proxy: S3FaultProxy, s3_bucket: S3Bucket) -> None:
    from botocore.exceptions import IncompleteReadError, ResponseStreamingError

    body = os.urandom(2 * MiB)
    client(s3_bucket.endpoint_url).put_object(Bucket=s3_bucket.name, Key="k", Body=body)
    s3_proxy.reset_response_next(1, method="GET")
    got = client(s3_proxy.endpoint).get_object(Bucket=s3_bucket.name, Key="k")
    assert got["ContentLength"] == len(body)  # the headers came whole: the body is what is cut
    # botocore does not retry a body read once get_object has returned: the reader sees the cut.
    with pytest.raises((ResponseStreamingError, IncompleteReadError)):
        got["Body"].read()
    assert [(s.status, s.fault) for s in s3_proxy.requests] == [(200, "reset_response")]


def test_delay_next_slows_a_request_down(s3_proxy: S3FaultProxy, s3_bucket: S3Bucket) -> None:
    proxied = client(s3_proxy.endpoint)
    s3_proxy.delay_next(1, seconds=0.6, method="HEAD")
    start = time.monotonic()
    with pytest.raises(proxied.exceptions.ClientError):
        proxied.head_object(Bucket=s3_bucket.name, Key="missing")
    assert time.monotonic() - start >= 0.6
    assert [(s.status, s.fault) for s in s3_proxy.requests] == [(404, "delay")]


def test_a_delay_past_the_read_timeout_times_out(s3_proxy: S3FaultProxy, s3_bucket: S3Bucket) -> None:
    from botocore.exceptions import ReadTimeoutError

    s3_proxy.delay_next(1, seconds=1.5, method="GET")
    proxied = client(s3_proxy.endpoint, attempts=1, read_timeout=0.5)
    with pytest.raises(ReadTimeoutError):
        proxied.list_objects_v2(Bucket=s3_bucket.name)


def test_a_body_corrupted_in_flight_is_stored_by_moto(s3_proxy: S3FaultProxy, s3_bucket: S3Bucket) -> None:
    body = os.urandom(4096)
    s3_proxy.corrupt_next(1, method="PUT")
    put = client(s3_proxy.endpoint).put_object(
        Bucket=s3_bucket.name, Key="k", Body=body, ChecksumCRC32=crc32_header(body)
    )
    # moto accepts a body that does not match its x-amz-checksum-crc32 (real S3: 400 BadDigest) ...
    stored = client(s3_bucket.endpoint_url).get_object(Bucket=s3_bucket.name, Key="k")["Body"].read()
    assert len(stored) == len(body)
    assert sum(a != b for a, b in zip(stored, body, strict=True)) == 1
    # ... but the proxy's record shows it, and so does the ETag (the MD5 of what was stored).
    assert [(s.status, s.checksum_ok, s.fault) for s in s3_proxy.requests] == [(200, False, "corrupt")]
    assert put["ETag"] == f'"{hashlib.md5(stored).hexdigest()}"' != f'"{hashlib.md5(body).hexdigest()}"'


def test_checksum_ok_records_the_crc32_header(s3_proxy: S3FaultProxy, s3_bucket: S3Bucket) -> None:
    proxied = client(s3_proxy.endpoint)
    proxied.put_object(Bucket=s3_bucket.name, Key="right", Body=b"abc", ChecksumCRC32=crc32_header(b"abc"))
    proxied.put_object(Bucket=s3_bucket.name, Key="none", Body=b"abc")
    # A wrong header: real S3 answers 400 BadDigest, moto stores the body anyway.
    proxied.put_object(Bucket=s3_bucket.name, Key="wrong", Body=b"abc", ChecksumCRC32=crc32_header(b"abd"))
    assert [(s.path.rsplit("/", 1)[1], s.checksum_ok) for s in s3_proxy.requests] == [
        ("right", True),
        ("none", None),
        ("wrong", False),
    ]
