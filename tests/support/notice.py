"""The one line safeckpt logs when it is imported with its private torch fast paths switched off
(``SAFECKPT_TORCH_PRIVATE=0``, the second pass of ``make test``), taken out of a command's stderr
by the tests that read that stderr line by line."""

from __future__ import annotations

import subprocess

NOTICE = "safeckpt: SAFECKPT_TORCH_PRIVATE=0: "


def without_notice(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """``proc`` with the switch's notice removed from its stderr (the rest as it was)."""
    if proc.stderr:
        lines = proc.stderr.splitlines(keepends=True)
        proc.stderr = "".join(line for line in lines if not line.startswith(NOTICE))
    return proc
