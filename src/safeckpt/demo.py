"""``python -m safeckpt.demo`` (also under torchrun): the seeded toy run of ``safeckpt demo``.

The demo itself lives in :mod:`safeckpt.cli.demo_run`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .cli import main as cli_main
from .cli.demo_run import weights_sha256

__all__ = ["main", "weights_sha256"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m safeckpt.demo [options]``; the same as ``safeckpt demo [options]``."""
    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
