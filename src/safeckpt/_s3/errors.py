"""What an error from an S3 server means, in words, and what to do about it."""

from __future__ import annotations

import errno

from .._objstore.client import NotFound, ObjectStoreError, PreconditionFailed
from .location import Location


def explain_error(location: Location, error: OSError) -> tuple[str, str]:
    """What ``error`` (met on the root at ``location``) means, and what to do about it."""
    if isinstance(error, PreconditionFailed):
        return "another process changed the root at the same time (a conditional write lost)", (
            "make sure one training job writes to this root, then save again"
        )
    code = getattr(error, "code", "")
    if code == "NoSuchBucket" or (isinstance(error, NotFound) and "bucket" in str(error).lower()):
        return f"the bucket {location.bucket!r} does not exist", "create it, or fix the URL's bucket name"
    if code == "NoCredentials":
        return "no credentials were found", (
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, an instance role, or "
            "storage_options['key'] and ['secret'])"
        )
    if code == "NotImplemented" or getattr(error, "status", 0) == 501:
        return f"the server does not implement a request safeckpt needs ({error.strerror})", (
            "use an S3 server that implements it, or report which one this is"
        )
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or error.errno == errno.EACCES:
        return f"access denied ({code or 'permission'})", (
            "check the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or storage_options) and "
            "that they may read, write and delete under the prefix; pass read_only=True for a job "
            "that only restores"
        )
    if isinstance(error, ConnectionError) or (isinstance(error, ObjectStoreError) and error.status == 0):
        return f"the server is not available ({error.strerror})", (
            "check AWS_ENDPOINT_URL (or storage_options['endpoint_url']) and the network; each "
            "request was retried for up to storage_options['timeout'] seconds, and while the server "
            "stays down the next ones fail at once"
        )
    if code in ("SlowDown", "ServiceUnavailable", "InternalError") or (
        isinstance(error, ObjectStoreError) and error.status >= 500
    ):
        return f"the server kept failing ({code or error.strerror}) after every retry", (
            "wait and save again; raise storage_options['max_attempts'] for a server that is often busy"
        )
    return f"{type(error).__name__}: {error}", "check the bucket, the credentials and the server"
