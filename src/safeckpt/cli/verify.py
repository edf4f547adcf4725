"""``safeckpt verify``: read every byte of checkpoints and check it (exit 1 if anything is broken)."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

from .._format.catalog import settled_scan
from .._ops.maintenance import VerifyReport, verify_root
from .._store.loc import Loc
from .common import EXIT_FAILED, EXIT_OK, existing_root, out, print_json, progress_bar


def cmd_verify(args: argparse.Namespace) -> int:
    root = existing_root(args.root)
    steps = sorted(set(args.steps + (args.step or []))) or None
    catalog = settled_scan(root)
    sizes = {e.step: e.record.size for e in catalog.entries if e.record is not None}
    total = sum(sizes.values()) if steps is None else sum(sizes.get(s, 0) for s in steps)
    with progress_bar("verifying", total) as advance:
        report = verify_root(root, steps=steps, progress=advance, catalog=catalog)
    broken = sorted(step for step, problems in report.checkpoints.items() if problems)
    if args.json:
        print_json(
            {
                "root": str(root),
                "checkpoints": {str(step): problems for step, problems in sorted(report.checkpoints.items())},
                "broken": broken,
                "latest_problem": report.latest_problem,
                "damaged": [d.to_json() for d in report.damaged],
                "ok": report.ok,
            }
        )
    else:
        render(out(), root, report, broken)
    return EXIT_OK if report.ok else EXIT_FAILED


def render(console: Console, root: Loc, report: VerifyReport, broken: list[int]) -> None:
    if not report.checkpoints:
        console.print(f"no checkpoints in {root}")
    for step, problems in sorted(report.checkpoints.items()):
        if problems:
            console.print(f"step {step}: [red]BROKEN[/]: {'; '.join(problems)}")
        else:
            console.print(f"step {step}: ok")
    if report.latest_problem:
        console.print(f"[red]{report.latest_problem}[/]")
    for damaged in report.damaged:
        # never loaded, so no problem of the root: a note, and `safeckpt gc` removes it
        why = f": {damaged.reason}" if damaged.reason else ""
        console.print(
            escape(f"note: step {damaged.step} was moved aside as damaged{why} ({damaged.path}); it is ")
            + "never loaded; `safeckpt gc` removes it"
        )
    if report.checkpoints:
        console.print(f"{len(report.checkpoints)} checked, {len(broken)} broken")
