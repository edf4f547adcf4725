"""A job killed with -9 and restarted: how long until its first save commits (issue 52's targets).

    .venv/bin/python benchmarks/bench_restart.py [--rounds 3]

Each round runs a real training job (``tests/support/owner_worker.py``, the library's default heartbeat
and lease), kills it with -9 after its second commit, and starts the next job at once: on the
same machine, or on another one (a UTS namespace of its own with another hostname, as
``tests/support/other_host.py`` plays it; needs root). The times are the restarted job's own, from its
start: the constructor returning (it owns the root), the restore, and its first commit. Local
root and ``s3://`` on a moto server (``tests/support/s3_server.py``). Targets: on another machine, the
first commit within 45 s of the start; on the same machine, within 5 s of the restore.
Prints Markdown; exits 77 without moto or ``unshare``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from bench_moto import SKIPPED, with_bucket
from other_host import can_fake_hosts, on_host

WORKER = str(Path(__file__).resolve().parents[1] / "tests" / "owner_worker.py")
TARGET_OTHER = 45.0  # seconds from the start to the first commit
TARGET_SAME = 5.0  # seconds from the restore to the first commit


def _job(url: str, log: Path, host: str | None, *args: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, WORKER, url, str(log), *args]
    return subprocess.Popen(on_host(host, argv) if host else argv, stderr=subprocess.DEVNULL)


def _wait_line(log: Path, prefix: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        found = [line for line in lines if line.startswith(prefix)]
        if found:
            return found[0]
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended ({proc.returncode}) without {prefix!r}: {lines}")
        time.sleep(0.05)
    raise RuntimeError(f"no {prefix!r} within {timeout} s")


def one_round(url: str, where: str, tmp: Path) -> tuple[float, float, float]:
    """(opened, restored, first commit), seconds from the restarted job's start."""
    first_log, second_log = tmp / f"a-{uuid.uuid4().hex}.log", tmp / f"b-{uuid.uuid4().hex}.log"
    first = _job(url, first_log, "node-a" if where == "another machine" else None)
    try:
        _wait_line(first_log, "committed 2", first)
    finally:
        first.kill()
        first.wait()
    second = _job(url, second_log, "node-b" if where == "another machine" else None, "--steps", "1")
    try:
        if second.wait(300) != 0:
            raise RuntimeError(f"the restarted job failed: {second_log.read_text()}")
    finally:
        second.kill()
    lines = second_log.read_text().splitlines()
    opened = float(lines[0].split()[1])
    restored = float(lines[1].split()[2])
    committed = float(lines[2].split()[2])
    return opened, restored, committed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not can_fake_hosts():
        print("bench_restart: `unshare --uts` (root) is needed to play another machine", file=sys.stderr)
        return SKIPPED

    def run(endpoint: str, bucket: str) -> int:
        rows = []
        with tempfile.TemporaryDirectory() as scratch:
            tmp = Path(scratch)
            for store in ("local", "s3"):
                for where in ("same machine", "another machine"):
                    times = []
                    for n in range(args.rounds):
                        url = (
                            str(tmp / f"root-{n}-{where[0]}")
                            if store == "local"
                            else f"s3://{bucket}/r{n}{where[0]}"
                        )
                        times.append(one_round(url, where, tmp))
                        print(f"{store}, {where}, round {n + 1}: {times[-1]}", file=sys.stderr)
                    rows.append((store, where, times))
        print(
            "| root | restarted on | constructor returned (s) | restored (s) | first commit (s) | "
            "target | met |"
        )
        print("|---|---|---|---|---|---|---|")
        for store, where, times in rows:
            opened, restored, committed = (sorted(t[i] for t in times) for i in range(3))

            def cell(values: list[float]) -> str:
                return f"{statistics.median(values):.1f} ({values[0]:.1f}-{values[-1]:.1f})"

            if where == "another machine":
                target, met = f"first commit <= {TARGET_OTHER:g} s", max(committed) <= TARGET_OTHER
            else:
                after = [t[2] - t[1] for t in times]
                target, met = f"restore to commit <= {TARGET_SAME:g} s", max(after) <= TARGET_SAME
            print(
                f"| {store} | {where} | {cell(opened)} | {cell(restored)} | {cell(committed)} | {target} | "
                f"{'yes' if met else 'NO'} |"
            )
        print()
        print(
            f"Median (range) over {args.rounds} rounds, seconds from the start of the restarted job's "
            "main() (torch imported before it; safeckpt's import and the manager within); the "
            "defaults: heartbeat every 5 s, dead after 20 s unchanged, S3 lease 20 s."
        )
        return 0

    return with_bucket("bench_restart", run)


if __name__ == "__main__":
    sys.exit(main())
