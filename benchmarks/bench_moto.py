"""The S3 server of the ``s3://`` benchmarks: a moto server on 127.0.0.1 (``tests/support/s3_server.py``),
the ``AWS_*`` variables pointed at it, and a new bucket."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, moto_version

SKIPPED = 77  # run_all.py's status for a benchmark that cannot run here


def with_bucket(what: str, run: Callable[[str, str], int]) -> int:
    """``run(endpoint, bucket)`` against a fresh server; SKIPPED (with a line on stderr) without moto."""
    if moto_version() == "not installed":
        print(f"{what}: moto is not installed (make setup installs it)", file=sys.stderr)
        return SKIPPED
    server = S3Server(Path(os.environ.get("TMPDIR", "/tmp")))
    server.start()
    try:
        os.environ.update(server.environ())
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        client(server.endpoint).create_bucket(Bucket=bucket)
        return run(server.endpoint, bucket)
    finally:
        server.kill()


def client(endpoint: str):  # type: ignore[no-untyped-def]
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=REGION,
    )
