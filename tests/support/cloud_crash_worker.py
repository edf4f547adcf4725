"""A training process on a ``gs://`` or ``az://`` root that SIGKILLs itself at its N-th request
(test_cloud_stores.py): the GCS and Azure clients send every request through
``safeckpt._objstore.http.Http.request`` (each chunk, block and listing page too), which this
worker counts, killing itself at the N-th before it is sent. Each commit it knows of is
appended to a log unbuffered. Without N it prints how many requests the whole run made.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch

from safeckpt import CheckpointManager, Retention
from safeckpt._objstore import http
from safeckpt._objstore import lease as object_lease

object_lease.LEASE_SECONDS = 4.0  # a kill while holding the lease costs its successor seconds, not 20

STEPS = (1, 2, 3)
# Large enough that the data file goes up in parts (GCS: resumable chunks; Azure: blocks).
OPTIONS = {"part_size": 256 << 10, "max_concurrency": 2}


def main() -> None:
    root, kill_at, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    count = 0
    lock = threading.Lock()
    real = http.Http.request

    def request(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal count
        with lock:
            count += 1
            if count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kwargs)

    http.Http.request = request  # type: ignore[method-assign]
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    state = {"w": torch.zeros(300_000), "step": 0}  # 1.2 MB: five parts (four would be one request)
    with CheckpointManager(
        root, async_save=False, retention=Retention(keep_last=2), storage_options=OPTIONS
    ) as mgr:
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
