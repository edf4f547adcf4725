"""``safeckpt prune``, ``pin`` and ``unpin``: what retention keeps, changed from outside a job."""

from __future__ import annotations

import argparse
import sys

from .._ops.maintenance import RECORDED, prune, set_pinned
from .args import retention_from_args
from .common import EXIT_OK, existing_root, out, print_json


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
