"""``safeckpt upload``: upload the local commits of a run with two tiers that its root lacks."""

from __future__ import annotations

import argparse
from typing import Any

from .._ops.upload import upload_local
from .common import EXIT_FAILED, EXIT_OK, add_command, out, print_json


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


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "upload",
        help="upload the checkpoints committed in a local tier (local_dir=) that ROOT lacks",
        description="Upload every checkpoint committed in LOCAL_DIR (the fast tier of a run made with "
        "CheckpointManager(ROOT, local_dir=LOCAL_DIR)) that has not been uploaded to ROOT, oldest "
        "first, each committed in ROOT as a save there would be; what a restarted job does before it "
        "trains. A checkpoint already in ROOT is not uploaded again. Refused while a live job owns "
        "either directory. Exit status 1 when some could not be uploaded.",
        examples="""
safeckpt upload s3://bucket/runs/exp1 --local-dir /local/nvme/exp1
safeckpt upload /shared/runs/exp1 --local-dir /local/nvme/exp1 --json
""",
    )
    parser.add_argument("root", metavar="ROOT")
    parser.add_argument("--local-dir", required=True, metavar="DIR", help="the run's local tier")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=cmd_upload)
