"""``safeckpt ls``: what a root holds, as a table or JSON. Read-only: reads records, takes no lock."""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .._dist.failures import human_size
from .._format.catalog import Catalog, Entry, settled_scan, verify_files
from .._format.record import list_files
from .._ops.footprint import footprint, total
from .._ops.inspection import kept_because, recorded_retention
from .._ops.maintenance import Damaged, damaged_checkpoints
from .._ops.tiers import compare_tiers
from .._policy.retention import Retention
from .args import retention_from_args
from .common import EXIT_OK, existing_root, out, print_json, print_table

COMMITTED = "committed"
INCOMPLETE = "incomplete"


def listing(
    root: str | os.PathLike[str],
    retention: Retention | None = None,
    local_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """What ``root`` holds as JSON data: checkpoints (by step), ``latest``, leftovers.

    Each checkpoint says why it is kept: ``latest`` (or the newest one, when
    ``latest`` is missing or broken), ``pinned``, and with ``retention`` the
    rules that keep it; an empty list means the next prune with ``retention``
    removes it. With ``local_dir`` (the local tier of a run with two tiers), each
    says which tiers hold it (``tiers``: ``durable``, ``local``, and for a local
    one not in ``root`` yet, ``uploading`` or ``not uploaded``), and local ones
    not uploaded yet are listed too.
    """
    path = existing_root(root)
    catalog = settled_scan(path)  # a job may be committing and pruning as we read
    source = "given"
    if retention is None:
        retention = recorded_retention(catalog)
        source = "recorded"
    reasons = kept_because(catalog, retention)
    checkpoints = []
    whole = []  # (name, record) of the complete checkpoints: the root's total
    for entry in catalog.entries:
        problems = verify_files(entry)
        if problems and entry.path.entry() is None:
            continue  # pruned since the scan: gone, not incomplete
        record = entry.record
        kept = reasons.get(entry.step, []) if not problems else []
        cost = footprint(record) if record and not problems else None
        if record and not problems:
            whole.append((entry.path.name, record))
        checkpoints.append(
            {
                "step": entry.step,
                "path": str(entry.path),
                "status": COMMITTED if not problems else INCOMPLETE,
                "problems": problems,
                "time": record.time if record else None,
                "time_iso": _local_iso(record.time) if record else None,
                "size": record.size if record and not problems else _disk_size(entry),
                # its save wrote / it reads from files an earlier save wrote (stored once)
                "own_bytes": cost.own if cost else None,
                "shared_bytes": cost.shared if cost else 0,
                "metrics": dict(record.metrics) if record else {},
                "pinned": bool(record and record.pinned),
                "latest": entry.step == catalog.pointer_step,
                "kept_because": kept,
            }
        )
    if local_dir is not None:
        _add_local_tier(checkpoints, catalog, local_dir)
    return {
        "root": str(path),
        "local_dir": None if local_dir is None else str(local_dir),
        "latest": catalog.pointer_step,
        "latest_name": catalog.latest_name,
        "resume_step": catalog.latest_step,
        "retention": None if retention is None else retention.policy().reason(),
        "retention_source": None if retention is None else source,
        "checkpoints": checkpoints,
        # du-style: what the complete checkpoints hold together, each shared file once
        "total_bytes": total(whole),
        "staging": [p.name for p in catalog.staging],
        "trash": [p.name for p in catalog.trash],
        "damaged": [_damaged_json(d) for d in damaged_checkpoints(catalog)],
    }


def _add_local_tier(
    checkpoints: list[dict[str, Any]], catalog: Catalog, local_dir: str | os.PathLike[str]
) -> None:
    """Mark which tier holds each checkpoint; add the local ones ``root`` lacks."""
    tiers = compare_tiers(catalog, existing_root(local_dir))
    for c in checkpoints:
        c["tiers"] = ["durable", "local"] if c["step"] in tiers.in_both else ["durable"]
    for entry in tiers.local_only:
        record = entry.record
        assert record is not None
        checkpoints.append(
            {
                "step": entry.step,
                "path": str(entry.path),
                "status": COMMITTED,
                "problems": [],
                "time": record.time,
                "time_iso": _local_iso(record.time),
                "size": record.size,
                "metrics": dict(record.metrics),
                "pinned": record.pinned,
                "latest": False,
                "kept_because": ["waiting for its upload"],
                "tiers": ["local", "uploading" if entry.step in tiers.uploading else "not uploaded"],
            }
        )
    checkpoints.sort(key=lambda c: (c["step"], c["tiers"][0] != "durable"))


def _damaged_json(damaged: Damaged) -> dict[str, Any]:
    data = damaged.to_json()
    data["time_iso"] = _local_iso(damaged.time) if damaged.time is not None else None
    return data


def _local_iso(t: float) -> str | None:
    try:
        return datetime.datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):  # a record written by a far-off clock: beyond year 9999
        return None


def _disk_size(entry: Entry) -> int:
    try:
        return sum(list_files(entry.path).values())
    except OSError:
        return 0


