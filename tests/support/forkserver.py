"""One forkserver for the tests that start many processes: it imports torch and
safeckpt once, so each worker starts in milliseconds instead of seconds."""

from __future__ import annotations

import multiprocessing
from typing import Any

_PRELOAD = ["torch", "torch.distributed.fsdp", "safeckpt", "crash_worker", "dist_worker"]
_context: Any = None


def context() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context
