"""A training process on an ``s3://`` root that SIGKILLs itself at its N-th S3 request (test_s3_crash.py).

Every request safeckpt makes goes through ``safeckpt._s3.client.S3Client._retrying`` (each page of
a listing too); this worker counts them and kills itself at the N-th, before it is sent.
Each commit it knows of is appended to a log with an unbuffered write, so the test knows what
was durable before the kill. Without N it prints how many requests the whole run made.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch

from safeckpt import CheckpointManager, Retention
from safeckpt._objstore import lease as s3_lease
from safeckpt._s3 import client as s3_client

# A kill while holding the root's lease makes the next start wait for it to expire: the lease this
# process writes (and its successor honours) is short, so each kill costs seconds, not 30.
s3_lease.LEASE_SECONDS = 4.0

STEPS = (1, 2, 3, 4)


def main() -> None:
    root, kill_at, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    count = 0
    lock = threading.Lock()

    def tick() -> None:
        nonlocal count
        with lock:
            count += 1
            if count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    real = s3_client.S3Client._retrying  # every request (and each page of a listing) goes through it

    def request(self, key, attempt):  # type: ignore[no-untyped-def]
        tick()
        return real(self, key, attempt)

    s3_client.S3Client._retrying = request  # type: ignore[method-assign]
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    state = {"w": torch.zeros(1 << 12), "step": 0}
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=2)) as mgr:
        start = mgr.restore(state).step or 0
        for step in STEPS:
            if step <= start:
                continue
            state["w"].fill_(float(step))
            state["step"] = step
            mgr.save(step, state)
            os.write(fd, f"{step}\n".encode())
    print(count, flush=True)


if __name__ == "__main__":
    main()
