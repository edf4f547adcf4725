"""``safeckpt upload``: upload the local commits of a run with two tiers that its root lacks."""

from __future__ import annotations

import argparse

from .._ops.upload import upload_local
from .common import EXIT_FAILED, EXIT_OK, out, print_json


def cmd_upload(args: argparse.Namespace) -> int:
    report = upload_local(args.root, args.local_dir)
    if args.json:
        print_json(report.to_json())
    else:
        console = out()
        steps = ", ".join(map(str, report.uploaded))
        console.print(f"uploaded step(s) {steps} to {args.root}" if report.uploaded else "nothing to upload")
        if report.waiting:
            console.print(
                f"not uploaded: step(s) {', '.join(map(str, report.waiting))} (the warnings above say "
                "why); they stay in the local directory"
            )
    return EXIT_FAILED if report.waiting else EXIT_OK
