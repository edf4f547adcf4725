"""An object store in this process's memory: an :class:`ObjectClient` written outside the package.

It is what a new backend's author writes (a few requests and their errors), and it is
registered from outside, through the public API, as ``memory://bucket/prefix``
(:func:`register`), so the conformance suite (tests/test_conformance.py) runs the generic
object-root store on it beside the local store and S3 on moto. Every object has a
generation; a conditional write compares it, as a real service compares an ETag.

Faults for the tests: ``ignore_conditions`` (a server that overwrites whatever it is told,
which the conditional-write check must refuse).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import safeckpt.storage as storage


@dataclass
class _Object:
    data: bytes
    generation: str
    metadata: dict[str, str]


@dataclass
class Bucket:
    """One bucket's objects and unfinished uploads, shared by every client of it."""

    objects: dict[str, _Object] = field(default_factory=dict)
    uploads: dict[str, tuple[str, dict[int, bytes]]] = field(default_factory=dict)  # id -> key, parts
    guard: threading.Lock = field(default_factory=threading.Lock)
    ignore_conditions: bool = False


_buckets: dict[str, Bucket] = {}
_counter = itertools.count(1)


def bucket(name: str) -> Bucket:
    return _buckets.setdefault(name, Bucket())


class MemoryClient:
    """The :class:`safeckpt.storage.ObjectClient` of one in-memory bucket."""

    def __init__(self, name: str) -> None:
        self.endpoint = "memory://"
        self.bucket = name
        self._bucket = bucket(name)

    def put(
        self,
        key: str,
        data: bytes,
        *,
        create_only: bool = False,
        replacing: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> str:
        b = self._bucket
        with b.guard:
            there = b.objects.get(key)
            if not b.ignore_conditions:
                if create_only and there is not None:
                    raise storage.PreconditionFailed(key)
                if replacing is not None and (there is None or there.generation != replacing):
                    raise storage.PreconditionFailed(key)
            generation = str(next(_counter))
            b.objects[key] = _Object(bytes(data), generation, dict(metadata or {}))
            return generation

    def get(self, key: str, *, start: int | None = None, length: int | None = None) -> storage.Got:
        with self._bucket.guard:
            found = self._bucket.objects.get(key)
        if found is None:
            raise storage.NotFound(2, "no such object", key)
        data = found.data
        if start is not None:
            data = data[start:] if length is None else data[start : start + length]
        return storage.Got(data, found.generation, len(found.data), dict(found.metadata), None)

    def head(self, key: str) -> storage.Head:
        got = self.get(key, start=0, length=0)
        return storage.Head(got.size, got.token, got.metadata)

    def delete(self, key: str) -> None:
        with self._bucket.guard:
            self._bucket.objects.pop(key, None)

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.delete(key)

    def list(
        self, prefix: str, *, delimiter: str | None = "/", limit: int | None = None
    ) -> tuple[list[tuple[str, int]], list[str]]:
        with self._bucket.guard:
            keys = sorted((k, len(o.data)) for k, o in self._bucket.objects.items() if k.startswith(prefix))
        objects: list[tuple[str, int]] = []
        prefixes: list[str] = []
        for key, size in keys:
            rest = key[len(prefix) :]
            if delimiter and delimiter in rest:
                sub = prefix + rest.split(delimiter)[0] + delimiter
                if sub not in prefixes:
                    prefixes.append(sub)
            else:
                objects.append((key, size))
            if limit is not None and len(objects) + len(prefixes) >= limit:
                break
        return objects, prefixes

    def start_upload(self, key: str) -> str:
        upload_id = f"u{next(_counter)}"
        with self._bucket.guard:
            self._bucket.uploads[upload_id] = (key, {})
        return upload_id

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | memoryview) -> Any:
        with self._bucket.guard:
            if upload_id not in self._bucket.uploads:
                raise storage.NotFound(2, "no such upload", key)
            self._bucket.uploads[upload_id][1][number] = bytes(data)
        return number

    def finish_upload(self, key: str, upload_id: str, parts: list[Any]) -> str:
        with self._bucket.guard:
            found = self._bucket.uploads.pop(upload_id, None)
        if found is None:
            raise storage.NotFound(2, "no such upload", key)
        return self.put(key, b"".join(found[1][n] for n in parts))

    def abort_upload(self, key: str, upload_id: str) -> None:
        with self._bucket.guard:
            self._bucket.uploads.pop(upload_id, None)

    def uploads(self, prefix: str) -> list[tuple[str, str]]:
        with self._bucket.guard:
            return [(k, i) for i, (k, _) in self._bucket.uploads.items() if k.startswith(prefix)]

    def upload_size(self, key: str, upload_id: str) -> int:
        with self._bucket.guard:
            found = self._bucket.uploads.get(upload_id)
        return 0 if found is None else sum(len(p) for p in found[1].values())

    def explain(self, error: OSError) -> tuple[str, str]:
        return f"{type(error).__name__}: {error}", "check the test"


def open_root(url: str, *, ops: Any = None, options: Mapping[str, Any] | None = None) -> storage.Store:
    """``memory://bucket/prefix`` as a checkpoint root (the factory a backend registers)."""
    del ops, options
    rest = url.removeprefix("memory://")
    name, _, prefix = rest.partition("/")
    prefix = "".join(p + "/" for p in prefix.split("/") if p)
    return storage.ObjectRootStore(
        MemoryClient(name), url.rstrip("/"), prefix, storage.Transfer(part_size=5 << 20, max_concurrency=4)
    )


def register() -> None:
    storage.register_store("memory", open_root)
