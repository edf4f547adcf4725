"""``safeckpt export`` and ``safeckpt import``: model weights out to safetensors / HF, and back in."""

from __future__ import annotations

import argparse

from .._dist.failures import human_size
from .._ops.export import (
    SAFETENSORS,
    ExportPlan,
    ExportResult,
    export_chosen,
    write_export,
)
from .._ops.weights_import import import_weights
from .common import EXIT_OK, existing_root, out, print_json, progress_bar


def cmd_export(args: argparse.Namespace) -> int:
    root = existing_root(args.root)

    def write(plan: ExportPlan) -> ExportResult:
        with progress_bar(f"exporting step {plan.step}", plan.total_bytes) as advance:
            return write_export(plan, args.to, force=args.force, progress=advance)

    result = export_chosen(
        root,
        write,
        step=args.step,
        key=args.key,
        format=args.format,
        dtype=args.dtype,
        shard_size=args.shard_size,
    )
    if args.json:
        print_json(result.to_json())
    else:
        out().print(
            f"exported {result.tensors} tensors ({human_size(result.bytes)}) of step {result.step} to "
            f"{result.path}" + (f" in {len(result.files) - 1} shard(s)" if args.format != SAFETENSORS else "")
        )
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    directory = import_weights(
        args.weights,
        args.to,
        step=args.step,
        key=args.key,
        overwrite=args.overwrite,
        lock_timeout=args.lock_timeout,
    )
    if args.json:
        print_json(
            {"root": str(directory.parent), "step": args.step, "path": str(directory), "key": args.key}
        )
    else:
        out().print(
            f"saved {args.weights} as step {args.step} of {directory.parent}; resume from it with "
            f"mgr.restore({{{args.key!r}: model}})"
        )
    return EXIT_OK
