"""Where a ``gs://bucket/prefix`` root is, how to reach it, and with which credentials.

Configuration as Google Cloud users already write it:

* the endpoint: ``storage_options['endpoint_url']``, else ``STORAGE_EMULATOR_HOST`` (an
  emulator: ``host:port`` or a URL), else ``https://storage.googleapis.com``;
* credentials (gcsfs's ``token``): ``None`` or ``"google_default"`` for Application Default
  Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth application-default login``,
  the metadata server), ``"cloud"`` for the metadata server only, ``"anon"`` for none, a path to
  a service-account or authorized-user JSON file, that file's content as a dict, or a
  ``google.auth`` credentials object. An emulator (``STORAGE_EMULATOR_HOST``) is reached
  without credentials unless ``token`` names some, as Google's own client does;
* ``project`` is taken (gcsfs users pass it) and not needed: a bucket names its project;
* safeckpt's transfer settings, as for ``s3://``: ``part_size``, ``max_concurrency``,
  ``max_attempts``, ``timeout``, ``connect_timeout``, ``read_timeout``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._objstore.http import Limits, check_limits
from ..errors import ConfigError

MIB = 1 << 20
CHUNK = 256 << 10  # a resumable upload's chunks are multiples of 256 KiB, but the last
PUBLIC = "https://storage.googleapis.com"

_URL = re.compile(r"^(gs|gcs)://([^/]+)(?:/(.*))?$")
# GCS bucket names: 3 to 63 characters (222 with dots) of a-z, 0-9, '-', '_', '.'.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


@dataclass(frozen=True)
class Location:
    scheme: str
    bucket: str
    prefix: str
    """The root's key prefix, ``""`` or ending in ``/``."""

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")


@dataclass(frozen=True)
class Settings:
    endpoint: str
    token: Any
    """gcsfs's ``token`` (see the module docstring); ``"anon"`` for an emulator by default."""
    emulator: bool
    part_size: int = 16 * MIB
    max_concurrency: int = 8
    max_attempts: int = 8
    timeout: float = 30.0
    connect_timeout: float = 5.0
    read_timeout: float = 20.0

    @property
    def limits(self) -> Limits:
        return Limits(
            self.max_attempts, self.timeout, self.connect_timeout, self.read_timeout, 4 * self.max_concurrency
        )


def parse_url(url: str) -> Location:
    """``gs://BUCKET/PREFIX`` as a :class:`Location`; :class:`ConfigError` naming what is wrong."""
    match = _URL.match(url)
    if not match:
        raise ConfigError(
            f"{url!r} is not a Google Cloud Storage root: write it as gs://BUCKET/PREFIX.", path=url
        )
    scheme, bucket = match.group(1), match.group(2)
    if not _BUCKET.match(bucket):
        raise ConfigError(
            f"{url!r}: {bucket!r} is not a GCS bucket name: 3 to 63 lowercase letters, digits, '-', '_' "
            "or '.', beginning and ending with a letter or digit.",
            path=url,
        )
    parts = [p for p in (match.group(3) or "").split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ConfigError(f"{url!r}: a root's prefix cannot contain '.' or '..' parts.", path=url)
    return Location(scheme, bucket, "".join(p + "/" for p in parts))


_TRANSFER = ("part_size", "max_concurrency", "max_attempts", "timeout", "connect_timeout", "read_timeout")


def settings(options: Mapping[str, Any] | None) -> Settings:
    """``storage_options`` checked, with the environment's endpoint."""
    options = dict(options or {})
    known = sorted(["project", "token", "endpoint_url", *_TRANSFER])
    for name in options:
        if name not in known:
            raise ConfigError(
                f"storage_options has no setting {name!r} for gs:// roots; it takes {', '.join(known)}."
            )
    options.pop("project", None)
    endpoint = options.pop("endpoint_url", None)
    emulator_host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    emulator = False
    if endpoint is None and emulator_host:
        endpoint = emulator_host if "://" in emulator_host else f"http://{emulator_host}"
        emulator = True
    if endpoint is None:
        endpoint = PUBLIC
    if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
        raise ConfigError(f"storage_options['endpoint_url'] must be an http(s) URL, got {endpoint!r}.")
    token = options.pop("token", None)
    if token is None and emulator:
        token = "anon"
    result = Settings(endpoint=endpoint.rstrip("/"), token=token, emulator=emulator, **options)
    check_limits(result.limits, "gs")
    if not isinstance(result.part_size, int) or result.part_size < CHUNK or result.part_size % CHUNK:
        raise ConfigError(
            f"storage_options['part_size'] of a gs:// root must be a multiple of 256 KiB ({CHUNK} bytes), "
            f"as GCS takes the chunks of an upload; got {result.part_size!r}."
        )
    if not isinstance(result.max_concurrency, int) or result.max_concurrency < 1:
        raise ConfigError(
            f"storage_options['max_concurrency'] must be a positive int, got {result.max_concurrency!r}."
        )
    return result


def credentials(chosen: Settings, url: str) -> Any:
    """The ``google.auth`` credentials of ``chosen.token``, or None for anonymous requests."""
    token = chosen.token
    if token == "anon":
        return None
    if token is not None and hasattr(token, "before_request"):
        return token  # a credentials object already
    try:
        import google.auth
        import google.auth.exceptions
    except ImportError as e:
        raise ConfigError(
            f"{url}: Google credentials need google-auth: pip install 'safeckpt[gcs]' (or pass "
            "storage_options={'token': 'anon'} for a public bucket or an emulator).",
            path=url,
        ) from e
    scopes = ["https://www.googleapis.com/auth/devstorage.read_write"]
    try:
        if token in (None, "google_default"):
            found, _ = google.auth.default(scopes=scopes)
            return found
        if token == "cloud":
            from google.auth import compute_engine

            return compute_engine.Credentials()
        if isinstance(token, (str, os.PathLike)):
            found, _ = google.auth.load_credentials_from_file(os.fspath(token), scopes=scopes)
            return found
        if isinstance(token, Mapping):
            found, _ = google.auth.load_credentials_from_dict(dict(token), scopes=scopes)
            return found
    except google.auth.exceptions.DefaultCredentialsError as e:
        raise ConfigError(
            f"{url}: no Google credentials ({e}). Run `gcloud auth application-default login`, set "
            "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, or pass "
            "storage_options={'token': ...}; for an emulator set STORAGE_EMULATOR_HOST.",
            path=url,
        ) from e
    raise ConfigError(
        f"storage_options['token'] of a gs:// root is None, 'google_default', 'cloud', 'anon', a JSON "
        f"key file's path, its content as a dict, or google.auth credentials; got {type(token).__name__}.",
        path=url,
    )
