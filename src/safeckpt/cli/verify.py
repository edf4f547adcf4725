"""``safeckpt verify``: read every byte of checkpoints and check it (exit 1 if anything is broken)."""

from __future__ import annotations

import argparse
from typing import Any

from ..catalog import scan
from ..maintenance import verify
from .args import non_negative_int
from .common import EXIT_FAILED, EXIT_OK, add_command, existing_root, out, print_json, progress_bar


def cmd_verify(args: argparse.Namespace) -> int:
    root = existing_root(args.root)
    steps = sorted(set(args.steps + (args.step or []))) or None
    catalog = scan(root)
    sizes = {e.step: e.record.size for e in catalog.entries if e.record is not None}
    total = sum(sizes.values()) if steps is None else sum(sizes.get(s, 0) for s in steps)
    with progress_bar("verifying", total) as advance:
        report = verify(root, steps=steps, progress=advance)
    latest_problem = None
    pointer = catalog.pointer_step
    if steps is None and report and pointer is None:
        latest_problem = (
            "`latest` is missing"
            if catalog.latest_name is None
            else f"`latest` names {catalog.latest_name}, which is not a committed checkpoint"
        ) + "; auto-resume falls back to the newest complete checkpoint"
    elif steps is None and pointer is not None and report.get(pointer):
        latest_problem = f"`latest` names step {pointer}, which is broken"
    broken = sorted(step for step, problems in report.items() if problems)
    if args.json:
        print_json(
            {
                "root": str(root),
                "checkpoints": {str(step): problems for step, problems in sorted(report.items())},
                "broken": broken,
                "latest_problem": latest_problem,
                "ok": not broken and latest_problem is None,
            }
        )
    else:
        console = out()
        if not report:
            console.print(f"no checkpoints in {root}")
        for step, problems in sorted(report.items()):
            if problems:
                console.print(f"step {step}: [red]BROKEN[/]: {'; '.join(problems)}")
            else:
                console.print(f"step {step}: ok")
        if latest_problem:
            console.print(f"[red]{latest_problem}[/]")
        if report:
            console.print(f"{len(report)} checked, {len(broken)} broken")
    return EXIT_FAILED if broken or latest_problem else EXIT_OK


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "verify",
        help="read and check every byte of checkpoints (exit 1 if anything is broken)",
        description="Check every checkpoint of ROOT (or the STEPs given): every file present, every "
        "byte matching the checksum written with it, DCP metadata readable. Exit 0 when all is "
        "healthy, 1 when anything is broken, 2 on a usage error.",
        examples="""
safeckpt verify runs/exp1
safeckpt verify runs/exp1 1000 2000 --json
safeckpt verify runs/exp1 || echo "some checkpoint is broken"
""",
    )
    parser.add_argument("root", metavar="ROOT")
    parser.add_argument("steps", metavar="STEP", nargs="*", type=non_negative_int, help="check only these")
    parser.add_argument(
        "--step", type=non_negative_int, action="append", metavar="N", help="check only step N (repeatable)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=cmd_verify)
