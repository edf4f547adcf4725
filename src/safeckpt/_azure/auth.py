"""Credentials on a Blob Storage request: Shared Key (the account key signs each request), a SAS
(a query string), or a bearer token from a token credential (azure-identity).

Shared Key is Microsoft's published scheme ("Authorize with Shared Key", version 2015-02-21
and later): HMAC-SHA256 over the verb, the standard headers, the ``x-ms-`` headers and the
canonical resource, with the key decoded from base64.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

API_VERSION = "2021-08-06"
_SCOPE = "https://storage.azure.com/.default"
_STANDARD = (
    "content-encoding",
    "content-language",
    "content-length",
    "content-md5",
    "content-type",
    "date",
    "if-modified-since",
    "if-match",
    "if-none-match",
    "if-unmodified-since",
    "range",
)


def shared_key(account: str, key: str, method: str, url: str, headers: Mapping[str, str]) -> str:
    """The ``Authorization`` header's value for this request."""
    lower = {k.lower(): str(v).strip() for k, v in headers.items()}
    if lower.get("content-length") == "0":
        lower["content-length"] = ""
    lines = [method.upper(), *(lower.get(name, "") for name in _STANDARD)]
    ms = sorted((k, v) for k, v in lower.items() if k.startswith("x-ms-"))
    parts = urlsplit(url)
    resource = f"/{account}{parts.path or '/'}"  # the path as the URL escapes it
    query: dict[str, list[str]] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        query.setdefault(name.lower(), []).append(value)
    for name in sorted(query):
        resource += f"\n{name}:{','.join(sorted(query[name]))}"
    text = "\n".join(lines) + "\n" + "".join(f"{k}:{v}\n" for k, v in ms) + resource
    digest = hmac.new(base64.b64decode(key), text.encode("utf-8"), hashlib.sha256).digest()
    return f"SharedKey {account}:{base64.b64encode(digest).decode()}"


class Bearer:
    """A token credential's token, fetched again a few minutes before it expires (thread-safe)."""

    def __init__(self, credential: Any) -> None:
        self._credential = credential
        self._token: Any = None
        self._guard = threading.Lock()

    def header(self) -> str:
        with self._guard:
            if self._token is None or self._token.expires_on - time.time() < 300:
                self._token = self._credential.get_token(_SCOPE)
            return f"Bearer {self._token.token}"
