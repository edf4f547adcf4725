"""``safeckpt demo``: the seeded toy run of :mod:`safeckpt.cli.demo_run`."""

from __future__ import annotations

import argparse
from typing import Any

from .common import add_command


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo_run import run

    return run(args)


def add_parser(commands: Any) -> None:
    from .demo_run import add_arguments

    parser = add_command(
        commands,
        "demo",
        help="train a small model with checkpoints; kill it and run again to see it resume",
        description="Train a small seeded model on CPU with async checkpoints. Run it again to resume; "
        "the final weights hash is the same whether or not the run was interrupted.",
        examples="""
safeckpt demo --dir /tmp/demo --steps 200 --kill-at 120   # dies at step 120
safeckpt demo --dir /tmp/demo --steps 200                 # resumes, same final hash
torchrun --nproc-per-node 2 -m safeckpt.demo --dir /tmp/demo2
""",
    )
    add_arguments(parser)
    parser.set_defaults(func=cmd_demo)
