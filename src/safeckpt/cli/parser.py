"""The ``safeckpt`` command line: every command's arguments, help and examples, and what runs it.

Nothing here imports a command's implementation: ``safeckpt --help``, a command's
``--help`` and a usage error are answered without importing torch, DCP or rich,
and a command imports its own module only when it runs (:class:`Runs`).
``tests/test_startup.py`` checks it; ``benchmarks/bench_startup.py`` times it.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._version import __version__
from .args import add_retention_arguments, byte_size, non_negative_int, positive_int
from .common import Parser, add_command

# What _ops.export takes, written out because importing it imports torch; tests/test_startup.py
# checks that they agree.
EXPORT_FORMATS = ("safetensors", "hf")
EXPORT_DTYPES = ("bf16", "fp16", "fp32")
EXPORT_SHARD_SIZE = 5 * 10**9

DEMO_DIR = "runs/demo"
DEMO_STEPS = 300
DEMO_SAVE_EVERY = 25
DEMO_KEEP_LAST = 3
DEMO_KEEP_BEST = 1
DEMO_METRIC = "loss"


def build_parser() -> Parser:
    parser = Parser(
        prog="safeckpt",
        description="Crash-safe, async checkpoints for PyTorch: look after checkpoint roots.",
        epilog="Run 'safeckpt COMMAND --help' for a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"safeckpt {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for group in (_demo, _ls, _inspect, _verify, _prune, _gc, _export, _register, _upload):
        group(commands)
    return parser


@dataclass(frozen=True)
class Runs:
    """What runs a command: ``function`` of ``safeckpt.cli.<module>``, imported when it runs."""

    module: str
    function: str

    def resolve(self) -> Callable[[argparse.Namespace], int]:
        implementation = importlib.import_module(f"{__package__}.{self.module}")
        return getattr(implementation, self.function)

    def __call__(self, args: argparse.Namespace) -> int:
        return int(self.resolve()(args))


def _demo(commands: Any) -> None:
    parser = add_command(
        commands,
        "demo",
        help="train a small model with checkpoints; kill it and run again to see it resume",
        description="Train a small seeded model on CPU with async checkpoints. Run it again to resume; "
        "the final weights hash is the same whether or not the run was interrupted.",
        examples="""
safeckpt demo --dir /tmp/demo --steps 200 --kill-at 120   # dies at step 120
safeckpt demo --dir /tmp/demo --steps 200                 # resumes, same final hash
torchrun --nproc-per-node 2 -m safeckpt.demo --dir /tmp/demo2
""",
    )
    parser.add_argument(
        "--dir",
        default=DEMO_DIR,
        help=f"checkpoint root: a directory or an s3:// URL (default: {DEMO_DIR})",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=DEMO_STEPS,
        help="optimizer steps in all (default: %(default)s)",
    )
    parser.add_argument(
        "--save-every",
        type=positive_int,
        default=DEMO_SAVE_EVERY,
        metavar="K",
        help="save every K steps, and at the last step (default: %(default)s)",
    )
    parser.add_argument(
        "--kill-at",
        type=positive_int,
        metavar="STEP",
        help="SIGKILL this process once STEP steps are done (after that step's save), to show a crash; "
        "run again without it to resume",
    )
    parser.add_argument(
        "--keep-last",
        type=positive_int,
        default=DEMO_KEEP_LAST,
        metavar="N",
        help="keep the N newest checkpoints (default: %(default)s)",
    )
    parser.add_argument(
        "--keep-best",
        type=non_negative_int,
        default=DEMO_KEEP_BEST,
        metavar="K",
        help=f"also keep the K checkpoints with the lowest {DEMO_METRIC}; 0: none (default: %(default)s)",
    )
    parser.add_argument(
        "--weights-out", metavar="PATH", help="write the final model weights to PATH as a safetensors file"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, the data and dropout")
    parser.set_defaults(func=Runs("demo_run", "run"))


def _ls(commands: Any) -> None:
    ls = add_command(
        commands,
        "ls",
        help="list the checkpoints of a root",
        description="List the checkpoints of ROOT: step, time, size, metrics, status, why each is "
        "kept. With retention options, also what a prune with them would remove.",
        examples="""
safeckpt ls runs/exp1
safeckpt ls runs/exp1 --keep-last 3 --keep-best 2 --metric loss   # what would a prune keep?
safeckpt ls runs/exp1 --json | jq '.checkpoints[].step'
safeckpt ls s3://bucket/runs/exp1 --local-dir /local/nvme/exp1   # local, durable, uploading
""",
    )
    ls.add_argument("root", metavar="ROOT")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.add_argument(
        "--local-dir",
        metavar="DIR",
        help="the local tier of a run with two tiers (local_dir=): show which tiers hold each "
        "checkpoint, and the local ones not uploaded yet",
    )
    add_retention_arguments(ls)
    ls.set_defaults(func=Runs("ls", "cmd_ls"))


def _inspect(commands: Any) -> None:
    parser = add_command(
        commands,
        "inspect",
        help="show a checkpoint: record, files, tensors (shapes, dtypes, sharding), train state",
        description="Show one checkpoint of ROOT: its record (step, time, status, metrics, extra, "
        "registration, why it is kept), its files, every tensor in DCP's .metadata with shape, "
        "dtype, size and sharding (no tensor data is read), and the JSON part of the train state. "
        "Without STEP: the checkpoint auto-resume would load.",
        examples="""
