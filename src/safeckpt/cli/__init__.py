"""The ``safeckpt`` command: a look at and care of checkpoint roots, and the demo.

    safeckpt ls ROOT [--json] [--keep-last N] [--keep-best K --metric NAME] ...
    safeckpt inspect ROOT [STEP|PATH] [--json]
    safeckpt verify ROOT [STEP ...] [--json]
    safeckpt prune ROOT [--keep-last N ...] [--dry-run] [--json]   (no rule: the job's recorded one)
    safeckpt pin ROOT STEP / safeckpt unpin ROOT STEP
    safeckpt gc ROOT [--dry-run] [--json]
    safeckpt export ROOT --to OUT [--step N] [--key model] [--format safetensors|hf] ...
    safeckpt import WEIGHTS --to ROOT [--step 0]
    safeckpt register ROOT [--step N] [--json]
    safeckpt demo [--dir DIR] [--steps N] [--kill-at STEP] ...

The arguments of every command are in :mod:`.parser`, which imports none of
them: a command's module is imported only when it runs, so ``--help`` and a usage
error cost no torch. One module per command group, each a thin layer over the
library functions the Python API uses (:mod:`safeckpt._ops.maintenance`, :mod:`safeckpt._ops.inspection`,
:mod:`safeckpt._root.collect`, :mod:`safeckpt._ops.export`, :mod:`safeckpt._registration.worker`). None
of them except ``import`` and ``demo`` starts a ``CheckpointManager`` on the
root: a manager takes ownership of a root and collects its ``.staging/``.

Exit codes: 0 ok, 1 failed (or, for ``verify``, something is broken), 2 bad
usage, 130 interrupted. Errors are one line on stderr; ``SAFECKPT_DEBUG=1``
adds the traceback. Schemas of the ``--json`` outputs: docs/cli.md.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, SCHEMA_VERSION, run_command
from .parser import build_parser

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "SCHEMA_VERSION",
    "build_parser",
    "main",
]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``safeckpt`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
