"""Where an ``az://container/prefix`` root is, and how to reach it: the account and credentials.

Configuration as Azure users already write it (adlfs's ``storage_options`` and the SDK's
variables), the first that is given winning:

* ``connection_string`` (or ``AZURE_STORAGE_CONNECTION_STRING``): account, key or SAS, and
  endpoint in one (``UseDevelopmentStorage=true`` is Azurite on 127.0.0.1:10000);
* ``account_name`` (or ``AZURE_STORAGE_ACCOUNT_NAME``) with ``account_key``
  (``AZURE_STORAGE_ACCOUNT_KEY``), or ``sas_token`` (``AZURE_STORAGE_SAS_TOKEN``), or
  ``credential`` (a key, a SAS, or an ``azure.core`` token credential), else
  ``DefaultAzureCredential`` (azure-identity: environment, workload or managed identity,
  ``az login``);
* ``account_host`` (adlfs) or ``endpoint_url``: the blob endpoint, for a sovereign cloud or an
  emulator; else ``https://<account>.blob.core.windows.net``;
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
MAX_BLOCK = 4000 * MIB  # Put Block's largest
# Azurite's well-known development account (published by Microsoft; no secret).
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

_URL = re.compile(r"^az://([^/]+)(?:/(.*))?$")
_CONTAINER = re.compile(r"^[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class Location:
    container: str
    prefix: str

    @property
    def url(self) -> str:
        return f"az://{self.container}/{self.prefix}".rstrip("/")


@dataclass(frozen=True)
class Settings:
    account: str
    endpoint: str
    """The account's blob endpoint (``https://acct.blob.core.windows.net``, or Azurite's
    ``http://127.0.0.1:10000/devstoreaccount1``)."""
    key: str | None = None
    sas: str | None = None
    credential: Any = None
    """A token credential (``get_token``), or None with a key or SAS; ``"default"``: made from
    azure-identity's ``DefaultAzureCredential`` when the client is."""
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
    """``az://CONTAINER/PREFIX`` as a :class:`Location`; :class:`ConfigError` naming what is wrong."""
    match = _URL.match(url)
    if not match:
        raise ConfigError(f"{url!r} is not an Azure Blob root: write it as az://CONTAINER/PREFIX.", path=url)
    container = match.group(1)
    if "@" in container:
        raise ConfigError(
            f"{url!r}: name the account in storage_options['account_name'] (or a connection string), "
            "not in the URL: az://CONTAINER/PREFIX.",
            path=url,
        )
    if not _CONTAINER.match(container):
        raise ConfigError(
            f"{url!r}: {container!r} is not an Azure container name: 3 to 63 lowercase letters, digits "
            "and single '-', beginning and ending with a letter or digit.",
            path=url,
        )
    parts = [p for p in (match.group(2) or "").split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ConfigError(f"{url!r}: a root's prefix cannot contain '.' or '..' parts.", path=url)
    return Location(container, "".join(p + "/" for p in parts))


_CREDENTIALS = ("connection_string", "account_name", "account_key", "sas_token", "credential")
_ENDPOINT = ("account_host", "endpoint_url")
_TRANSFER = ("part_size", "max_concurrency", "max_attempts", "timeout", "connect_timeout", "read_timeout")


def parse_connection_string(text: str, url: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for part in text.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep:
            fields[name.strip().lower()] = value.strip()
    if fields.get("usedevelopmentstorage", "").lower() == "true":
        fields.setdefault("accountname", DEV_ACCOUNT)
        fields.setdefault("accountkey", DEV_KEY)
        fields.setdefault("blobendpoint", f"http://127.0.0.1:10000/{DEV_ACCOUNT}")
    if "accountname" not in fields and "blobendpoint" not in fields:
        raise ConfigError(
            f"{url}: the connection string names no AccountName or BlobEndpoint (copy it whole from "
            "the portal: Storage account > Access keys).",
            path=url,
        )
    return fields


def settings(options: Mapping[str, Any] | None, url: str) -> Settings:
    """``storage_options`` and the environment, checked: the account, its endpoint, credentials."""
    options = dict(options or {})
    known = sorted([*_CREDENTIALS, *_ENDPOINT, *_TRANSFER])
    for name in options:
        if name not in known:
            raise ConfigError(
                f"storage_options has no setting {name!r} for az:// roots; it takes {', '.join(known)}."
            )
    given = {n: options.pop(n) for n in _CREDENTIALS if options.get(n) is not None}
    host = options.pop("endpoint_url", None) or options.pop("account_host", None)
    options.pop("account_host", None)
    env = os.environ
    connection = given.get("connection_string")
    if connection is None and not given:
        connection = env.get("AZURE_STORAGE_CONNECTION_STRING") or None
    account = given.get("account_name")
    key = given.get("account_key")
    sas = given.get("sas_token")
    credential = given.get("credential")
    endpoint = None
    if connection is not None:
        fields = parse_connection_string(str(connection), url)
        account = fields.get("accountname", account)
        key = fields.get("accountkey", key)
        sas = fields.get("sharedaccesssignature", sas)
        endpoint = fields.get("blobendpoint")
        if endpoint is None:
            protocol = fields.get("defaultendpointsprotocol", "https")
            suffix = fields.get("endpointsuffix", "core.windows.net")
            endpoint = f"{protocol}://{account}.blob.{suffix}"
    else:
        account = account or env.get("AZURE_STORAGE_ACCOUNT_NAME") or None
        if key is None and sas is None and credential is None:
            key = env.get("AZURE_STORAGE_ACCOUNT_KEY") or None
            sas = env.get("AZURE_STORAGE_SAS_TOKEN") or None
    if isinstance(credential, str):  # adlfs takes a key or a SAS as `credential` too
        if "sig=" in credential:
            sas, credential = credential, None
        else:
            key, credential = credential, None
    if host:
        endpoint = host if "://" in str(host) else f"https://{host}"
    if not account and endpoint:
        account = str(endpoint).rstrip("/").rsplit("/", 1)[-1].split(".")[0]
    if not account:
        raise ConfigError(
            f"{url}: no Azure storage account: set AZURE_STORAGE_CONNECTION_STRING, or "
            "AZURE_STORAGE_ACCOUNT_NAME (with a key, a SAS or an Azure identity), or pass "
            "storage_options={'account_name': ...} (or 'connection_string').",
            path=url,
        )
    if endpoint is None:
        endpoint = f"https://{account}.blob.core.windows.net"
    if key is None and sas is None and credential is None:
        credential = "default"
    result = Settings(
        account=str(account),
        endpoint=str(endpoint).rstrip("/"),
        key=key,
        sas=str(sas).lstrip("?") if sas else None,
        credential=credential,
        **options,
    )
    check_limits(result.limits, "az")
    if not isinstance(result.part_size, int) or not 1 <= result.part_size <= MAX_BLOCK:
        raise ConfigError(
            f"storage_options['part_size'] of an az:// root must be 1 to {MAX_BLOCK} bytes (a block's "
            f"largest), got {result.part_size!r}."
        )
    if not isinstance(result.max_concurrency, int) or result.max_concurrency < 1:
        raise ConfigError(
            f"storage_options['max_concurrency'] must be a positive int, got {result.max_concurrency!r}."
        )
    return result
