"""``safeckpt prune``, ``pin`` and ``unpin``: what retention keeps, changed from outside a job."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._ops.maintenance import RECORDED, prune, set_pinned
from .args import add_retention_arguments, non_negative_int, retention_from_args
from .common import EXIT_OK, add_command, existing_root, out, print_json


def cmd_prune(args: argparse.Namespace) -> int:
    root = existing_root(args.root)
    # no rule given: the job's own (recorded) retention, so a prune does what its next commit would
    result = prune(root, retention_from_args(args), dry_run=args.dry_run)
    if args.json:
        print_json(
            {
                "root": str(root),
                "dry_run": args.dry_run,
                "retention": result.rule,
                "retention_source": result.source,
                "removed": result.removed,
                "kept": result.kept,
                "left_in_trash": [str(p) for p in result.left_in_trash],
            }
        )
        return EXIT_OK
    console = out()
    whose = "the job's recorded retention" if result.source == RECORDED else "the rules given"
    console.print(f"rule: {whose}: {result.rule}")
    kept = ", ".join(map(str, result.kept)) or "none"
    if not result.removed:
        console.print(f"nothing to remove in {root}; kept step(s) {kept}")
    elif args.dry_run:
        console.print(
            f"would remove step(s) {', '.join(map(str, result.removed))}; would keep {kept} (dry run)"
        )
    else:
        console.print(f"removed step(s) {', '.join(map(str, result.removed))} from {root}; kept {kept}")
    if result.left_in_trash:
        print(
            f"safeckpt: warning: {len(result.left_in_trash)} removed checkpoint(s) are still in "
            f"{root / '.trash'} (the filesystem kept refusing to delete them); the next prune, "
            "`safeckpt gc` or manager start retries.",
            file=sys.stderr,
        )
    return EXIT_OK


def cmd_pin(args: argparse.Namespace) -> int:
    root = existing_root(args.root)
    set_pinned(root, args.step, args.pinned)
    if args.pinned:
        out().print(f"pinned step {args.step} in {root}: no prune removes it until `safeckpt unpin`")
    else:
        out().print(f"unpinned step {args.step} in {root}: retention decides about it again")
    return EXIT_OK


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "prune",
        help="remove the checkpoints retention does not keep",
        description="Remove the checkpoints of ROOT that the retention rules do not keep; with no "
        "rule, those the job's recorded retention (in its newest record) does not keep. Says which "
        "rule it applied. Never removes the one `latest` names, pinned ones, or saves in progress; "
        "safe while a job trains.",
        examples="""
safeckpt prune runs/exp1 --dry-run                 # the job's own retention: what would go?
safeckpt prune runs/exp1 --keep-last 3 --dry-run
safeckpt prune runs/exp1 --keep-last 2 --keep-best 1 --metric loss
safeckpt prune runs/exp1 --keep-last 1 --keep-milestones pow2
""",
    )
    parser.add_argument("root", metavar="ROOT")
    add_retention_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="say what would be removed; change nothing")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=cmd_prune)

    for name, pinned, text in (
        ("pin", True, "keep a checkpoint whatever retention says"),
        ("unpin", False, "let retention decide about a checkpoint again"),
    ):
        sub = add_command(
            commands,
            name,
            help=text,
            description=f"{text[0].upper()}{text[1:]}.",
            examples=f"safeckpt {name} runs/exp1 2000",
        )
        sub.add_argument("root", metavar="ROOT")
        sub.add_argument("step", metavar="STEP", type=non_negative_int)
        sub.set_defaults(func=cmd_pin, pinned=pinned)
