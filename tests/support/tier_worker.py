"""A training process with two tiers that SIGKILLs itself at one point of saving step 3 (test_tiers.py).

    python tests/support/tier_worker.py ROOT LOCAL_DIR POINT

Saves steps 1, 2, 3 with ``local_dir=`` (each step's tensor filled with the step), waiting for
each upload before the next save, and dies at ``POINT`` of step 3:

* ``local_write``: its files written to the local tier, before the local commit;
* ``before_upload``: committed locally, before its upload starts;
* ``during_upload``: one file copied to the durable tier, the next one half written;
* ``durable_commit``: every file and the record in the durable tier, before the commit;
* ``after_durable_commit``: committed in the durable tier, before the local copy is marked.
* ``none``: no kill; the run closes normally.

``SAFECKPT_TEST_CLOCK_AHEAD=<seconds>`` in the environment sets this process's clock ahead (a host
whose clock is wrong): every time it writes is that much later than the other hosts'.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from safeckpt import CheckpointManager, Retention
from safeckpt._format.checksums import parse_checksums
from safeckpt._manager import committer
from safeckpt._objstore import lease as s3_lease
from safeckpt._root.copy import copy_file
from safeckpt._tiers import durable, uploads

# A kill while holding an S3 root's lease makes the next start wait for it to expire: the lease
# this process writes (and its successor honours) is short, so a kill costs seconds, not 30.
s3_lease.LEASE_SECONDS = 4.0


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    if point == "local_write":
        real_commit = committer.Committer._commit

        def commit(self, job, checksums, **kw):  # type: ignore[no-untyped-def]
            if job.step == 3:
                _die()
            return real_commit(self, job, checksums, **kw)

        committer.Committer._commit = commit  # type: ignore[method-assign]
    elif point == "before_upload":
        real_upload = uploads.Uploader._upload

        def upload(self, local):  # type: ignore[no-untyped-def]
            if local.record.step == 3:
                _die()
            return real_upload(self, local)

        uploads.Uploader._upload = upload  # type: ignore[method-assign]
    elif point == "during_upload":
        real_copy = durable.copy_checkpoint

        def copy(source, record, target, **kwargs):  # type: ignore[no-untyped-def]
            if record.step != 3:
                return real_copy(source, record, target, **kwargs)
            first, last = sorted(record.files)[0], sorted(record.files)[-1]
            target.store.make_dir(target.key)
            checksum = parse_checksums(record.checksums, record.files, where=str(source))[first]
            copy_file(source / first, target / first, size=record.files[first], checksum=checksum, step=3)

            def half(out):  # type: ignore[no-untyped-def]
                out.write(b"\0" * max(1, record.files[last] // 2))
                _die()

            target.store.write_stream((target / last).key, half)

        durable.copy_checkpoint = copy
    elif point == "durable_commit":
        real_write = durable.write_record

        def write(directory, record, lock):  # type: ignore[no-untyped-def]
            real_write(directory, record, lock)
            if record.step == 3:
                _die()

        durable.write_record = write
    elif point == "after_durable_commit":
        real_amend = uploads.amend_record

        def amend(directory, lock, **changes):  # type: ignore[no-untyped-def]
            if directory.name == "step_3":
                _die()
            return real_amend(directory, lock, **changes)

        uploads.amend_record = amend
    elif point != "none":
        raise SystemExit(f"unknown point {point!r}")


def _skew_clock() -> None:
    ahead = float(os.environ.get("SAFECKPT_TEST_CLOCK_AHEAD", "0"))
    if ahead:
        real = time.time
        time.time = lambda: real() + ahead  # type: ignore[assignment]


def main() -> None:
    root, local, point = sys.argv[1], sys.argv[2], sys.argv[3]
    _skew_clock()
    _arm(point)
    state = {"w": torch.zeros(1 << 16)}
    with CheckpointManager(
        root, local_dir=local, local_retention=Retention(keep_last=1), retention=Retention(keep_last=2)
    ) as mgr:
        for step in (1, 2, 3):
            state["w"].fill_(step)
            mgr.save(step, state)
            mgr.wait(durable=True)


if __name__ == "__main__":
    main()