safeckpt inspect runs/exp1                 # what a restart would resume from
safeckpt inspect runs/exp1 2000
safeckpt inspect runs/exp1 step_2000 --json | jq '.tensors[] | select(.sharded)'
""",
    )
    parser.add_argument("root", metavar="ROOT")
    parser.add_argument(
        "target", metavar="STEP|PATH", nargs="?", help="a step number or a step_<N> directory"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (schema in docs/cli.md)")
    parser.set_defaults(func=Runs("inspect", "cmd_inspect"))


def _verify(commands: Any) -> None:
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
    parser.set_defaults(func=Runs("verify", "cmd_verify"))


def _prune(commands: Any) -> None:
    parser = add_command(
        commands,
        "prune",
        help="remove the checkpoints retention does not keep",
        description="Remove the checkpoints of ROOT that the retention rules do not keep; with no "
        "rule, those the job's recorded retention (in its newest record) does not keep. Says which "
        "rule it applied. Never removes the one `latest` names, pinned ones, or saves in progress; "
        "safe while a job trains.",
        examples="""
safeckpt prune runs/exp1 --dry-run                 # the job's own retention: what would go?
safeckpt prune runs/exp1 --keep-last 3 --dry-run
safeckpt prune runs/exp1 --keep-last 2 --keep-best 1 --metric loss
safeckpt prune runs/exp1 --keep-last 1 --keep-milestones pow2
""",
    )
    parser.add_argument("root", metavar="ROOT")
    add_retention_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="say what would be removed; change nothing")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=Runs("prune", "cmd_prune"))

    for name, pinned, text in (
        ("pin", True, "keep a checkpoint whatever retention says"),
        ("unpin", False, "let retention decide about a checkpoint again"),
    ):
        sub = add_command(
            commands,
            name,
            help=text,
            description=f"{text[0].upper()}{text[1:]}.",
            examples=f"safeckpt {name} runs/exp1 2000",
        )
        sub.add_argument("root", metavar="ROOT")
        sub.add_argument("step", metavar="STEP", type=non_negative_int)
        sub.set_defaults(func=Runs("prune", "cmd_pin"), pinned=pinned)


def _gc(commands: Any) -> None:
    parser = add_command(
        commands,
        "gc",
        help="remove leftovers: dead owners' staging, trash, damaged checkpoints moved aside, "
        ".nfs/.fuse_hidden files, temp files",
        description="Remove what crashes and old versions left in ROOT: .staging/ entries when no live "
        "job owns the root (never a live job's saves in flight), .trash/, checkpoints auto-resume "
        "moved aside into .damaged/, .nfs* and .fuse_hidden* files no longer in use, and orphan temp "
        "files. Holds the sidecar lock; safe while a job trains. Reports the bytes freed.",
        examples="""
safeckpt gc runs/exp1 --dry-run
safeckpt gc runs/exp1 --json | jq .bytes_freed
""",
    )
    parser.add_argument("root", metavar="ROOT")
    parser.add_argument("--dry-run", action="store_true", help="say what would be removed; change nothing")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="how long to keep retrying deletions the filesystem refuses (default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=Runs("gc", "cmd_gc"))


def _export(commands: Any) -> None:
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
        choices=EXPORT_FORMATS,
        default=EXPORT_FORMATS[0],
        help="safetensors: one file; hf: model-0000i-of-0000N.safetensors + model.safetensors.index.json",
    )
    export.add_argument("--dtype", choices=EXPORT_DTYPES, help="convert floating-point tensors")
    export.add_argument(
        "--shard-size",
        type=byte_size,
        default=EXPORT_SHARD_SIZE,
        metavar="SIZE",
        help="largest file of the hf format, e.g. 5GB, 500MB (default: 5GB)",
    )
    export.add_argument("--force", action="store_true", help="replace OUT if it exists")
    export.add_argument("--json", action="store_true", help="print JSON")
    export.set_defaults(func=Runs("export", "cmd_export"))

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
    imp.set_defaults(func=Runs("export", "cmd_import"))


def _register(commands: Any) -> None:
    parser = add_command(
        commands,
        "register",
        help="retry failed or unfinished registrations, or register checkpoints with a registrar",
        description="Register the committed checkpoints of ROOT whose registration failed or was "
        "not finished, with the registrar their record names; with --registrar also those never "
        "registered; with --step just that one, whatever its record says. Exit 1 if any fails.",
        examples="""
safeckpt register runs/exp1
safeckpt register runs/exp1 --step 2000 --json
safeckpt register runs/exp1 --registrar '{"kind": "jsonl", "index_path": "runs/index.jsonl"}'
""",
    )
    parser.add_argument("root", metavar="ROOT")
    parser.add_argument("--step", type=non_negative_int, metavar="N", help="register step N")
    parser.add_argument(
        "--registrar", metavar="JSON", help="the registrar to use, as its to_json() (a 'kind' key and fields)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=Runs("register", "cmd_register"))


def _upload(commands: Any) -> None:
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
    parser.set_defaults(func=Runs("upload", "cmd_upload"))
