"""Checkpoints on ``s3://``: safeckpt against a raw upload and the peers, on one S3 server, in one run.

    .venv/bin/python benchmarks/bench_s3.py [--size-mib 192] [--reps 5]
    .venv/bin/python benchmarks/run_all.py --only bench_s3     # into benchmarks/results.md

Starts its own moto server on 127.0.0.1 (``tests/support/s3_server.py``): moto keeps objects in memory
and serves them from Python, so absolute times are the server's, and the rows compare safeckpt
with what moves the same bytes to the same server:

* the limit: the tensors' bytes uploaded raw (one object per file, boto3's TransferManager with
  the same part size and concurrency) and read back the same way;
* ``torch.save`` into memory, then that upload (and ``torch.load`` of a download);
* DCP's own fsspec writer and reader (``dcp.save``/``dcp.load`` on an ``s3://`` path, s3fs),
  when s3fs is installed.

Rows: how long an async ``save()`` blocks training against a memcpy of the same tensors; the
time until the checkpoint is committed (``wait()`` returns) and a cold restore, each against
the limit. Each row is timed in rounds beside its limit (see ``_rounds``), and its ratio is
the median of the rounds' ratios, with their range. Prints Markdown; exits 77 without moto.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

import safeckpt
from bench_common import build_state, host_buffers, memcpy, rotated_rounds
from bench_moto import client as s3_client
from bench_moto import with_bucket
from s3_server import moto_version

MIB = 1 << 20
PART = 16 * MIB
CONCURRENCY = 8


def _transfer() -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=192)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)

    return with_bucket(
        "bench_s3", lambda endpoint, bucket: _run(endpoint, bucket, args.size_mib * MIB, args.reps)
    )


def _run(endpoint: str, bucket: str, size: int, reps: int) -> int:
    client = s3_client(endpoint)
    bench = build_state(size, optimizer=True)
    tensors = list(bench.flat().values())
    buffers = host_buffers(tensors)
    nbytes = bench.nbytes
    options = {"part_size": PART, "max_concurrency": CONCURRENCY}
    times: dict[str, list[float]] = {}

    # The limits: a memcpy of the tensors into preallocated buffers; their bytes as one raw object,
    # uploaded and downloaded by TransferManager.
    raw = b"".join(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    flat = bench.flat()

    def raw_upload() -> None:
        client.upload_fileobj(io.BytesIO(raw), bucket, "raw/blob", Config=_transfer())

    def raw_download() -> None:
        client.download_fileobj(bucket, "raw/blob", io.BytesIO(), Config=_transfer())

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

    peers_note = ""
    save_peers: dict[str, Callable[[], Any]] = {"torch.save + upload": torch_save}
    load_peers: dict[str, Callable[[], Any]] = {"download + torch.load": torch_load}
    try:
        import s3fs  # noqa: F401
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        def dcp_save() -> None:
            dcp.save(flat, storage_writer=FsspecWriter(f"s3://{bucket}/dcp", sync_files=False), no_dist=True)

        def dcp_load() -> None:
            dcp.load(flat, storage_reader=FsspecReader(f"s3://{bucket}/dcp"), no_dist=True)

        save_peers["dcp.save (fsspec writer)"] = dcp_save
        load_peers["dcp.load (fsspec reader)"] = dcp_load
    except ImportError as e:
        peers_note = f"DCP's fsspec writer not measured ({e})."

    # safeckpt: an async save (how long save() blocks, then until wait() returns: committed), beside
    # the same save to a local root; then a cold restore in a new manager. Every save is kept, as
    # a prune's deletes would run on this machine's cores (S3's deletes run on S3's machines).
    root = f"s3://{bucket}/safeckpt"
    blocked: dict[str, list[float]] = {"s3": [], "local": []}
    with (
        tempfile.TemporaryDirectory() as tmp,
        safeckpt.CheckpointManager(root, async_save=True, storage_options=options) as on_s3,
        safeckpt.CheckpointManager(Path(tmp) / "run", async_save=True) as local,
    ):
        steps = iter(range(1, 1 << 30))

        def save(mgr: safeckpt.CheckpointManager, where: str) -> None:
            start = time.perf_counter()
            mgr.save(next(steps), bench.state)
            blocked[where].append(time.perf_counter() - start)
            mgr.wait()

        for mgr, where in ((on_s3, "s3"), (local, "local")):  # the first save allocates the staging buffers
            save(mgr, where)
            blocked[where].clear()
        times |= rotated_rounds(
            {
                "memcpy": lambda: memcpy(tensors, buffers),
                "raw upload": raw_upload,
                "safeckpt save, until committed": lambda: save(on_s3, "s3"),
                "same, to a local directory": lambda: save(local, "local"),
                **save_peers,
            },
            reps,
        )
    times["safeckpt async save, blocking"] = blocked["s3"]
    times["same, to a local directory"] = blocked["local"]

    def restore() -> None:
        with safeckpt.CheckpointManager(root, read_only=True, storage_options=options) as mgr:
            mgr.restore(bench.state)

    times |= rotated_rounds(
        {"raw download": raw_download, "safeckpt cold restore": restore, **load_peers}, reps
    )

    print(_markdown(times, nbytes, reps, peers_note))
    return 0


def _markdown(times: dict[str, list[float]], nbytes: int, reps: int, note: str) -> str:
    def line(name: str, limit: str) -> str:
        # The ratio to the limit timed in the same round: the median of the rounds and their spread.
        ratios = [t / lim for t, lim in zip(times[name], times[limit], strict=True)]
        return (
            f"| {name} | {statistics.median(times[name]) * 1000:.0f} ms | "
            f"{statistics.median(ratios):.2f}x {limit} | {min(ratios):.2f}-{max(ratios):.2f}x |"
        )

    def limit(name: str, what: str) -> str:
        return f"| {name} ({what}) | {statistics.median(times[name]) * 1000:.0f} ms | | |"

    out = [
        f"State: {nbytes / MIB:.0f} MiB (a transformer and its AdamW moments, fp32); moto "
        f"{moto_version()} on 127.0.0.1; parts of {PART // MIB} MiB, {CONCURRENCY} at once; "
        f"{reps} rounds, each timing every row of its group once, in a rotated order: median "
        "time, median of the rounds' ratios to the limit timed in the same round, and their range.",
        "",
        "| row | time | ratio | rounds |",
        "|---|---:|---:|---:|",
        line("safeckpt async save, blocking", "memcpy"),
        line("same, to a local directory", "memcpy"),
        line("safeckpt save, until committed", "raw upload"),
        line("torch.save + upload", "raw upload"),
    ]
    if "dcp.save (fsspec writer)" in times:
        out.append(line("dcp.save (fsspec writer)", "raw upload"))
    out += [line("safeckpt cold restore", "raw download"), line("download + torch.load", "raw download")]
    if "dcp.load (fsspec reader)" in times:
        out.append(line("dcp.load (fsspec reader)", "raw download"))
    out += [
        limit("memcpy", "the blocking limit"),
        limit("raw upload", "the save limit"),
        limit("raw download", "the restore limit"),
    ]
    if note:
        out += ["", note]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
