"""Object storage that goes away, with the library's defaults: how long each call takes to end.

    .venv/bin/python benchmarks/bench_outage.py

A moto server (``tests/support/s3_server.py``) behind the fault proxy of the tests
(``tests/support/s3_proxy.py``), which plays the outage: its port closed (refused) or every
connection accepted and never answered (hang, the worst case: each attempt waits for its
timeouts). Measured with the defaults (``timeout`` 30 s, ``read_timeout`` 20 s, ``connect_timeout`` 5 s):

* a closed port at open: ``CheckpointManager(...)`` and ``safeckpt ls`` until their
  ``RootUnreachableError``, on a quiet machine and with every core busy (target: under 15 s);
* an outage mid-run, S3 only: ``wait()`` after a save, then ``close()`` (target: each within
  60 s of the outage's start);
* the same with ``local_dir``: a save and ``wait()`` (committed locally), ``wait(durable=True)``
  and ``close()``.

Prints Markdown; exits 77 without moto.
"""

from __future__ import annotations

import multiprocessing
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

import torch

from bench_moto import with_bucket
from s3_proxy import S3FaultProxy

TARGET_OPEN = 15.0
TARGET_CALL = 60.0


def _busy() -> None:
    while True:
        pass


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until_error(call: Callable[[], object]) -> tuple[float, str]:
    started = time.monotonic()
    try:
        call()
    except Exception as e:
        return time.monotonic() - started, type(e).__name__
    return time.monotonic() - started, "no error"


def main() -> int:
    import os

    from safeckpt import CheckpointManager

    def run(endpoint: str, bucket: str) -> int:
        rows: list[tuple[str, str, float, str, float]] = []
        state = {"w": torch.zeros(1 << 20)}

        # --- a closed port at open --------------------------------------------------------------
        for load in ("quiet", "every core busy"):
            hogs = []
            if load != "quiet":
                hogs = [
                    multiprocessing.Process(target=_busy, daemon=True) for _ in range(os.cpu_count() or 2)
                ]
                for hog in hogs:
                    hog.start()
            try:
                saved = os.environ["AWS_ENDPOINT_URL"]
                os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{_closed_port()}"
                try:
                    took, what = _until_error(
                        lambda: CheckpointManager(f"s3://{bucket}/closed-{uuid.uuid4().hex}")
                    )
                    rows.append(("closed port", f"CheckpointManager(), {load}", took, what, TARGET_OPEN))
                    started = time.monotonic()
                    done = subprocess.run(
                        [sys.executable, "-m", "safeckpt", "ls", f"s3://{bucket}/closed"],
                        capture_output=True,
                        text=True,
                    )
                    said = "cannot be reached" if "cannot be reached" in done.stderr else "another error"
                    what = f"exit {done.returncode}, {said}" if done.returncode else "no error"
                    rows.append(
                        ("closed port", f"safeckpt ls, {load}", time.monotonic() - started, what, TARGET_OPEN)
                    )
                finally:
                    os.environ["AWS_ENDPOINT_URL"] = saved
            finally:
                for hog in hogs:
                    hog.kill()

        # --- an outage mid-run ------------------------------------------------------------------
        for how in ("refuse", "hang"):
            for tiered in (False, True):
                proxy = S3FaultProxy(endpoint).start()
                saved = os.environ["AWS_ENDPOINT_URL"]
                os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
                scratch = tempfile.mkdtemp()
                try:
                    url = f"s3://{bucket}/{how}-{'tiers' if tiered else 's3'}-{uuid.uuid4().hex[:6]}"
                    mgr = CheckpointManager(url, local_dir=f"{scratch}/local" if tiered else None)
                    mgr.save(1, state)
                    mgr.wait(durable=True) if tiered else mgr.wait()
                    proxy.go_down(how)
                    down = time.monotonic()
                    label = f"{how}, {'local_dir' if tiered else 'S3 only'}"
                    mgr.save(2, state)
                    took, what = _until_error(mgr.wait)
                    rows.append((label, "save(); wait()", took, what, TARGET_CALL))
                    if tiered:
                        took, what = _until_error(lambda m=mgr: m.wait(durable=True))
                        rows.append((label, "wait(durable=True)", took, what, TARGET_CALL))
                    took, what = _until_error(mgr.close)
                    rows.append((label, "close()", took, what, TARGET_CALL))
                    rows.append(
                        (label, "outage start to close() returned", time.monotonic() - down, "", TARGET_CALL)
                    )
                finally:
                    proxy.come_back()
                    proxy.stop()
                    os.environ["AWS_ENDPOINT_URL"] = saved
                print(f"{how}, tiered={tiered} done", file=sys.stderr)

        print("| outage | call | took (s) | ended with | target (s) | met |")
        print("|---|---|---|---|---|---|")
        for outage, call, took, what, target in rows:
            met = "yes" if took <= target else "NO"
            print(f"| {outage} | {call} | {took:.1f} | {what or '-'} | {target:g} | {met} |")
        print()
        print(
            "One run, the library's defaults (storage_options timeout 30 s, read_timeout 20 s, "
            f"connect_timeout 5 s); moto on 127.0.0.1 behind the tests' fault proxy; {os.cpu_count()} cores."
        )
        return 0

    return with_bucket("bench_outage", run)


if __name__ == "__main__":
    sys.exit(main())
