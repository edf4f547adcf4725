"""``safeckpt register``: retry failed or unfinished registrations, or add them with a registrar."""

from __future__ import annotations

import argparse
import json

from ..errors import ConfigError
from .common import EXIT_FAILED, EXIT_OK, existing_root, out, print_json

_DONE = ("registered", "skipped")


def cmd_register(args: argparse.Namespace) -> int:
    from .._registration.pending import register_pending, registrar_from_json

    root = existing_root(args.root)
    registrar = None
    if args.registrar is not None:
        try:
            data = json.loads(args.registrar)
        except ValueError as e:
            raise ConfigError(
                f"--registrar must be a registrar's JSON, like "
                f'\'{{"kind": "jsonl", "index_path": "runs/index.jsonl"}}\' ({e}).'
            ) from None
        registrar = registrar_from_json(data)
    try:
        results = register_pending(root, registrar, step=args.step)
    finally:
        close = getattr(registrar, "close", None)
        if close is not None:
            close()
    failed = [step for step, status in results if status not in _DONE]
    if args.json:
        print_json(
            {
                "root": str(root),
                "results": [{"step": step, "status": status} for step, status in results],
                "ok": not failed,
            }
        )
    else:
        console = out()
        if not results:
            console.print(f"nothing to register in {root}: no failed or unfinished registrations")
        for step, status in results:
            hint = ""
            if status == "no registrar":
                hint = " (its record names no registrar; pass --registrar)"
            console.print(f"step {step}: {status}{hint}")
    return EXIT_FAILED if failed else EXIT_OK
