"""``safeckpt gc``: remove what crashes and old versions left (dead owners' staging, trash, ...)."""

from __future__ import annotations

import argparse

from rich.table import Table

from .._dist.failures import human_size
from .._root.collect import REMOVED, SKIPPED, collect_garbage
from .common import EXIT_OK, existing_root, out, print_json, print_table


def cmd_gc(args: argparse.Namespace) -> int:
    root = existing_root(args.root)
    report = collect_garbage(root, dry_run=args.dry_run, drain_timeout=args.drain_timeout)
    if args.json:
        print_json(report.to_json())
        return EXIT_OK
    console = out()
    if not report.items and not report.restored_steps:
        console.print(f"nothing to collect in {root} (owner: {report.owner})")
        return EXIT_OK
    table = Table(title=f"leftovers in {root} (owner: {report.owner})", title_justify="left")
    table.add_column("kind", no_wrap=True)
    table.add_column("path", overflow="fold")
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("action", overflow="fold")
    for item in report.items:
        action = item.action if item.reason is None else f"{item.action}: {item.reason}"
        if item.action == SKIPPED:
            action = f"[yellow]{action}[/]"
        table.add_row(item.kind, item.path.key, human_size(item.size), action)
    print_table(console, table)
    for step in report.restored_steps:
        console.print(f"put back step {step}: a save that replaced it was interrupted")
    removed = [i for i in report.items if i.action == REMOVED]
    skipped = [i for i in report.items if i.action == SKIPPED]
    if args.dry_run:
        found = sum(i.size for i in report.items if i.action != SKIPPED)
        console.print(f"would free {human_size(found)} (dry run; nothing changed)")
    else:
        console.print(
            f"freed {human_size(report.bytes_freed)} ({len(removed)} removed, {len(skipped)} skipped)"
        )
    return EXIT_OK
