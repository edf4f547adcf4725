"""The S3 test server (tests/support/s3_server.py): a fresh bucket per test, env that does not leak, and a
conditional-write check that really catches a server answering 200 where S3 answers 412."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator

import pytest

from s3_server import S3Bucket, S3Server, _skip_or_fail, conditional_write_problem

pytestmark = pytest.mark.s3

_seen: dict[str, str] = {}  # what earlier tests in this file saw, for the ones after them


@pytest.mark.parametrize("round_", [0, 1])
def test_each_test_gets_a_fresh_empty_bucket(s3_bucket: S3Bucket, round_: int) -> None:
    assert s3_bucket.keys() == []
    assert s3_bucket.name != _seen.get("bucket")
    s3_bucket.client().put_object(Bucket=s3_bucket.name, Key=f"left-{round_}", Body=b"x")
    assert s3_bucket.keys() == [f"left-{round_}"]
    _seen["bucket"] = s3_bucket.name
    _seen["endpoint"] = s3_bucket.endpoint_url


def test_a_finished_tests_bucket_is_deleted(s3_bucket: S3Bucket) -> None:
    names = [b["Name"] for b in s3_bucket.client().list_buckets()["Buckets"]]
    assert _seen["bucket"] not in names
    assert names == [s3_bucket.name]


def test_aws_variables_reach_the_bucket(s3_bucket: S3Bucket) -> None:
    import boto3

    assert os.environ["AWS_ENDPOINT_URL"] == s3_bucket.endpoint_url
    assert os.environ["AWS_REGION"] == os.environ["AWS_DEFAULT_REGION"] == s3_bucket.region
    # A client configured by the environment alone, as a user's would be.
    client = boto3.client("s3")
    client.put_object(Bucket=s3_bucket.name, Key="from-env", Body=b"hello")
    assert s3_bucket.keys() == ["from-env"]
    assert s3_bucket.url("run1") == f"s3://{s3_bucket.name}/run1"


def test_aws_variables_do_not_leak_out_of_a_test() -> None:
    assert os.environ.get("AWS_ENDPOINT_URL") != _seen["endpoint"]


def test_the_server_refuses_conflicting_conditional_puts(s3_server: S3Server, s3_bucket: S3Bucket) -> None:
    from botocore.exceptions import ClientError

    assert conditional_write_problem(s3_server.endpoint) is None
    client = s3_bucket.client()
    first = client.put_object(Bucket=s3_bucket.name, Key="commit", Body=b"1", IfNoneMatch="*")
    with pytest.raises(ClientError) as raised:
        client.put_object(Bucket=s3_bucket.name, Key="commit", Body=b"2", IfNoneMatch="*")
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    with pytest.raises(ClientError) as raised:
        client.put_object(Bucket=s3_bucket.name, Key="commit", Body=b"3", IfMatch='"' + "0" * 32 + '"')
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    client.put_object(Bucket=s3_bucket.name, Key="commit", Body=b"4", IfMatch=first["ETag"])
    assert client.get_object(Bucket=s3_bucket.name, Key="commit")["Body"].read() == b"4"


# --- the check against tiny fake servers: it must not only pass on a good one -----------------


class _FakeS3(http.server.BaseHTTPRequestHandler):
    """Answers PUT/GET/DELETE from a dict; ``mode`` picks which conditional checks it gets wrong."""

    mode = "correct"
    objects: dict[str, bytes] = {}

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        etag = f'"{len(self.objects.get(self.path, b""))}-{hash(self.objects.get(self.path))}"'
        exists = self.path in self.objects
        refuse = {
            "correct": (self.headers.get("If-None-Match") == "*" and exists)
            or (self.headers.get("If-Match") not in (None, etag)),
            "always_200": False,
            "if_match_ignored": self.headers.get("If-None-Match") == "*" and exists,
            "refuses_every_condition": "If-Match" in self.headers or "If-None-Match" in self.headers,
        }[self.mode]
        if refuse:
            return self._answer(412)
        self.objects[self.path] = body
        self._answer(200, {"ETag": f'"{len(body)}-{hash(body)}"'})

    def do_GET(self) -> None:
        body = self.objects.get(self.path)
        self._answer(200, body=body) if body is not None else self._answer(404)

    def do_DELETE(self) -> None:
        self.objects.pop(self.path, None)
        self._answer(204)

    def _answer(self, status: int, headers: dict[str, str] | None = None, body: bytes = b"") -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:  # keep the test output quiet
        pass


@pytest.fixture
def fake_s3() -> Iterator[tuple[str, type[_FakeS3]]]:
    handler = type("Handler", (_FakeS3,), {"objects": {}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_check_passes_a_correct_fake(fake_s3: tuple[str, type[_FakeS3]]) -> None:
    endpoint, handler = fake_s3
    handler.mode = "correct"
    assert conditional_write_problem(endpoint) is None


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("always_200", "If-None-Match: * on an existing key answered 200, not 412"),
        ("if_match_ignored", "If-Match on a wrong ETag answered 200, not 412"),
        # Refusing every conditional PUT is wrong too: the right ETag must pass.
        ("refuses_every_condition", "If-Match on the current ETag answered 412, not 200"),
    ],
)
def test_check_catches_a_server_that_gets_conditions_wrong(
    fake_s3: tuple[str, type[_FakeS3]], mode: str, expected: str
) -> None:
    endpoint, handler = fake_s3
    handler.mode = mode
    problem = conditional_write_problem(endpoint)
    assert problem is not None and expected in problem


def test_check_reports_an_unreachable_server() -> None:
    problem = conditional_write_problem("http://127.0.0.1:9")  # discard port: nothing listens
    assert problem is not None and "could not be reached" in problem


def test_a_bad_server_fails_under_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"CI=true and the S3 tests cannot run: moto 1\.0"):
        _skip_or_fail("moto 1.0 does not refuse conflicting conditional writes")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=r"moto 1\.0"):
        _skip_or_fail("moto 1.0 does not refuse conflicting conditional writes")