def _metrics_text(metrics: dict[str, float | None]) -> str:
    return " ".join(f"{k}={'nan' if v is None else f'{v:.4g}'}" for k, v in sorted(metrics.items()))


def render(console: Console, data: dict[str, Any]) -> None:
    """Print ``listing()``'s data as a table, with leftovers and a broken ``latest`` as footnotes."""
    if not data["checkpoints"] and not data["damaged"]:
        console.print(f"no checkpoints in {data['root']}")
    else:
        title = f"checkpoints in {data['root']}"
        if data["retention"]:
            whose = "the job's retention" if data["retention_source"] == "recorded" else "kept by"
            title += f" ({whose}: {data['retention']})"
        table = Table(title=title, title_justify="left")
        table.add_column("step", justify="right", no_wrap=True)
        table.add_column("time", no_wrap=True)
        table.add_column("size", justify="right", no_wrap=True)
        sharing = any(c.get("shared_bytes") for c in data["checkpoints"])
        if sharing:
            table.add_column("shared", justify="right", no_wrap=True)
        table.add_column("metrics", overflow="fold")
        table.add_column("status", overflow="fold")
        if data.get("local_dir"):
            table.add_column("tiers", overflow="fold")
        table.add_column("why kept", overflow="fold")
        for c in data["checkpoints"]:
            row = _checkpoint_row(c, data)
            table.add_row(*((*row[:3], human_size(c.get("shared_bytes") or 0), *row[3:]) if sharing else row))
        for d in data["damaged"]:
            row = _damaged_row(d)
            row = (*row[:-1], "", *row[-1:]) if data.get("local_dir") else row
            table.add_row(*((*row[:3], "", *row[3:]) if sharing else row))
        print_table(console, table)
    for note in footnotes(data):
        console.print(f"[dim]{note}[/]")


def _checkpoint_row(c: dict[str, Any], data: dict[str, Any]) -> tuple[str, ...]:
    status = "committed" if c["status"] == COMMITTED else f"[red]incomplete: {'; '.join(c['problems'])}[/]"
    if c["kept_because"]:
        kept = ", ".join(c["kept_because"])
    elif c["status"] != COMMITTED:
        kept = "not loadable; never pruned"
    elif data["retention"]:
        kept = "[yellow]nothing: the next prune removes it[/]"
        if data["retention_source"] == "recorded":
            kept = "[yellow]nothing: the job prunes it at its next commit[/]"
    else:
        kept = ""
    tiers = (", ".join(c["tiers"]),) if data.get("local_dir") else ()
    return (
        str(c["step"]),
        _time_cell(c["time_iso"]),
        human_size(c["size"]),
        _metrics_text(c["metrics"]),
        status,
        *tiers,
        kept,
    )


def _damaged_row(d: dict[str, Any]) -> tuple[str, ...]:
    """A checkpoint moved aside into .damaged/: when it was moved and why, from its note."""
    why = escape(f": {d['reason']}") if d["reason"] else ""
    status = f"[red]damaged{why}[/]"
    kept = escape(f"moved aside to .damaged/{Path(d['path']).name}; never loaded; `safeckpt gc` removes it")
    return (str(d["step"]), _time_cell(d["time_iso"]), human_size(d["size"]), "", status, kept)


def _time_cell(time_iso: str | None) -> str:
    return time_iso[:19].replace("T", " ") if time_iso else "-"


def footnotes(data: dict[str, Any]) -> list[str]:
    notes = []
    if any(c.get("shared_bytes") for c in data["checkpoints"]):
        notes.append(
            f"total: {human_size(data['total_bytes'])} stored for the complete checkpoints (each file "
            "that checkpoints share counted once; `shared`: what a checkpoint reads from files an "
            "earlier save wrote, kept while any checkpoint reads them)"
        )
    if data["latest"] is None and data["latest_name"] is not None:
        notes.append(
            f"`latest` names {data['latest_name']}, which is not a committed checkpoint; "
            "auto-resume falls back to the newest complete one."
        )
    elif data["latest"] is None and any(c["status"] == COMMITTED for c in data["checkpoints"]):
        notes.append("`latest` is missing; auto-resume falls back to the newest complete checkpoint.")
    if data["staging"]:
        notes.append(
            f"{len(data['staging'])} entr{'y' if len(data['staging']) == 1 else 'ies'} in .staging/: saves "
            "in progress, or left by an interrupted run (the next CheckpointManager on this root collects "
            "them): " + ", ".join(data["staging"])
        )
    if data["trash"]:
        notes.append(
            f"{len(data['trash'])} entr{'y' if len(data['trash']) == 1 else 'ies'} in .trash/: removed "
            "checkpoints waiting for deletion (the next prune or manager start retries): "
            + ", ".join(data["trash"])
        )
    return notes


def print_listing(console: Console, root: str | os.PathLike[str], retention: Retention | None) -> None:
    render(console, listing(root, retention))


def cmd_ls(args: argparse.Namespace) -> int:
    data = listing(args.root, retention_from_args(args), local_dir=args.local_dir)
    if args.json:
        print_json(data)
    else:
        render(out(), data)
    return EXIT_OK
