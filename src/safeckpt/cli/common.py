"""What every ``safeckpt`` command shares: exit codes, the error table, JSON, console and progress.

Output rules: data goes to stdout (a rich table on a terminal, plain text when
piped, JSON with ``--json``); progress bars and errors go to stderr, and a bar
is drawn only when stderr is a terminal, so a pipe or a log file never sees one.
Every table goes through :func:`print_table`: piped, it is one line per row with
space-aligned columns, never box-drawn, wrapped or folded, whatever the width.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from .._store.base import DIR
from .._store.loc import Loc, as_root
from .._store.registry import check_root
from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError, InvalidSaveError, LockTimeoutError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

SCHEMA_VERSION = 1
"""Version of every ``--json`` document (see docs/cli.md); bumped only when a key changes meaning
or goes away. New keys may appear without a bump."""

# exception type -> (exit code, what to add to its message). First match wins.
ERRORS: tuple[tuple[type[BaseException], int, str], ...] = (
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


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, like every other error of this command (argparse prints the usage too)."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}. See '{self.prog} --help'.\n")


def add_command(
    commands: Any, name: str, *, help: str, description: str, examples: str
) -> argparse.ArgumentParser:
    """A subcommand parser whose ``--help`` ends with ``examples`` (one command per line)."""
    epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples.strip().splitlines())
    return commands.add_parser(
        name,
        help=help,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def out() -> Console:
    """The stdout console: rich on a terminal, plain text when piped."""
    # rich is imported by the commands that print, not with the parser: `--help` needs none of it
    from rich.console import Console

    # soft_wrap: long lines (a hash, a path) stay whole when piped, where the width is 80
    return Console(highlight=False, soft_wrap=True)


def print_table(console: Console, table: Table) -> None:
    """``table`` on ``console``: drawn by rich on a terminal, :func:`plain_table` lines otherwise."""
    if console.is_terminal:
        console.print(table)
        return
    for line in plain_table(table):
        console.out(line, highlight=False)  # out(): no markup, no wrapping, no cropping


def plain_table(table: Table) -> list[str]:
    """``table`` as plain lines: its title, a header and one line per row, columns aligned with
    spaces (numbers to the right). A cell's markup is dropped, its line breaks become spaces and
    an empty cell is ``-``, so a row stays one line, whole, at any width."""
    columns = table.columns
    header = [_plain_cell(c.header) for c in columns]
    rows = [header, *zip(*([_plain_cell(cell) for cell in c.cells] for c in columns), strict=True)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = [_plain_text(table.title)] if table.title else []
    for row in rows:
        cells = [
            cell.rjust(width) if column.justify == "right" else cell.ljust(width)
            for cell, width, column in zip(row, widths, columns, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _plain_text(value: object) -> str:
    from rich.text import Text

    text = Text.from_markup(value) if isinstance(value, str) else value
    return text.plain if isinstance(text, Text) else str(value)


def _plain_cell(value: object) -> str:
    return " ".join(_plain_text(value).split()) or "-"


def print_json(data: dict[str, Any]) -> None:
    """``data`` on stdout as strict JSON, with ``schema_version`` first (NaN and inf become null)."""
    document = _finite({"schema_version": SCHEMA_VERSION, **data})
    print(json.dumps(document, indent=2, allow_nan=False, default=str))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def existing_root(root: str | os.PathLike[str]) -> Loc:
    """The top of ``root``'s store; raises unless it is an existing directory."""
    top = as_root(root)
    check_root(top.store, writing=False)  # a file, a link, or under a file: said so
    entry = top.entry()
    if entry is None:
        raise CheckpointNotFoundError(
            f"{root} does not exist. Pass the checkpoint root of a run (the directory given to "
            "CheckpointManager, or the --dir of `safeckpt demo`).",
            path=str(top),
        )
    if entry.kind != DIR:
        raise CheckpointError(f"{root} is not a directory; pass a checkpoint root.", path=str(top))
    return top


@contextlib.contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """A callback ``advance(n_bytes)`` that drives a progress bar on stderr, if it is a terminal.

    When stderr is not a terminal the callback does nothing: piped output stays clean.
    """
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda n: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run one command; turn the errors of :data:`ERRORS` into one line on stderr and an exit code."""
    try:
        return int(func(args))
    except BrokenPipeError:
        # the reader went away (`safeckpt ls ROOT | head`): not an error worth a line; keep
        # Python from complaining again when it flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except BaseException as e:
        e = _from_the_storage(e, args)
        match = next(((code, hint) for kind, code, hint in ERRORS if isinstance(e, kind)), None)
        if match is None:
            raise  # not ours to explain: a bug, shown with its traceback
        code, hint = match
        if os.environ.get("SAFECKPT_DEBUG", "") not in ("", "0"):
            traceback.print_exc()
        print(f"safeckpt: error: {describe(e)}{hint}", file=sys.stderr)
        return code


def _from_the_storage(error: BaseException, args: argparse.Namespace) -> BaseException:
    """A raw error of a URL root's storage (a server's refusal, no answer) as the library says it:
    with the server's code, what it means and what to do (its store explains it), and
    :class:`~safeckpt.RootUnreachableError` for a server that does not answer."""
    root = getattr(args, "root", None)
    if not isinstance(error, OSError) or isinstance(error, CheckpointError) or not isinstance(root, str):
        return error
    if "://" not in root or root.startswith("file://"):
        return error  # a local root's errors are the filesystem's own, said as they are
    from .._dist.failures import unreachable

    top = as_root(root)
    if isinstance(error, ConnectionError):
        explained: BaseException = unreachable(top, error, doing=f"safeckpt {args.command}")
    else:
        cause, remedy = top.store.explain_error(error)
        explained = CheckpointError(f"{root}: {cause}. To fix it: {remedy}.", path=root)
    explained.__cause__ = error
    return explained


def describe(error: BaseException) -> str:
    """One line for ``error``."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted. Committed checkpoints are safe; run the command again to resume."
    if isinstance(error, CheckpointError):
        return " ".join(str(error).split("\n"))
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return f"{error.strerror}{where}."
    return f"{type(error).__name__}: {error}"
