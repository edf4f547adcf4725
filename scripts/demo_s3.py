"""``make demo-s3`` (``demo-gcs``, ``demo-azure``): the demo on an ``s3://`` root against a local S3
server (moto) it starts itself; with ``--store gcs``, on ``gs://`` against fake-gcs-server; with
``--store azure``, on ``az://`` against Azurite (npm, tests/npm).

Trains with async checkpoints to ``<scheme>://demo/run``, is SIGKILLed mid-run, resumes from the newest
commit, and finishes; then an uninterrupted run in another prefix must end with the same weights
hash. Exits non-zero if anything differs. The server and its objects live only while this runs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from s3_server import S3Server

STEPS, KILL_AT = "200", "120"


def _demo(root: str, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "safeckpt", "demo", "--dir", root, "--steps", STEPS, *extra]
    print("$", " ".join(command), flush=True)
    done = subprocess.run(command, text=True, stdout=subprocess.PIPE, stderr=None)
    print(done.stdout, flush=True)
    return done


def _hash(done: subprocess.CompletedProcess[str]) -> str:
    found = re.search(r"final weights sha256: (\w+)", done.stdout)
    if done.returncode != 0 or not found:
        sys.exit(f"the demo did not finish (exit {done.returncode})")
    return found.group(1)


def _start(store: str, work: Path) -> tuple[object, str]:
    """The store's local server, started, with a bucket (container) ``demo`` and the environment
    that reaches it; its root URL's base."""
    if store == "gcs":
        from gcs_server import FakeGcs, _binary

        server = FakeGcs(work, _binary())  # type: ignore[arg-type]
        server.start()
        server.make_bucket("demo")
        os.environ["STORAGE_EMULATOR_HOST"] = server.endpoint
        print(f"a local GCS server (fake-gcs-server) at {server.endpoint}, bucket 'demo'", flush=True)
        return server, "gs://demo"
    if store == "azure":
        from azurite_server import Azurite

        server = Azurite(work)
        server.start()
        server.make_container("demo")
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = server.connection_string
        print(f"a local Azure Blob server (Azurite) at {server.endpoint}, container 'demo'", flush=True)
        return server, "az://demo"
    server = S3Server(work)
    server.start()
    os.environ.update(server.environ())
    import boto3

    boto3.client("s3").create_bucket(Bucket="demo")
    print(f"a local S3 server (moto) at {server.endpoint}, bucket 'demo'", flush=True)
    return server, "s3://demo"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", choices=("s3", "gcs", "azure"), default="s3")
    store = parser.parse_args().store
    with tempfile.TemporaryDirectory() as work:
        server, base = _start(store, Path(work))
        try:
            killed = _demo(f"{base}/run", "--kill-at", KILL_AT)
            if killed.returncode != -9:
                sys.exit(f"the run was to be killed at step {KILL_AT}, it exited {killed.returncode}")
            resumed = _demo(f"{base}/run")
            if "resumed from step" not in resumed.stdout:
                sys.exit("the second run did not resume")
            whole = _demo(f"{base}/uninterrupted")
            if _hash(resumed) != _hash(whole):
                sys.exit("the resumed run ended with other weights than the uninterrupted one")
            print(f"killed at step {KILL_AT}, resumed from {base}: the final weights of an uninterrupted run")
            return 0
        finally:
            server.kill()  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
