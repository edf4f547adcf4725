"""Where an ``s3://bucket/prefix`` root is, and how to reach it: the URL and the client settings.

Settings come from the standard AWS variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``/``AWS_DEFAULT_REGION``, read by the client itself), overridden by
``storage_options`` written as fsspec and Lightning users write them
(``key``, ``secret``, ``token``, ``endpoint_url``, ``region_name``,
``client_kwargs={"endpoint_url": ..., "region_name": ...}``), plus safeckpt's
own transfer settings (``part_size``, ``max_concurrency``, ``max_attempts``,
``timeout``, ``connect_timeout``, ``read_timeout``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

MIB = 1 << 20
MIN_PART = 5 * MIB  # S3's smallest part but the last
MAX_PARTS = 10_000

_URL = re.compile(r"^s3://([^/]+)(?:/(.*))?$")
# Bucket names as S3 takes them (3 to 63 of a-z, 0-9, '.', '-'), so a typo fails here, not in a 400.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class Settings:
    """How to reach the server, and how to move bytes to it."""

    client: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the client's constructor (credentials, endpoint, region)."""
    part_size: int = 16 * MIB
    """Bytes per part of a multipart upload and per ranged GET."""
    max_concurrency: int = 8
    """Parts uploaded, or ranges read, at once per file."""
    max_attempts: int = 8
    """Attempts per request (the first and its retries, with exponential backoff and jitter)."""
    timeout: float = 30.0
    """Seconds a request may keep retrying before it gives up; once one gives up because nothing
    answered, the server counts as down and the next requests fail at once (a probe every few
    seconds). So every call ends within about ``timeout + read_timeout`` after the server stops
    answering."""
    connect_timeout: float = 5.0
    read_timeout: float = 20.0


@dataclass(frozen=True)
class Location:
    bucket: str
    prefix: str
    """The root's key prefix, ``""`` or ending in ``/``."""

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


def parse_url(url: str) -> Location:
    """``s3://BUCKET/PREFIX`` as a :class:`Location`; raises :class:`ConfigError` naming what is wrong."""
    if url[:5].lower() == "s3://" and not url.startswith("s3://"):
        raise ConfigError(
            f"{url!r}: the URL scheme {url[:5]!r} is written in lowercase: did you mean "
            f"{'s3://' + url[5:]!r}?",
            path=url,
        )
    match = _URL.match(url)
    if not match:
        none = " (it names no bucket)" if url.startswith("s3:///") else ""
        raise ConfigError(f"{url!r} is not an S3 root{none}: write it as s3://BUCKET/PREFIX.", path=url)
    bucket = match.group(1)
    if not _BUCKET.match(bucket):
        why = " (bucket names have no uppercase letters)" if bucket != bucket.lower() else ""
        raise ConfigError(
            f"{url!r}: {bucket!r} is not an S3 bucket name{why}: a bucket name is 3 to 63 lowercase "
            "letters, digits, '.' or '-', beginning and ending with a letter or digit.",
            path=url,
        )
    parts = [p for p in (match.group(2) or "").split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ConfigError(f"{url!r}: a root's prefix cannot contain '.' or '..' parts.", path=url)
    return Location(bucket, "".join(p + "/" for p in parts))


_CLIENT_KEYS = {
    "key": "aws_access_key_id",
    "secret": "aws_secret_access_key",
    "token": "aws_session_token",
    "endpoint_url": "endpoint_url",
    "region_name": "region_name",
    "region": "region_name",
}
_TRANSFER_KEYS = {
    "part_size",
    "max_concurrency",
    "max_attempts",
    "timeout",
    "connect_timeout",
    "read_timeout",
}


def settings(options: Mapping[str, Any] | None) -> Settings:
    """``storage_options`` checked and split into client arguments and transfer settings."""
    options = dict(options or {})
    client: dict[str, Any] = {}
    nested = options.pop("client_kwargs", None) or {}
    if not isinstance(nested, Mapping):
        raise ConfigError(f"storage_options['client_kwargs'] must be a dict, got {type(nested).__name__}.")
    for name, value in nested.items():
        if name not in ("endpoint_url", "region_name"):
            raise ConfigError(
                f"storage_options['client_kwargs'] takes endpoint_url and region_name, not {name!r}."
            )
        client[name] = value
    transfer: dict[str, Any] = {}
    for name, value in options.items():
        if name in _CLIENT_KEYS:
            client[_CLIENT_KEYS[name]] = value
        elif name in _TRANSFER_KEYS:
            transfer[name] = value
        else:
            known = ", ".join(sorted([*_CLIENT_KEYS, *_TRANSFER_KEYS, "client_kwargs"]))
            raise ConfigError(f"storage_options has no setting {name!r} for s3:// roots; it takes {known}.")
    result = Settings(client=client, **transfer)
    if not isinstance(result.part_size, int) or result.part_size < MIN_PART:
        raise ConfigError(
            f"storage_options['part_size'] must be at least {MIN_PART} bytes (5 MiB), S3's least."
        )
    for name in ("max_concurrency", "max_attempts"):
        value = getattr(result, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"storage_options[{name!r}] must be a positive int, got {value!r}.")
    for name in ("timeout", "connect_timeout", "read_timeout"):
        value = getattr(result, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(
                f"storage_options[{name!r}] must be a positive number of seconds, got {value!r}."
            )
    return result
