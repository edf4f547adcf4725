"""``make demo-s3``: the demo on an ``s3://`` root, against a local S3 server (moto) it starts itself.

Trains with async checkpoints to ``s3://demo/run``, is SIGKILLed mid-run, resumes from the newest
commit, and finishes; then an uninterrupted run in another prefix must end with the same weights
hash. Exits non-zero if anything differs. The server and its objects live only while this runs.
"""

from __future__ import annotations

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


def main() -> int:
    with tempfile.TemporaryDirectory() as work:
        server = S3Server(Path(work))
        server.start()
        try:
            os.environ.update(server.environ())
            import boto3

            boto3.client("s3").create_bucket(Bucket="demo")
            print(f"a local S3 server (moto) at {server.endpoint}, bucket 'demo'", flush=True)
            killed = _demo("s3://demo/run", "--kill-at", KILL_AT)
            if killed.returncode != -9:
                sys.exit(f"the run was to be killed at step {KILL_AT}, it exited {killed.returncode}")
            resumed = _demo("s3://demo/run")
            if "resumed from step" not in resumed.stdout:
                sys.exit("the second run did not resume")
            whole = _demo("s3://demo/uninterrupted")
            if _hash(resumed) != _hash(whole):
                sys.exit("the resumed run ended with other weights than the uninterrupted one")
            print(f"killed at step {KILL_AT}, resumed from S3, same final weights as an uninterrupted run")
            return 0
        finally:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
