"""A training process with a frozen part on an ``s3://`` root that SIGKILLs itself at its N-th S3
request (test_frozen_s3.py; the request counting of s3_crash_worker.py).

The frozen parameter holds ``frozen_value(step)``, the same bytes until ``CHANGE_AT`` (then
changed through ``.data``): step 2's save shares step 1's file and prunes step 1 (``keep_last=1``),
step 3's writes the file again and prunes the checkpoint whose area step 2 used. The log gets
``at <n> <step>`` before each save (the request count then) and ``committed <step>`` after.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch
from torch import nn

from safeckpt import CheckpointManager, Retention
from safeckpt._objstore import lease as s3_lease
from safeckpt._s3 import client as s3_client

s3_lease.LEASE_SECONDS = 4.0  # a kill while holding the lease costs its successor seconds, not 30
STEPS = 4
CHANGE_AT = 3
NUMEL = 1 << 12


def frozen_value(step: int) -> float:
    return 40.0 if step >= CHANGE_AT else 3.0


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.zeros(NUMEL), requires_grad=False)
        self.head = nn.Parameter(torch.zeros(7))


def make_state() -> tuple[Model, dict[str, object]]:
    model = Model()
    return model, {"model": model, "optim": torch.optim.SGD([model.head], lr=0.1)}


def main() -> None:
    root, kill_at, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    count = 0
    lock = threading.Lock()
    real = s3_client.S3Client._retrying  # every request (and each page of a listing) goes through it

    def request(self, key, attempt):  # type: ignore[no-untyped-def]
        nonlocal count
        with lock:
            count += 1
            if count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(self, key, attempt)

    s3_client.S3Client._retrying = request  # type: ignore[method-assign]
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    model, state = make_state()
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=1)) as mgr:
        start = mgr.restore(state).step or 0
        for step in range(start + 1, STEPS + 1):
            with torch.no_grad():
                model.head.fill_(float(step))
            model.base.data.fill_(frozen_value(step))
            os.write(fd, f"at {count} {step}\n".encode())
            mgr.save(step, state)
            os.write(fd, f"committed {step}\n".encode())
    print(count, flush=True)


if __name__ == "__main__":
    main()
