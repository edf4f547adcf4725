"""Running a process as if on another machine: its own UTS namespace, with its own hostname.

``unshare --uts`` (root) gives the child a hostname of its own while it shares this kernel, its
boot id and pid namespace: exactly what safeckpt must not take for "this machine" when it judges
whether a writer's pid still runs (``safeckpt._util.processes.machine``). Without root the
namespace cannot be made, and the tests that need it skip, saying so (CI runs as root).
"""

from __future__ import annotations

import functools
import shlex
import shutil
import subprocess

import pytest


@functools.cache
def can_fake_hosts() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run(
            ["unshare", "--uts", "sh", "-c", "hostname safeckpt-probe-host && hostname"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.strip() == "safeckpt-probe-host"


needs_other_host = pytest.mark.skipif(
    not can_fake_hosts(), reason="`unshare --uts` (root) is needed to play another machine"
)


def on_host(host: str, argv: list[str]) -> list[str]:
    """``argv`` run under the hostname ``host``, in a UTS namespace of its own."""
    command = f"hostname {shlex.quote(host)} && exec {shlex.join(argv)}"
    return ["unshare", "--uts", "sh", "-c", command]
