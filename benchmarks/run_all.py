"""Regenerate the tables of ``docs/performance.md`` with one command.

    .venv/bin/python benchmarks/run_all.py                 # every section (also: make bench)
    .venv/bin/python benchmarks/run_all.py --only bench_save --quick
    .venv/bin/python benchmarks/run_all.py --dry-run       # list the commands

Each section is one benchmark command whose standard output is Markdown (its
progress goes to standard error). Its output replaces the block between
``<!-- bench:<key>:start -->`` and ``<!-- bench:<key>:end -->`` in the document;
a section not in the document yet is appended under its title. Everything
outside the markers (the analysis of missed targets) is left as it is. A
section that fails or cannot run (no FUSE, no second rank) keeps its previous
block, with a line saying why it was not refreshed; a section that exits with
status 77 (``SKIPPED``: it cannot run on this machine, e.g. no FUSE) does not
make ``run_all`` fail, any other non-zero status does.

To add a section, append a :class:`Section` to ``SECTIONS``; a multi-rank
benchmark gives its launcher in ``command`` (``torchrun --nproc-per-node 2 ...``)
and prints its Markdown on rank 0 only.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import filesystem_of, machine

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "performance.md"
PYTHON = ".venv/bin/python"
SKIPPED = 77  # exit status of a benchmark that cannot run here (the automake convention)


@dataclass(frozen=True)
class Section:
    """One benchmark command and where its Markdown goes."""

    key: str
    title: str
    command: tuple[str, ...]
    """Run from the repository root; prints Markdown on stdout."""
    quick: tuple[str, ...] = field(default=())
    """Extra arguments for ``--quick``."""

    def argv(self, quick: bool) -> list[str]:
        return [*self.command, *(self.quick if quick else ())]


SECTIONS: tuple[Section, ...] = (
    Section(
        key="bench_save",
        title="Single process: save, restore, step time, cleanup",
        command=(PYTHON, "benchmarks/bench_save.py"),
        quick=("--size-gib", "0.25", "--reps", "3"),
    ),
    Section(
        key="bench_ranks",
        title="Two ranks: sharded saves",
        command=(PYTHON, "benchmarks/bench_ranks.py"),
        quick=("--size-gib", "0.25", "--reps", "3"),
    ),
    Section(
        key="bench_nfs_prune",
        title="Pruning on emulated NFS",
        command=(PYTHON, "benchmarks/bench_nfs_prune.py"),
        quick=("--seeds", "0"),
    ),
)


def begin(key: str) -> str:
    return f"<!-- bench:{key}:start -->"


def end(key: str) -> str:
    return f"<!-- bench:{key}:end -->"


def replace_block(doc: str, key: str, title: str, body: str) -> str:
    """``doc`` with the block of ``key`` replaced by ``body`` (appended under ``title`` if absent)."""
    block = f"{begin(key)}\n{body.rstrip()}\n{end(key)}"
    pattern = re.compile(re.escape(begin(key)) + r".*?" + re.escape(end(key)), re.DOTALL)
    if pattern.search(doc):
        return pattern.sub(lambda _: block, doc, count=1)
    return doc.rstrip() + f"\n\n## {title}\n\n{block}\n"


def current_block(doc: str, key: str) -> str | None:
    match = re.search(re.escape(begin(key)) + r"\n(.*?)\n" + re.escape(end(key)), doc, re.DOTALL)
    return match.group(1) if match else None


def machine_block() -> str:
    info = machine() | {"filesystem (benchmark files)": filesystem_of(Path(tempfile.gettempdir()))}
    lines = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in info.items())]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"Last regenerated {stamp} on:\n\n" + "\n".join(lines)


@dataclass(frozen=True)
class Outcome:
    markdown: str | None
    why_not: str = ""
    failed: bool = False


def run_section(section: Section, quick: bool) -> Outcome:
    """The section's Markdown, or why there is none (and whether that is a failure)."""
    argv = section.argv(quick)
    if argv[0] == PYTHON and not (REPO / argv[1]).exists():
        return Outcome(None, f"{argv[1]} does not exist", failed=True)
    print(f"[run_all] {shlex.join(argv)}", file=sys.stderr, flush=True)
    done = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode == SKIPPED:
        return Outcome(None, f"`{shlex.join(argv)}` cannot run on this machine (see its message)")
    if done.returncode != 0:
        return Outcome(None, f"`{shlex.join(argv)}` exited with status {done.returncode}", failed=True)
    if not done.stdout.strip():
        return Outcome(None, f"`{shlex.join(argv)}` printed nothing", failed=True)
    return Outcome(done.stdout)


def main(argv: list[str] | None = None) -> int:
    keys = [s.key for s in SECTIONS]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=keys, default=keys, help="sections to run")
    p.add_argument("--quick", action="store_true", help="smaller, faster runs (not for the published table)")
    p.add_argument("--doc", type=Path, default=DOC, help="the document to update")
    p.add_argument("--dry-run", action="store_true", help="print the commands and change nothing")
    args = p.parse_args(argv)
    chosen = [s for s in SECTIONS if s.key in args.only]
    if args.dry_run:
        for section in chosen:
            print(shlex.join(section.argv(args.quick)))
        return 0
    doc = args.doc.read_text() if args.doc.exists() else "# Performance\n"
    failed = 0
    for section in chosen:
        outcome = run_section(section, args.quick)
        body = outcome.markdown
        if body is None:
            failed += outcome.failed
            previous = current_block(doc, section.key) or "_Not measured yet._"
            previous = re.sub(r"\n*_Not refreshed in the last run: .*_$", "", previous)
            body = f"{previous}\n\n_Not refreshed in the last run: {outcome.why_not}._"
            print(f"[run_all] {section.key}: not refreshed: {outcome.why_not}", file=sys.stderr)
        elif args.quick:
            body += "\n_Quick run (`run_all.py --quick`): smaller state, fewer repetitions._\n"
        doc = replace_block(doc, section.key, section.title, body)
        args.doc.write_text(doc)  # after each section: a later failure keeps what is done
    doc = replace_block(doc, "machine", "Machine", machine_block())
    args.doc.write_text(doc)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
