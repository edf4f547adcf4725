"""Which S3 client should safeckpt's S3 store use? boto3, obstore and s3fs, measured (not a test).

    .venv/bin/python benchmarks/s3_clients.py                      # 64 MiB, 200 x 4 KiB, 3 repeats
    .venv/bin/python benchmarks/s3_clients.py --repeats 5 --json out.json

Starts its own moto S3 server (tests/support/s3_server.py) on 127.0.0.1 and runs every client against it
in the same run, interleaved (the client order rotates each repetition), so the machine's noise
moves them together. For each client:

* one 64 MiB object: a single-stream PUT and GET, then a parallel multipart PUT (8 MiB parts,
  4 at a time) and parallel ranged GETs (8 MiB ranges, 4 at a time);
* 200 objects of 4 KiB: PUT each, then GET each, one after another (the per-request cost);
* which of the calls the S3 store needs it has, probed against the server (conditional PUTs,
  CRC32 sent on PUT, ranged GET, delimited LIST, batch delete, multipart list/abort).

Wall time and process CPU time (``time.process_time``: every thread of this process, not moto's)
are medians over the repetitions. moto is slow (a Python server), so absolute rates say little
about real S3; the ratio to the fastest client, and the client's own CPU, are what to compare.
Every client runs on its defaults otherwise (boto3 and s3fs compute a CRC32 per PUT since
botocore 1.36; obstore sends no checksum).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, moto_version

MIB = 1 << 20
BUCKET = "bench"


def _ranges(size: int, part: int) -> list[tuple[int, int]]:
    """(start, end exclusive) of each part."""
    return [(start, min(start + part, size)) for start in range(0, size, part)]


def _crc32_b64(data: bytes) -> str:
    import base64

    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


# --- the three clients, each with the same five operations ------------------------------------


class Boto3Client:
    name = "boto3"

    def __init__(self, endpoint: str, concurrency: int) -> None:
        import boto3
        from botocore.config import Config

        self.concurrency = concurrency
        self.s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
            config=Config(max_pool_connections=2 * concurrency),
        )
        self.pool = ThreadPoolExecutor(concurrency)  # boto3 clients are thread-safe

    def put(self, key: str, data: bytes) -> None:
        self.s3.put_object(Bucket=BUCKET, Key=key, Body=data)

    def get(self, key: str) -> bytes:
        return self.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()

    def put_multipart(self, key: str, data: bytes, part: int) -> None:
        upload = self.s3.create_multipart_upload(Bucket=BUCKET, Key=key, ChecksumAlgorithm="CRC32")
        view = memoryview(data)

        def one(n: int, start: int, end: int) -> dict[str, Any]:
            r = self.s3.upload_part(
                Bucket=BUCKET,
                Key=key,
                UploadId=upload["UploadId"],
                PartNumber=n,
                Body=view[start:end].tobytes(),
                ChecksumAlgorithm="CRC32",
            )
            return {"PartNumber": n, "ETag": r["ETag"], "ChecksumCRC32": r.get("ChecksumCRC32")}

        try:
            futures = [self.pool.submit(one, n, s, e) for n, (s, e) in enumerate(_ranges(len(data), part), 1)]
            parts = [{k: v for k, v in f.result().items() if v} for f in futures]
            self.s3.complete_multipart_upload(
                Bucket=BUCKET, Key=key, UploadId=upload["UploadId"], MultipartUpload={"Parts": parts}
            )
        except BaseException:
            self.s3.abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload["UploadId"])
            raise

    def get_ranged(self, key: str, size: int, part: int) -> bytes:
        out = bytearray(size)

        def one(start: int, end: int) -> None:
            body = self.s3.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={start}-{end - 1}")["Body"]
            out[start:end] = body.read()

        for f in [self.pool.submit(one, s, e) for s, e in _ranges(size, part)]:
            f.result()
        return bytes(out)

    def close(self) -> None:
        self.pool.shutdown()


class ObstoreClient:
    name = "obstore"

    def __init__(self, endpoint: str, concurrency: int) -> None:
        from obstore.store import S3Store

        self.concurrency = concurrency
        self.store = S3Store(
            BUCKET,
            endpoint=endpoint,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            region=REGION,
            client_options={"allow_http": True},
        )
        self.loop = asyncio.new_event_loop()  # one loop for the ranged GETs, as a store would keep

    def put(self, key: str, data: bytes) -> None:
        import obstore

        obstore.put(self.store, key, data, use_multipart=False)

    def get(self, key: str) -> bytes:
        import obstore

        return bytes(obstore.get(self.store, key).bytes())

    def put_multipart(self, key: str, data: bytes, part: int) -> None:
        import obstore

        obstore.put(
            self.store, key, data, use_multipart=True, chunk_size=part, max_concurrency=self.concurrency
        )

    def get_ranged(self, key: str, size: int, part: int) -> bytes:
        # Not obstore.get_ranges: it coalesces adjacent ranges into one request (no parallelism).
        import obstore

        out = bytearray(size)
        gate = asyncio.Semaphore(self.concurrency)

        async def one(start: int, end: int) -> None:
            async with gate:
                out[start:end] = await obstore.get_range_async(self.store, key, start=start, end=end)

        async def every() -> None:
            await asyncio.gather(*(one(s, e) for s, e in _ranges(size, part)))

        self.loop.run_until_complete(every())
        return bytes(out)

    def close(self) -> None:
        self.loop.close()


class S3fsClient:
    name = "s3fs"

    def __init__(self, endpoint: str, concurrency: int) -> None:
        import s3fs

        self.concurrency = concurrency
        self.fs = s3fs.S3FileSystem(
            key=ACCESS_KEY,
            secret=SECRET_KEY,
            endpoint_url=endpoint,
            client_kwargs={"region_name": REGION},
            max_concurrency=concurrency,
            skip_instance_cache=True,
            use_listings_cache=False,
        )

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(f"{BUCKET}/{key}", data)  # one PUT below 2 x 50 MiB chunks

    def get(self, key: str) -> bytes:
        return self.fs.cat_file(f"{BUCKET}/{key}", max_concurrency=1)

    def put_multipart(self, key: str, data: bytes, part: int) -> None:
        self.fs.pipe_file(f"{BUCKET}/{key}", data, chunksize=part, max_concurrency=self.concurrency)

    def get_ranged(self, key: str, size: int, part: int) -> bytes:
        # s3fs asks for the size itself (a HEAD) before its concurrent ranged GETs.
        return self.fs.cat_file(f"{BUCKET}/{key}", chunksize=part, max_concurrency=self.concurrency)

    def close(self) -> None:
        pass


CLIENTS: dict[str, Callable[[str, int], Any]] = {
    "boto3": Boto3Client,
    "obstore": ObstoreClient,
    "s3fs": S3fsClient,
}


# --- timing ------------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def run_one(client: Any, big: bytes, small: bytes, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    """One repetition of every measurement for one client: {op: (wall_s, cpu_s)}."""
    part = args.part_mib * MIB
    tag = f"{client.name}/r{rep}"
    out: dict[str, Any] = {}

    def measure(op: str, fn: Callable[[], Any], expect: bytes | None = None) -> None:
        wall, cpu, result = _timed(fn)
        if expect is not None and result != expect:  # outside the timing: costs every client alike
            raise AssertionError(f"{client.name} {op}: wrong bytes back")
        out[op] = (wall, cpu)

    measure("put single", lambda: client.put(f"{tag}/big1", big))
    measure("get single", lambda: client.get(f"{tag}/big1"), big)
    measure("put multipart", lambda: client.put_multipart(f"{tag}/big2", big, part))
    measure("get ranged", lambda: client.get_ranged(f"{tag}/big2", len(big), part), big)
    keys = [f"{tag}/small/{i:04d}" for i in range(args.small_count)]
    measure("put small", lambda: [client.put(k, small) for k in keys])
    got: list[bytes] = []
    measure("get small", lambda: got.extend(client.get(k) for k in keys))
    if any(g != small for g in got):
        raise AssertionError(f"{client.name} get small: wrong bytes back")
    return out


# --- capabilities: each tried against the server -----------------------------------------------

# How each client is called for what the S3 store needs (the probes below run these very calls).
CALLS: dict[str, dict[str, str]] = {
    "boto3": {
        "PUT If-None-Match: *": 's3.put_object(Bucket=b, Key=k, Body=d, IfNoneMatch="*")',
        "PUT If-Match ETag": "s3.put_object(Bucket=b, Key=k, Body=d, IfMatch=etag)",
        "CRC32 on PUT": 's3.put_object(..., ChecksumAlgorithm="CRC32") or ChecksumCRC32=b64',
        "ranged GET": 's3.get_object(..., Range="bytes=a-b")',
        "LIST with delimiter": 's3.list_objects_v2(Bucket=b, Prefix=p, Delimiter="/")',
        "DeleteObjects batch": 's3.delete_objects(Bucket=b, Delete={"Objects": [...]})',
        "multipart list/abort": "s3.list_multipart_uploads(Bucket=b), s3.abort_multipart_upload(...)",
    },
    "obstore": {
        "PUT If-None-Match: *": 'obstore.put(store, k, d, mode="create")',
        "PUT If-Match ETag": 'obstore.put(store, k, d, mode={"e_tag": etag})',
        "CRC32 on PUT": "no: S3Store(checksum_algorithm=) takes SHA256 or CRC64NVME only",
        "ranged GET": "obstore.get_range(store, k, start=a, end=b)",
        "LIST with delimiter": "obstore.list_with_delimiter(store, prefix)",
        "DeleteObjects batch": "obstore.delete(store, [k1, k2, ...])",
        "multipart list/abort": "no: aborts its own failed put; cannot list or abort others'",
    },
    "s3fs": {
        "PUT If-None-Match: *": 'fs.pipe_file(path, d, mode="create")',
        "PUT If-Match ETag": "fs.pipe_file(path, d, IfMatch=etag)  (kwargs go to put_object)",
        "CRC32 on PUT": 'fs.pipe_file(path, d, ChecksumAlgorithm="CRC32")  (kwargs go to put_object)',
        "ranged GET": "fs.cat_file(path, start=a, end=b)",
        "LIST with delimiter": "fs.ls(prefix, detail=True)",
        "DeleteObjects batch": "fs.rm([path1, path2, ...])",
        "multipart list/abort": "fs.list_multipart_uploads(bucket), fs.clear_multipart_uploads(bucket)",
    },
}

WRONG_ETAG = '"' + "0" * 32 + '"'


def _refused(fn: Callable[[], Any]) -> bool:
    try:
        fn()
    except Exception:
        return True
    return False


def probe(client: Any, server: S3Server) -> dict[str, str]:
    """Each capability: 'yes', 'no' or 'partial' with what was seen, from real calls."""
    name, p, seen = client.name, f"probe-{client.name}", {}
    batches = _batch_deletes(server)
    data = b"probe data"
    head = Boto3Client(server.endpoint, 1).s3  # to look at what the server stored, client-neutral

    def stored_crc(key: str) -> str | None:
        return head.head_object(Bucket=BUCKET, Key=key, ChecksumMode="ENABLED").get("ChecksumCRC32")

    if name == "boto3":
        s3 = client.s3
        s3.put_object(Bucket=BUCKET, Key=f"{p}/c", Body=data, IfNoneMatch="*")
        inm = _refused(lambda: s3.put_object(Bucket=BUCKET, Key=f"{p}/c", Body=data, IfNoneMatch="*"))
        etag = s3.head_object(Bucket=BUCKET, Key=f"{p}/c")["ETag"]
        bad = _refused(lambda: s3.put_object(Bucket=BUCKET, Key=f"{p}/c", Body=data, IfMatch=WRONG_ETAG))
        good = not _refused(lambda: s3.put_object(Bucket=BUCKET, Key=f"{p}/c", Body=data, IfMatch=etag))
        s3.put_object(Bucket=BUCKET, Key=f"{p}/crc", Body=data, ChecksumAlgorithm="CRC32")
        crc_sent = stored_crc(f"{p}/crc") == _crc32_b64(data)
        wrong = _crc32_b64(b"something else")
        crc_checked = _refused(
            lambda: s3.put_object(Bucket=BUCKET, Key=f"{p}/crc2", Body=data, ChecksumCRC32=wrong)
        )
        ranged = s3.get_object(Bucket=BUCKET, Key=f"{p}/c", Range="bytes=2-5")["Body"].read() == data[2:6]
        listed = s3.list_objects_v2(Bucket=BUCKET, Prefix="", Delimiter="/")
        delim = {"prefix": f"{p}/"} in [{"prefix": c["Prefix"]} for c in listed.get("CommonPrefixes", [])]
        s3.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": f"{p}/crc"}, {"Key": f"{p}/c"}]})
        deleted = not {f"{p}/c", f"{p}/crc"} & set(_keys(head, p + "/"))
        up = s3.create_multipart_upload(Bucket=BUCKET, Key=f"{p}/mpu")
        listed_up = any(u["UploadId"] == up["UploadId"] for u in _uploads(head))
        s3.abort_multipart_upload(Bucket=BUCKET, Key=f"{p}/mpu", UploadId=up["UploadId"])
        mpu = listed_up and not _uploads(head)
    elif name == "obstore":
        import obstore

        st = client.store
        obstore.put(st, f"{p}/c", data, mode="create")
        inm = _refused(lambda: obstore.put(st, f"{p}/c", data, mode="create"))
        etag = obstore.head(st, f"{p}/c")["e_tag"]
        bad = _refused(lambda: obstore.put(st, f"{p}/c", data, mode={"e_tag": WRONG_ETAG}))
        good = not _refused(lambda: obstore.put(st, f"{p}/c", data, mode={"e_tag": etag}))
        obstore.put(st, f"{p}/crc", data)
        crc_sent = crc_checked = False  # no API for it (see CALLS)
        ranged = bytes(obstore.get_range(st, f"{p}/c", start=2, end=6)) == data[2:6]
        listed = obstore.list_with_delimiter(st, None)
        delim = f"{p}" in [c.rstrip("/") for c in listed["common_prefixes"]]
        obstore.delete(st, [f"{p}/crc", f"{p}/c"])
        deleted = not {f"{p}/c", f"{p}/crc"} & set(_keys(head, p + "/"))
        listed_up = mpu = False
    else:
        fs, b = client.fs, f"{BUCKET}/{p}"
        fs.pipe_file(f"{b}/c", data, mode="create")
        inm = _refused(lambda: fs.pipe_file(f"{b}/c", data, mode="create"))
        etag = fs.info(f"{b}/c")["ETag"]
        bad = _refused(lambda: fs.pipe_file(f"{b}/c", data, IfMatch=WRONG_ETAG))
        good = not _refused(lambda: fs.pipe_file(f"{b}/c", data, IfMatch=etag))
        fs.pipe_file(f"{b}/crc", data, ChecksumAlgorithm="CRC32")
        crc_sent = stored_crc(f"{p}/crc") == _crc32_b64(data)
        wrong = _crc32_b64(b"something else")
        crc_checked = _refused(lambda: fs.pipe_file(f"{b}/crc2", data, ChecksumCRC32=wrong))
        ranged = fs.cat_file(f"{b}/c", start=2, end=6) == data[2:6]
        delim = f"{b}" in fs.ls(BUCKET, detail=False, refresh=True)
        fs.rm([f"{b}/crc", f"{b}/c"])
        deleted = not {f"{p}/c", f"{p}/crc"} & set(_keys(head, p + "/"))
        up = head.create_multipart_upload(Bucket=BUCKET, Key=f"{p}/mpu")
        listed_up = any(u["UploadId"] == up["UploadId"] for u in fs.list_multipart_uploads(BUCKET))
        fs.clear_multipart_uploads(BUCKET)
        mpu = listed_up and not _uploads(head)

    seen["PUT If-None-Match: *"] = _yes(inm, "412 refused")
    seen["PUT If-Match ETag"] = _yes(bad and good, "wrong ETag refused, right one taken")
    seen["CRC32 on PUT"] = (
        ("yes, stored by moto" + ("; a wrong one is refused" if crc_checked else "; a wrong one is accepted"))
        if crc_sent
        else "no"
    )
    seen["ranged GET"] = _yes(ranged, "")
    seen["LIST with delimiter"] = _yes(delim, "")
    batched = _batch_deletes(server) > batches  # one POST ?delete, not a DELETE per key
    seen["DeleteObjects batch"] = _yes(deleted and batched, "") if deleted else "no (not deleted)"
    seen["multipart list/abort"] = _yes(mpu, "")
    _clear(head, p)
    return seen


def _yes(ok: bool, how: str) -> str:
    return ("yes" + (f" ({how})" if how else "")) if ok else "no"


def _batch_deletes(server: S3Server) -> int:
    """DeleteObjects requests the server has logged so far (``POST /bucket?delete``)."""
    return sum("?delete" in line and "POST" in line for line in server.log_path.read_text().splitlines())


def _keys(s3: Any, prefix: str) -> list[str]:
    return [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]


def _uploads(s3: Any) -> list[dict[str, Any]]:
    return list(s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []))


def _clear(s3: Any, prefix: str) -> None:
    keys = _keys(s3, prefix)
    if keys:
        s3.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys]})


# --- report ------------------------------------------------------------------------------------

OPS = ["put single", "get single", "put multipart", "get ranged", "put small", "get small"]


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    medians = {
        name: {op: tuple(statistics.median(r[op][i] for r in reps) for i in (0, 1)) for op in OPS}
        for name, reps in results.items()
    }
    lines = [
        f"moto {moto_version()}, {args.size_mib} MiB object ({args.part_mib} MiB parts, "
        f"{args.concurrency} at a time), {args.small_count} x {args.small_kib} KiB objects, "
        f"median of {args.repeats}; ratio = wall / fastest client's wall for that operation",
        "",
        "| operation | " + " | ".join(f"{n} wall s (ratio) | {n} CPU s" for n in medians) + " |",
        "|---|" + "---|---|" * len(medians),
    ]
    for op in OPS:
        best = min(m[op][0] for m in medians.values())
        cells = [f"{m[op][0]:.2f} ({m[op][0] / best:.2f}x) | {m[op][1]:.2f}" for m in medians.values()]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    totals = {n: (sum(m[op][0] for op in OPS), sum(m[op][1] for op in OPS)) for n, m in medians.items()}
    best = min(t[0] for t in totals.values())
    cells = [f"{w:.2f} ({w / best:.2f}x) | {c:.2f}" for w, c in totals.values()]
    lines.append("| **all** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def capability_table(seen: dict[str, dict[str, str]]) -> str:
    names = list(seen)
    lines = ["| capability | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for cap in CALLS["boto3"]:
        lines.append(f"| {cap} | " + " | ".join(seen[n][cap] for n in names) + " |")
    lines += ["", "| capability | " + " | ".join(f"{n}: call" for n in names) + " |"]
    lines.append("|---|" + "---|" * len(names))
    for cap in CALLS["boto3"]:
        lines.append(f"| {cap} | " + " | ".join(f"`{CALLS[n][cap]}`" for n in names) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--clients", default="boto3,obstore,s3fs", help="comma-separated, of: " + ",".join(CLIENTS)
    )
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--part-mib", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--small-count", type=int, default=200)
    parser.add_argument("--small-kib", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the raw timings and capabilities here")
    args = parser.parse_args()
    names = [n.strip() for n in args.clients.split(",") if n.strip()]

    big = os.urandom(args.size_mib * MIB)
    small = os.urandom(args.small_kib * 1024)
    with tempfile.TemporaryDirectory(prefix="s3bench-") as tmp:
        server = S3Server(Path(tmp))
        server.start()
        try:
            clients = [CLIENTS[n](server.endpoint, args.concurrency) for n in names]
            head = Boto3Client(server.endpoint, 1).s3
            head.create_bucket(Bucket=BUCKET)
            for client in clients:  # first-call costs (sessions, credentials, pools) out of the timings
                client.put("warmup", small)
                client.get("warmup")
            results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            for rep in range(args.repeats):
                order = clients[rep % len(clients) :] + clients[: rep % len(clients)]
                for client in order:
                    results[client.name].append(run_one(client, big, small, args, rep))
                    _clear(head, f"{client.name}/r{rep}/")  # moto holds everything in RAM
                    print(f"rep {rep} {client.name} done", file=sys.stderr, flush=True)
            seen = {c.name: probe(c, server) for c in clients}
            for c in clients:
                c.close()
        finally:
            server.kill()
    print(report(results, args))
    print()
    print(capability_table(seen))
    if args.json:
        args.json.write_text(json.dumps({"timings": results, "capabilities": seen}, indent=1))


if __name__ == "__main__":
    main()
