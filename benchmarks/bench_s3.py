"""Checkpoints on ``s3://``: safeckpt against a raw upload and the peers, on one S3 server, in one run.

    .venv/bin/python benchmarks/bench_s3.py [--size-mib 192] [--reps 5]

Starts its own moto server on 127.0.0.1 (``tests/s3_server.py``): moto keeps objects in memory
and serves them from Python, so absolute times are the server's, and the rows compare safeckpt
with what moves the same bytes to the same server:

* the limit: the tensors' bytes uploaded raw (one object per file, boto3's TransferManager with
  the same part size and concurrency) and read back the same way;
* ``torch.save`` into memory, then that upload (and ``torch.load`` of a download);
* DCP's own fsspec writer and reader (``dcp.save``/``dcp.load`` on an ``s3://`` path, s3fs),
  when s3fs is installed.

Rows: how long an async ``save()`` blocks training against a memcpy of the same tensors; the
time until the checkpoint is committed (``wait()`` returns) and a cold restore, each against
the limit. Prints Markdown.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import safeckpt
from bench_common import build_state, host_buffers, memcpy
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, moto_version

MIB = 1 << 20
PART = 16 * MIB
CONCURRENCY = 8


def _median(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _client(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=REGION,
    )


def _transfer() -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=192)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)

    server = S3Server(Path(os.environ.get("TMPDIR", "/tmp")))
    server.start()
    try:
        return _run(server.endpoint, args.size_mib * MIB, args.reps)
    finally:
        server.kill()


def _run(endpoint: str, size: int, reps: int) -> int:
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_REGION=REGION,
        AWS_DEFAULT_REGION=REGION,
    )
    client = _client(endpoint)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    bench = build_state(size, optimizer=True)
    tensors = list(bench.flat().values())
    buffers = host_buffers(tensors)
    nbytes = bench.nbytes
    options = {"part_size": PART, "max_concurrency": CONCURRENCY}
    rows: dict[str, float] = {}

    rows["memcpy"] = _median(lambda: memcpy(tensors, buffers), reps)

    # The limit: the tensors' bytes as one raw object, uploaded and downloaded by TransferManager.
    raw = b"".join(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    rows["raw upload"] = _median(
        lambda: client.upload_fileobj(io.BytesIO(raw), bucket, "raw/blob", Config=_transfer()), reps
    )
    rows["raw download"] = _median(
        lambda: client.download_fileobj(bucket, "raw/blob", io.BytesIO(), Config=_transfer()), reps
    )

    # safeckpt: async save (blocking, then until committed), and a cold restore in a new manager.
    root = f"s3://{bucket}/safeckpt"
    blocking, durable = [], []
    # Every save kept, as in the local row: a prune's deletes would run beside the next save, on
    # a server that shares this machine's cores (S3's deletes run on S3's machines).
    with safeckpt.CheckpointManager(root, async_save=True, storage_options=options) as mgr:
        for step in range(reps + 1):
            start = time.perf_counter()
            mgr.save(step, bench.state)
            blocked = time.perf_counter() - start
            mgr.wait()
            if step:  # the first save allocates the staging buffers
                blocking.append(blocked)
                durable.append(time.perf_counter() - start)
    rows["safeckpt async save, blocking"] = statistics.median(blocking)
    rows["same, to a local directory"] = _local_blocking(bench, reps)
    rows["safeckpt save, until committed"] = statistics.median(durable)

    def restore() -> None:
        with safeckpt.CheckpointManager(root, read_only=True, storage_options=options) as mgr:
            mgr.restore(bench.state)

    rows["safeckpt cold restore"] = _median(restore, reps)

    # torch.save into memory, then the upload; torch.load of the download.
    flat = bench.flat()

    def torch_save() -> None:
        buffer = io.BytesIO()
        torch.save(flat, buffer)
        buffer.seek(0)
        client.upload_fileobj(buffer, bucket, "torch/ckpt.pt", Config=_transfer())

    def torch_load() -> None:
        buffer = io.BytesIO()
        client.download_fileobj(bucket, "torch/ckpt.pt", buffer, Config=_transfer())
        buffer.seek(0)
        torch.load(buffer, weights_only=True)

    rows["torch.save + upload"] = _median(torch_save, reps)
    rows["download + torch.load"] = _median(torch_load, reps)

    peers_note = ""
    try:
        import s3fs  # noqa: F401
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        def dcp_save() -> None:
            dcp.save(flat, storage_writer=FsspecWriter(f"s3://{bucket}/dcp", sync_files=False), no_dist=True)

        def dcp_load() -> None:
            dcp.load(flat, storage_reader=FsspecReader(f"s3://{bucket}/dcp"), no_dist=True)

        rows["dcp.save (fsspec writer)"] = _median(dcp_save, reps)
        rows["dcp.load (fsspec reader)"] = _median(dcp_load, reps)
    except ImportError as e:
        peers_note = f"DCP's fsspec writer not measured ({e})."

    print(_markdown(rows, nbytes, reps, peers_note))
    return 0


def _local_blocking(bench: Any, reps: int) -> float:
    """The same async save's blocking time on a local root: what S3 adds to it is the difference."""
    times = []
    with tempfile.TemporaryDirectory() as tmp, safeckpt.CheckpointManager(Path(tmp) / "run") as mgr:
        for step in range(reps + 1):
            start = time.perf_counter()
            mgr.save(step, bench.state)
            times.append(time.perf_counter() - start)
            mgr.wait()
    return statistics.median(times[1:])


def _markdown(rows: dict[str, float], nbytes: int, reps: int, note: str) -> str:
    def line(name: str, limit: str) -> str:
        return f"| {name} | {rows[name] * 1000:.0f} ms | {rows[name] / rows[limit]:.2f}x {limit} |"

    out = [
        f"State: {nbytes / MIB:.0f} MiB (a transformer and its AdamW moments, fp32); moto "
        f"{moto_version()} on 127.0.0.1; parts of {PART // MIB} MiB, {CONCURRENCY} at once; "
        f"median of {reps}.",
        "",
        "| row | time | ratio |",
        "|---|---:|---:|",
        line("safeckpt async save, blocking", "memcpy"),
        line("same, to a local directory", "memcpy"),
        line("safeckpt save, until committed", "raw upload"),
        line("torch.save + upload", "raw upload"),
    ]
    if "dcp.save (fsspec writer)" in rows:
        out.append(line("dcp.save (fsspec writer)", "raw upload"))
    out += [line("safeckpt cold restore", "raw download"), line("download + torch.load", "raw download")]
    if "dcp.load (fsspec reader)" in rows:
        out.append(line("dcp.load (fsspec reader)", "raw download"))
    out += [
        f"| memcpy (the blocking limit) | {rows['memcpy'] * 1000:.0f} ms | |",
        f"| raw upload (the save limit) | {rows['raw upload'] * 1000:.0f} ms | |",
        f"| raw download (the restore limit) | {rows['raw download'] * 1000:.0f} ms | |",
    ]
    if note:
        out += ["", note]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
