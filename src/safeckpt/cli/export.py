"""``safeckpt export`` and ``safeckpt import``: model weights out to safetensors / HF, and back in."""

from __future__ import annotations

import argparse
from typing import Any

from .._dist.failures import human_size
from .._ops.export import (
    DEFAULT_SHARD_SIZE,
    DTYPES,
    FORMATS,
    SAFETENSORS,
    ExportPlan,
    ExportResult,
    export_chosen,
    write_export,
)
from .._ops.weights_import import import_weights
from .args import byte_size, non_negative_int
from .common import EXIT_OK, add_command, existing_root, out, print_json, progress_bar


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


def add_parser(commands: Any) -> None:
    export = add_command(
        commands,
        "export",
        help="write a checkpoint's model weights as safetensors (one file, or a Hugging Face folder)",
        description="Write the tensors saved under --key of a checkpoint of ROOT (default: the one "
        "auto-resume would load) to --to, named as in model.state_dict(). Works from sharded "
        "(multi-rank) checkpoints, reading a group of tensors at a time. The output appears whole "
        "or not at all; an existing one is replaced only with --force.",
        examples="""
safeckpt export runs/exp1 --to model.safetensors
safeckpt export runs/exp1 --step 2000 --format hf --dtype bf16 --shard-size 2GB --to hf-model/
""",
    )
    export.add_argument("root", metavar="ROOT")
    export.add_argument("--to", required=True, metavar="OUT", help="output file (safetensors) or folder (hf)")
    export.add_argument("--step", type=non_negative_int, metavar="N", help="the step to export")
    export.add_argument(
        "--key", default="model", help="the key of the model in the saved state (default: model)"
    )
    export.add_argument(
        "--format",
        choices=FORMATS,
        default=SAFETENSORS,
        help="safetensors: one file; hf: model-0000i-of-0000N.safetensors + model.safetensors.index.json",
    )
    export.add_argument("--dtype", choices=tuple(DTYPES), help="convert floating-point tensors")
    export.add_argument(
        "--shard-size",
        type=byte_size,
        default=DEFAULT_SHARD_SIZE,
        metavar="SIZE",
        help="largest file of the hf format, e.g. 5GB, 500MB (default: 5GB)",
    )
    export.add_argument("--force", action="store_true", help="replace OUT if it exists")
    export.add_argument("--json", action="store_true", help="print JSON")
    export.set_defaults(func=cmd_export)

    imp = add_command(
        commands,
        "import",
        help="start a run from safetensors weights: save them as a checkpoint of a root",
        description="Save a safetensors file, or a folder of them (Hugging Face style), as checkpoint "
        "--step of ROOT under --key, so `mgr.restore({'model': model})` starts from it.",
        examples="""
safeckpt import model.safetensors --to runs/finetune --step 0
safeckpt import hf-model/ --to runs/finetune
""",
    )
    imp.add_argument("weights", metavar="WEIGHTS", help="a .safetensors file or a folder of them")
    imp.add_argument("--to", required=True, metavar="ROOT", help="the checkpoint root (created if missing)")
    imp.add_argument(
        "--step", type=non_negative_int, default=0, metavar="N", help="step to save as (default: 0)"
    )
    imp.add_argument("--key", default="model", help="the key of the model in the state (default: model)")
    imp.add_argument("--overwrite", action="store_true", help="replace step N if the root has it")
    imp.add_argument(
        "--lock-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="how long to wait for a job that writes to ROOT (default: %(default)s)",
    )
    imp.add_argument("--json", action="store_true", help="print JSON")
    imp.set_defaults(func=cmd_import)
