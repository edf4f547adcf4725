"""``safeckpt inspect``: a checkpoint's record, files, tensors and train state."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from .._dist.failures import human_size
from .._ops.inspection import inspect_checkpoint
from .common import EXIT_OK, existing_root, out, print_json, print_table


def cmd_inspect(args: argparse.Namespace) -> int:
    root = existing_root(args.root)
    target: int | str | None = args.target
    if isinstance(target, str) and target.isdigit():
        target = int(target)
    data = inspect_checkpoint(root, target)
    if args.json:
        data.pop("schema_version", None)
        print_json(data)
    else:
        render(out(), data)
    return EXIT_OK


def render(console: Console, data: dict[str, Any]) -> None:
    record = data["record"] or {}
    chosen = {
        "latest": " (what `latest` names)",
        "newest complete": " (newest complete; `latest` is missing or broken)",
    }.get(data["chosen_by"], "")
    console.print(f"[bold]step {data['step']}[/]{chosen}: {data['path']}")
    status = (
        data["status"] if not data["problems"] else f"[red]{data['status']}: {'; '.join(data['problems'])}[/]"
    )
    console.print(f"  status:       {status}")
    if record:
        console.print(f"  time:         {record.get('time_iso')}")
        console.print(f"  world size:   {record.get('world_size')}")
    console.print(f"  size:         {human_size(data['size'])} in {len(data['files'])} files")
    for key in ("metrics", "extra", "registration"):
        if record.get(key):
            console.print(f"  {key + ':':<13} {json.dumps(record[key], sort_keys=True)}")
    console.print(f"  kept because: {', '.join(data['kept_because']) or '-'}")

    if data["tensors"] is not None:
        table = Table(title=f"{len(data['tensors'])} entries in .metadata", title_justify="left")
        for name, justify in (
            ("fqn", "left"),
            ("dtype", "left"),
            ("shape", "left"),
            ("size", "right"),
            ("sharding", "left"),
        ):
            table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
        for t in data["tensors"]:
            if t["kind"] != "tensor":
                table.add_row(t["fqn"], "(bytes)", "", "", "")
                continue
            chunks = t["chunks"]
            sharding = f"{len(chunks)} chunks" if t["sharded"] else "whole"
            shape = "x".join(map(str, t["shape"])) or "scalar"
            table.add_row(t["fqn"], t["dtype"], shape, human_size(t["bytes"]), sharding)
        print_table(console, table)

    files = Table(title="files", title_justify="left")
    files.add_column("name", overflow="fold")
    files.add_column("size", justify="right")
    for f in data["files"]:
        size = "missing" if f["size"] is None else human_size(f["size"])
        if f["recorded_size"] is not None and f["size"] is not None and f["size"] != f["recorded_size"]:
            size += f" (recorded {human_size(f['recorded_size'])})"
        files.add_row(f["name"], size)
    print_table(console, files)

    for name, state in (data["train_state"] or {}).items():
        console.print(f"[bold]{name}[/] (rng: {', '.join(state['rng'] or []) or 'none'})")
        console.print(json.dumps(_collapsed(state["entries"]), indent=2, sort_keys=True), markup=False)


def _collapsed(value: Any) -> Any:
    """``value`` with modules and optimizer states shortened to their tensor counts (the
    tensor table lists them); ``--json`` has them whole."""
    if isinstance(value, list):
        return [_collapsed(v) for v in value]
    if not isinstance(value, dict):
        return value
    if value.keys() == {"module"}:
        return f"module ({_count_tensors(value)} tensors)"
    if value.keys() == {"optimizer"} and isinstance(value["optimizer"], dict):
        inner = dict(value["optimizer"])
        if "state" in inner:
            inner["state"] = f"{_count_tensors(inner['state'])} tensors"
        return {"optimizer": _collapsed(inner)}
    return {k: _collapsed(v) for k, v in value.items()}


def _count_tensors(value: Any) -> int:
    if isinstance(value, list):
        return sum(_count_tensors(v) for v in value)
    if isinstance(value, dict):
        if value.keys() == {"__tensor__"}:
            return 1
        return sum(_count_tensors(v) for v in value.values())
    return 0
