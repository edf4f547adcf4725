"""A training job for the ownership tests, run as its own process: ``python owner_worker.py ROOT LOG``.

Run under ``unshare --uts`` (tests/support/other_host.py) it plays a job on another machine. It opens
the root as a writer, restores, then saves one step every ``--every`` seconds, and writes each
event to LOG as one line, flushed at once, so a test can follow it:

    opened <seconds since start>      the constructor returned (the root is its own)
    restored <step or None> <seconds since start>
    committed <step> <seconds since start>
    refused <ErrorClass>              a CheckpointError ended it (exit status 3)
    closed

``--beat`` and ``--dead-after`` set the heartbeat it promises (the defaults are the library's);
``--skew`` runs its wall clock that many seconds off (time.time), as a host whose clock is wrong.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("log")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=float, default=0.2)
    parser.add_argument("--beat", type=float, default=None)
    parser.add_argument("--dead-after", type=float, default=None)
    parser.add_argument("--lease", type=float, default=None)
    parser.add_argument("--skew", type=float, default=0.0)
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args()
    started = time.monotonic()
    if args.skew:
        real = time.time
        time.time = lambda: real() + args.skew  # type: ignore[assignment]

    from safeckpt._objstore import lease
    from safeckpt._root import owner_record

    if args.beat is not None:
        owner_record.BEAT_EVERY = args.beat
    if args.dead_after is not None:
        owner_record.DEAD_AFTER = args.dead_after
    if args.lease is not None:
        lease.LEASE_SECONDS = args.lease

    from safeckpt import CheckpointError, CheckpointManager

    with Path(args.log).open("a", buffering=1) as log:

        def say(line: str) -> None:
            log.write(line + "\n")
            log.flush()
            os.fsync(log.fileno())

        return run(args, say, started, CheckpointError, CheckpointManager)


def run(args: argparse.Namespace, say: Any, started: float, error: Any, manager: Any) -> int:
    state = {"w": torch.zeros(64)}
    try:
        with manager(args.root, async_save=args.async_save) as mgr:
            say(f"opened {time.monotonic() - started:.2f}")
            step = mgr.restore(state).step
            say(f"restored {step} {time.monotonic() - started:.2f}")
            first = (step or 0) + 1
            for n in range(first, first + args.steps):
                state["w"].fill_(float(n))
                mgr.save(n, state)
                mgr.wait()
                say(f"committed {n} {time.monotonic() - started:.2f}")
                time.sleep(args.every)
        say("closed")
    except error as e:
        say(f"refused {type(e).__name__}: {' '.join(str(e).split())}")
        return 3
    return 0

if __name__ == "__main__":
    sys.exit(main())
