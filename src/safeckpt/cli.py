"""The ``safeckpt`` command: the demo, and a look at and care of checkpoint roots.

    safeckpt demo [--dir DIR] [--steps N] [--save-every K] [--kill-at STEP] ...
    safeckpt ls ROOT [--json] [--keep-last N] [--keep-best K --metric NAME] ...
    safeckpt verify ROOT [--step N] [--json]
    safeckpt prune ROOT --keep-last N ... [--dry-run] [--json]
    safeckpt pin ROOT STEP / safeckpt unpin ROOT STEP

Each command is a thin layer over :mod:`safeckpt.catalog` and
:mod:`safeckpt.maintenance`. None of them starts a ``CheckpointManager`` on the
root (except ``demo``, on its own root): a manager collects ``.staging/``
leftovers when it starts, which would destroy the saves in flight of a
training job running on that root.

Errors: one table in :func:`main` turns each safeckpt error into a single line
on stderr and an exit code (1: failed, 2: bad usage, 130: interrupted); set
``SAFECKPT_DEBUG=1`` to see the traceback as well.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from rich.console import Console

from ._version import __version__
from .cli_args import add_retention_arguments, non_negative_int, retention_from_args
from .errors import (
    CheckpointError,
    ConfigError,
    InvalidSaveError,
    LockTimeoutError,
)

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# exception type -> (exit code, what to add to its message). First match wins.
_ERRORS: tuple[tuple[type[BaseException], int, str], ...] = (
    (ConfigError, EXIT_USAGE, ""),
    (InvalidSaveError, EXIT_USAGE, ""),
    (
        LockTimeoutError,
        EXIT_FAILED,
        " Another process (a training job, or another safeckpt command) holds the root's lock; "
        "try again once it is done.",
    ),
    (CheckpointError, EXIT_FAILED, ""),
    (PermissionError, EXIT_FAILED, " Check the permissions of the checkpoint root."),
    (OSError, EXIT_FAILED, ""),
    (KeyboardInterrupt, EXIT_INTERRUPTED, ""),
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, like every other error of this command (argparse prints the usage too)."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}. See '{self.prog} --help'.\n")


def _out() -> Console:
    # soft_wrap: long lines (a hash, a path) stay whole when piped, where the width is 80
    return Console(highlight=False, soft_wrap=True)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


# --- commands ------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run

    return run(args)


def cmd_ls(args: argparse.Namespace) -> int:
    from .cli_ls import listing, render

    data = listing(args.root, retention_from_args(args))
    if args.json:
        _print_json(data)
    else:
        render(_out(), data)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .catalog import scan
    from .cli_ls import existing_root
    from .maintenance import verify

    root = existing_root(args.root)
    report = verify(root, args.step)
    catalog = scan(root)
    latest_problem = None
    if args.step is None and report and catalog.latest_step is None:
        latest_problem = (
            "`latest` is missing"
            if catalog.latest_name is None
            else f"`latest` names {catalog.latest_name}, which is not a committed checkpoint"
        ) + "; auto-resume falls back to the newest complete checkpoint"
    elif args.step is None and catalog.latest_step is not None and report.get(catalog.latest_step):
        latest_problem = f"`latest` names step {catalog.latest_step}, which is broken"
    broken = sorted(step for step, problems in report.items() if problems)
    if args.json:
        _print_json(
            {
                "root": str(root),
                "checkpoints": {str(step): problems for step, problems in report.items()},
                "latest_problem": latest_problem,
                "ok": not broken and latest_problem is None,
            }
        )
    else:
        out = _out()
        if not report:
            out.print(f"no checkpoints in {root}")
        for step, problems in report.items():
            if problems:
                out.print(f"step {step}: [red]BROKEN[/]: {'; '.join(problems)}")
            else:
                out.print(f"step {step}: ok")
        if latest_problem:
            out.print(f"[red]{latest_problem}[/]")
        if report:
            out.print(f"{len(report)} checked, {len(broken)} broken")
    return EXIT_FAILED if broken or latest_problem else 0


def cmd_prune(args: argparse.Namespace) -> int:
    from .cli_ls import existing_root
    from .maintenance import prune

    retention = retention_from_args(args)
    if retention is None:
        raise ConfigError(
            "prune needs a rule: --keep-last N, --keep-best K --metric NAME, or --keep-every N "
            "(without one every checkpoint is kept, so there is nothing to remove)."
        )
    root = existing_root(args.root)
    result = prune(root, retention, dry_run=args.dry_run)
    if args.json:
        _print_json(
            {
                "root": str(root),
                "dry_run": args.dry_run,
                "removed": result.removed,
                "kept": result.kept,
                "left_in_trash": [str(p) for p in result.left_in_trash],
            }
        )
        return 0
    out = _out()
    kept = ", ".join(map(str, result.kept)) or "none"
    if not result.removed:
        out.print(f"nothing to remove in {root}; kept step(s) {kept}")
    elif args.dry_run:
        out.print(f"would remove step(s) {', '.join(map(str, result.removed))}; would keep {kept} (dry run)")
    else:
        out.print(f"removed step(s) {', '.join(map(str, result.removed))} from {root}; kept {kept}")
    if result.left_in_trash:
        print(
            f"safeckpt: warning: {len(result.left_in_trash)} removed checkpoint(s) are still in "
            f"{root / '.trash'} (the filesystem kept refusing to delete them); the next prune or "
            "manager start retries.",
            file=sys.stderr,
        )
    return 0


def cmd_pin(args: argparse.Namespace) -> int:
    from .cli_ls import existing_root
    from .maintenance import set_pinned

    root = existing_root(args.root)
    set_pinned(root, args.step, args.pinned)
    if args.pinned:
        _out().print(f"pinned step {args.step} in {root}: no prune removes it until `safeckpt unpin`")
    else:
        _out().print(f"unpinned step {args.step} in {root}: retention decides about it again")
    return 0


# --- parser and main ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from .demo import add_arguments as add_demo_arguments

    parser = _Parser(prog="safeckpt", description="Crash-safe, async checkpoints for PyTorch.")
    parser.add_argument("--version", action="version", version=f"safeckpt {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    demo = commands.add_parser(
        "demo",
        help="train a small model with checkpoints; kill it and run again to see it resume",
        description="Train a small seeded model on CPU with async checkpoints. Run it again to resume; "
        "the final weights hash is the same whether or not the run was interrupted.",
    )
    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    ls = commands.add_parser(
        "ls",
        help="list the checkpoints of a root",
        description="List the "
        "checkpoints of ROOT: step, time, size, metrics, status, why each is kept. "
        "With retention options, also what a prune with them would remove.",
    )
    ls.add_argument("root", metavar="ROOT")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_retention_arguments(ls)
    ls.set_defaults(func=cmd_ls)

    verify = commands.add_parser(
        "verify",
        help="check that checkpoints are complete and readable (exit 1 if not)",
        description="Check every checkpoint of ROOT (or one step) against its record: every file "
        "present with its size, DCP metadata readable. Exit code 1 if anything is wrong.",
    )
    verify.add_argument("root", metavar="ROOT")
    verify.add_argument("--step", type=non_negative_int, metavar="N", help="check only step N")
    verify.add_argument("--json", action="store_true", help="print JSON")
    verify.set_defaults(func=cmd_verify)

    prune = commands.add_parser(
        "prune",
        help="remove the checkpoints retention does not keep",
        description="Remove the checkpoints of ROOT that the retention rules do not keep. Never "
        "removes the one `latest` names, pinned ones, or saves in progress; safe while a job trains.",
    )
    prune.add_argument("root", metavar="ROOT")
    add_retention_arguments(prune)
    prune.add_argument("--dry-run", action="store_true", help="say what would be removed; change nothing")
    prune.add_argument("--json", action="store_true", help="print JSON")
    prune.set_defaults(func=cmd_prune)

    for name, pinned, text in (
        ("pin", True, "keep a checkpoint whatever retention says"),
        ("unpin", False, "let retention decide about a checkpoint again"),
    ):
        sub = commands.add_parser(name, help=text, description=f"{text[0].upper()}{text[1:]}.")
        sub.add_argument("root", metavar="ROOT")
        sub.add_argument("step", metavar="STEP", type=non_negative_int)
        sub.set_defaults(func=cmd_pin, pinned=pinned)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``safeckpt`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # the reader went away (`safeckpt ls ROOT | head`): not an error worth a line; keep
        # Python from complaining again when it flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except BaseException as e:
        match = next(((code, hint) for kind, code, hint in _ERRORS if isinstance(e, kind)), None)
        if match is None:
            raise  # not ours to explain: a bug, shown with its traceback
        code, hint = match
        if os.environ.get("SAFECKPT_DEBUG", "") not in ("", "0"):
            traceback.print_exc()
        print(f"safeckpt: error: {_describe(e)}{hint}", file=sys.stderr)
        return code


def _describe(error: BaseException) -> str:
    if isinstance(error, KeyboardInterrupt):
        return "interrupted. Committed checkpoints are safe; run the command again to resume."
    if isinstance(error, CheckpointError):
        return str(error)
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return f"{error.strerror}{where}."
    return f"{type(error).__name__}: {error}"


if __name__ == "__main__":
    sys.exit(main())
